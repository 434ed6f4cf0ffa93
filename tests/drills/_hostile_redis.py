"""A hostile Redis for the drills: a TCP proxy in front of a real redis-server that passes every
command and reply through, except where its mode says to answer wrongly.

    python tests/drills/_hostile_redis.py --upstream-port PORT

Prints the port it listens on (loopback) as its first line. Standard library only; run as its
own process so the client under test shares nothing with it.

Control, on a connection of its own (never forwarded; answered at once)::

    HOSTILE MODE <mode> [n]  ->  +OK    the mode for commands received from now on
    HOSTILE STATS         ->  $<json>   how many replies each mode has falsified

Modes (each applies to the commands named; every other command passes through):

* ``pass`` — a plain proxy.
* ``oversize`` — a GETRANGE's bulk header announces 256 MiB (``$268435456``), the real value
  follows, then the connection is closed.
* ``negative-set`` / ``nil-set`` / ``bulk-set`` / ``int-set`` — a SET is not stored (the proxy
  sends PING upstream in its place, keeping replies in order) and is answered ``$-5``, ``$-1``,
  ``$2 OK`` or ``:1`` instead of ``+OK``.
* ``drop-mid-bulk`` (``n``, default 2) — once ``n`` GETRANGE replies of 1 KiB or more went
  through since the mode was set (on any connection), each later one: its header and the first
  half of its value are sent, then the connection is closed.
* ``array-getrange`` — a GETRANGE is answered with a one-element array holding its value.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys

MODES = ("pass", "oversize", "negative-set", "nil-set", "bulk-set", "int-set", "drop-mid-bulk", "array-getrange")
_FAKE_SET = {"negative-set": b"$-5\r\n", "nil-set": b"$-1\r\n", "bulk-set": b"$2\r\nOK\r\n", "int-set": b":1\r\n"}
_PING = b"*1\r\n$4\r\nPING\r\n"

mode = "pass"
drop_after = 2  # drop-mid-bulk: GETRANGE replies passed on whole first
passed = 0  # GETRANGE replies of 1 KiB or more passed on whole since the mode was set
falsified: collections.Counter[str] = collections.Counter()


async def _command(reader: asyncio.StreamReader) -> tuple[list[bytes], bytes] | None:
    """One RESP array of bulk strings from a client: (arguments, raw bytes); None at EOF."""
    line = await reader.readline()
    if not line:
        return None
    if not line.startswith(b"*"):
        raise ValueError(f"not a RESP command: {line[:40]!r}")
    raw = [line]
    args = []
    for _ in range(int(line[1:])):
        head = await reader.readline()
        body = await reader.readexactly(int(head[1:]) + 2)
        raw += [head, body]
        args.append(body[:-2])
    return args, b"".join(raw)


async def _reply(reader: asyncio.StreamReader) -> tuple[bytes, bytes, bytes]:
    """One reply from the server (RESP2, or RESP3 for redis-py, which says ``HELLO 3``): (type
    byte, header line, the rest of its raw bytes)."""
    line = await reader.readline()
    if not line:
        raise EOFError
    kind = line[:1]
    if kind in b"$!=":  # blob string, blob error, verbatim string
        n = int(line[1:])
        return kind, line, (await reader.readexactly(n + 2)) if n >= 0 else b""
    if kind in b"*~>%|":  # array, set, push, map (pairs), attribute (pairs, then the reply itself)
        n = max(int(line[1:]), 0) * (2 if kind in b"%|" else 1) + (1 if kind == b"|" else 0)
        parts = [b"".join((await _reply(reader))[1:]) for _ in range(n)]
        return kind, line, b"".join(parts)
    return kind, line, b""


async def _control(args: list[bytes], writer: asyncio.StreamWriter) -> None:
    global mode, drop_after, passed
    if len(args) in (3, 4) and args[1].upper() == b"MODE" and args[2].decode() in MODES:
        mode = args[2].decode()
        drop_after = int(args[3]) if len(args) == 4 else 2
        passed = 0
        writer.write(b"+OK\r\n")
    elif len(args) == 2 and args[1].upper() == b"STATS":
        body = json.dumps({"mode": mode, "falsified": dict(falsified)}).encode()
        writer.write(b"$%d\r\n%s\r\n" % (len(body), body))
    else:
        writer.write(b"-ERR bad HOSTILE command\r\n")
    await writer.drain()


async def _serve(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, upstream_port: int) -> None:
    tags: collections.deque[tuple[bytes, str]] = collections.deque()  # (command name, mode then)
    try:
        first = await _command(client_r)
    except (ValueError, asyncio.IncompleteReadError):
        first = None
    if first is None:
        client_w.close()
        return
    if first[0][0].upper() == b"HOSTILE":
        await _control(first[0], client_w)
        client_w.close()
        return
    up_r, up_w = await asyncio.open_connection("127.0.0.1", upstream_port)

    async def requests() -> None:
        cmd: tuple[list[bytes], bytes] | None = first
        while cmd is not None:
            args, raw = cmd
            name = args[0].upper()
            m = mode
            if name == b"SET" and m in _FAKE_SET:
                raw = _PING  # nothing is stored; the reply keeps its place in the stream
            tags.append((name, m))
            up_w.write(raw)
            await up_w.drain()
            cmd = await _command(client_r)

    async def replies() -> None:
        global passed
        while True:
            kind, head, rest = await _reply(up_r)
            name, m = tags.popleft()
            if name == b"SET" and m in _FAKE_SET:
                falsified[m] += 1
                client_w.write(_FAKE_SET[m])
            elif name == b"GETRANGE" and kind == b"$" and m == "oversize":
                falsified[m] += 1
                client_w.write(b"$268435456\r\n" + rest)
                await client_w.drain()
                return
            elif (
                name == b"GETRANGE"
                and kind == b"$"
                and m == "drop-mid-bulk"
                and len(rest) >= 1024
                and passed >= drop_after
            ):
                falsified[m] += 1
                client_w.write(head + rest[: (len(rest) - 2) // 2])
                await client_w.drain()
                return
            elif name == b"GETRANGE" and m == "array-getrange":
                falsified[m] += 1
                client_w.write(b"*1\r\n" + head + rest)
            else:
                client_w.write(head + rest)
            if name == b"GETRANGE" and len(rest) >= 1024:
                passed += 1
            await client_w.drain()

    tasks = [asyncio.ensure_future(requests()), asyncio.ensure_future(replies())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for w in (client_w, up_w):
            w.close()


async def main(upstream_port: int) -> None:
    server = await asyncio.start_server(lambda r, w: _serve(r, w, upstream_port), "127.0.0.1", 0, limit=1 << 20)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream-port", type=int, required=True)
    try:
        asyncio.run(main(ap.parse_args().upstream_port))
    except KeyboardInterrupt:
        sys.exit(0)
