/* tieredkv._fastrec: the LMDB tier's checked reads and the CPU tier's host copies, in C, the GIL
 * released.
 *
 * What is here is what measured faster than tieredkv/format.py's pure-Python path by a stated
 * margin on the benches' paths (docs/native.md has the figures): the checked copies of a read
 * transaction's records (verify_many; records kept as header and payload apart,
 * verify_parts_many), the reads of records in record files (read_records, read_placed), a
 * non-temporal host copy for staging.py (stream_into), and the engine thread's check of a store or
 * load call's chunks (check_chunks, for tieredkv/store.py). Encoding records, their headers, writing
 * record files and the Redis tier's one-record checked copy are Python only (format.py): C bought
 * them under 1.2x through the pipeline.
 *
 * The record layout is not written down here: format.py hands it over at import (set_layout), and
 * every check reads it from there (tests/unit/test_native_layout.py checks that what this module
 * holds is what format.py says). A checksum is XXH3-64 (seed 0) of the stored key, then the header
 * ranges the record's version names, then the payload, through the xxHash header vendored in
 * xxhash/ (BSD-2-Clause, xxhash/LICENSE), compiled in (XXH_INLINE_ALL); on x86 its update goes
 * through xxHash's run-time dispatch (xxhash/xxh_x86dispatch.c: AVX2 or AVX-512 where the CPU has
 * them; its plain build is about half as fast). No system library is linked.
 *
 * Built as an optional extension: where it does not build, format.py and staging.py keep their
 * pure-Python paths, which write and accept the same bytes (tests/integration/test_native_fallback.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"
#if defined(__x86_64__) || defined(__i386__)
#include "xxhash/xxh_x86dispatch.h"
#define XXH3_UPDATE XXH3_64bits_update_dispatch
#else
#define XXH3_UPDATE XXH3_64bits_update
#endif

/* Below this many payload bytes the GIL is kept: releasing and taking it back costs more than
 * the copy and the checksum of a small payload. */
#define RELEASE_AT (16 * 1024)
/* From this many payload bytes a checked copy streams to its destination (see copy_checksum). */
#define STREAM_AT (64 * 1024)
#define STEP (64 * 1024)

/* ---- the record layout, from format.py (set_layout) ---- */

#define MAX_HEADER 256
#define MAX_VERSIONS 4
#define MAX_RANGES 4

typedef struct {
    Py_ssize_t at, width; /* a little-endian unsigned field of 1, 2, 4 or 8 bytes */
} field;

typedef struct {
    Py_ssize_t a, b; /* header bytes a..b */
} range;

typedef struct {
    uint64_t version;
    Py_ssize_t nhashed;
    range hashed[MAX_RANGES]; /* what the checksum covers after the key, before the payload */
    range zero;               /* must read back as zeros */
    uint64_t refused;         /* a record with any of these flags is not for this module */
} version_rule;

static struct {
    int ready;
    Py_ssize_t header, magic_at, magic_len;
    uint8_t magic[16];
    field version, header_size, flags, length, checksum;
    range fingerprint, group; /* the key's first bytes; its last bytes, reversed */
    Py_ssize_t nversions;
    version_rule versions[MAX_VERSIONS];
} L;

static uint64_t get_le(const uint8_t *p, Py_ssize_t n) {
    uint64_t v = 0;
    for (Py_ssize_t i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static int is_zero(const uint8_t *p, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

static int parse_field(PyObject *obj, field *f, const char *name) {
    if (!PyArg_ParseTuple(obj, "nn", &f->at, &f->width)) return -1;
    if (f->at < 0 || (f->width != 1 && f->width != 2 && f->width != 4 && f->width != 8) || f->at + f->width > L.header) {
        PyErr_Format(PyExc_ValueError, "layout: field %s (%zd, %zd) is not a 1, 2, 4 or 8-byte field of the header",
                     name, f->at, f->width);
        return -1;
    }
    return 0;
}

static int check_range(const range *r, const char *name) {
    if (r->a < 0 || r->a > r->b || r->b > L.header) {
        PyErr_Format(PyExc_ValueError, "layout: %s (%zd, %zd) is not a range of the header", name, r->a, r->b);
        return -1;
    }
    return 0;
}

static int parse_range(PyObject *obj, range *r, const char *name) {
    if (!PyArg_ParseTuple(obj, "nn", &r->a, &r->b)) return -1;
    return check_range(r, name);
}

static int parse_version(PyObject *obj, version_rule *v) {
    PyObject *hashed;
    unsigned long long version, refused;
    if (!PyArg_ParseTuple(obj, "KO(nn)K", &version, &hashed, &v->zero.a, &v->zero.b, &refused)) return -1;
    v->version = version;
    v->refused = refused;
    if (check_range(&v->zero, "a version's zero bytes") < 0) return -1;
    PyObject *seq = PySequence_Fast(hashed, "layout: a version's hashed ranges must be a sequence");
    if (seq == NULL) return -1;
    v->nhashed = PySequence_Fast_GET_SIZE(seq);
    int rc = 0;
    if (v->nhashed > MAX_RANGES) {
        PyErr_Format(PyExc_ValueError, "layout: at most %d hashed ranges per version", MAX_RANGES);
        rc = -1;
    }
    for (Py_ssize_t i = 0; rc == 0 && i < v->nhashed; i++)
        rc = parse_range(PySequence_Fast_GET_ITEM(seq, i), &v->hashed[i], "a hashed range");
    Py_DECREF(seq);
    return rc;
}

/* set_layout(*, header, magic, magic_at, version, header_size, fingerprint, group, flags, length,
 *            checksum, versions) -> None
 * The record layout every check here reads (format.native_layout() builds the arguments): the
 * header's size; its magic bytes and where they are; the (offset, width) of the version, header
 * size, flags, payload length and checksum fields (little-endian); the (offset, end) of the key's
 * fingerprint (the key's first bytes) and of its group (the key's last bytes, big-endian there,
 * little-endian in the header); per version (version, hashed ranges, zero range, refused flags).
 * Until it is called every record check raises RuntimeError. */
static PyObject *set_layout(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"header", "magic", "magic_at", "version", "header_size", "fingerprint", "group",
                            "flags", "length", "checksum", "versions", NULL};
    Py_ssize_t header, magic_at, magic_len;
    const char *magic;
    PyObject *fv, *fh, *ff, *fg, *ffl, *fl, *fc, *versions;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "$ny#nOOOOOOOO", names, &header, &magic, &magic_len, &magic_at, &fv,
                                     &fh, &ff, &fg, &ffl, &fl, &fc, &versions))
        return NULL;
    L.ready = 0;
    if (header <= 0 || header > MAX_HEADER || magic_len <= 0 || magic_len > (Py_ssize_t)sizeof L.magic ||
        magic_at < 0 || magic_at + magic_len > header) {
        PyErr_SetString(PyExc_ValueError, "layout: header size or magic out of range");
        return NULL;
    }
    L.header = header;
    L.magic_at = magic_at;
    L.magic_len = magic_len;
    memcpy(L.magic, magic, (size_t)magic_len);
    if (parse_field(fv, &L.version, "version") < 0 || parse_field(fh, &L.header_size, "header_size") < 0 ||
        parse_range(ff, &L.fingerprint, "fingerprint") < 0 || parse_range(fg, &L.group, "group") < 0 ||
        parse_field(ffl, &L.flags, "flags") < 0 || parse_field(fl, &L.length, "length") < 0 ||
        parse_field(fc, &L.checksum, "checksum") < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(versions, "layout: versions must be a sequence");
    if (seq == NULL) return NULL;
    L.nversions = PySequence_Fast_GET_SIZE(seq);
    int rc = L.nversions < 1 || L.nversions > MAX_VERSIONS ? -1 : 0;
    if (rc < 0) PyErr_Format(PyExc_ValueError, "layout: 1 to %d versions", MAX_VERSIONS);
    for (Py_ssize_t i = 0; rc == 0 && i < L.nversions; i++) rc = parse_version(PySequence_Fast_GET_ITEM(seq, i), &L.versions[i]);
    Py_DECREF(seq);
    if (rc < 0) return NULL;
    L.ready = 1;
    Py_RETURN_NONE;
}

/* layout() -> dict of set_layout's arguments as this module holds them (None before set_layout). */
static PyObject *layout(PyObject *self, PyObject *unused) {
    if (!L.ready) Py_RETURN_NONE;
    PyObject *versions = PyTuple_New(L.nversions);
    for (Py_ssize_t i = 0; versions != NULL && i < L.nversions; i++) {
        const version_rule *v = &L.versions[i];
        PyObject *hashed = PyTuple_New(v->nhashed);
        for (Py_ssize_t j = 0; hashed != NULL && j < v->nhashed; j++) {
            PyObject *r = Py_BuildValue("(nn)", v->hashed[j].a, v->hashed[j].b);
            if (r == NULL) Py_CLEAR(hashed);
            else PyTuple_SET_ITEM(hashed, j, r);
        }
        PyObject *item = hashed == NULL ? NULL : Py_BuildValue("(KN(nn)K)", (unsigned long long)v->version, hashed,
                                                               v->zero.a, v->zero.b, (unsigned long long)v->refused);
        if (item == NULL) Py_CLEAR(versions);
        else PyTuple_SET_ITEM(versions, i, item);
    }
    if (versions == NULL) return NULL;
    return Py_BuildValue("{s:n,s:y#,s:n,s:(nn),s:(nn),s:(nn),s:(nn),s:(nn),s:(nn),s:(nn),s:N}", "header", L.header,
                         "magic", (const char *)L.magic, L.magic_len, "magic_at", L.magic_at, "version", L.version.at,
                         L.version.width, "header_size", L.header_size.at, L.header_size.width, "fingerprint",
                         L.fingerprint.a, L.fingerprint.b, "group", L.group.a, L.group.b, "flags", L.flags.at,
                         L.flags.width, "length", L.length.at, L.length.width, "checksum", L.checksum.at,
                         L.checksum.width, "versions", versions);
}

static int need_layout(void) {
    if (L.ready) return 0;
    PyErr_SetString(PyExc_RuntimeError, "tieredkv._fastrec: no record layout (tieredkv.format sets it at import)");
    return -1;
}

/* ---- copies and checksums ---- */

#if defined(__SSE2__)
/* memcpy with non-temporal stores: the destination's lines are written without being read first
 * (a plain copy reads every destination line before writing it: a third of its memory traffic). */
static void stream_copy(uint8_t *dst, const uint8_t *src, size_t n) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
}
#define CAN_STREAM 1
#else
#define CAN_STREAM 0
#endif

/* Copies n bytes from src to dst and returns the checksum of a record with header ``head`` (of
 * version rule ``v``) for key: XXH3-64 of key, then v's hashed header ranges, then the payload, in
 * one pass of STEP-byte pieces:
 *  - plain (stream == 0): each piece copied, then hashed where it landed while still in cache;
 *  - streamed: each piece hashed where it is (which brings it into cache), then streamed to dst
 *    from there, so the payload is read from memory once and dst written once. The source must
 *    not change during the call (a record in an LMDB read transaction's snapshot, or bytes of
 *    this process): then the bytes that reach dst are the bytes hashed. */
static uint64_t copy_checksum(uint8_t *dst, const uint8_t *src, size_t n, const uint8_t *key, size_t klen,
                              const uint8_t *head, const version_rule *v, int stream) {
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    XXH3_UPDATE(&st, key, klen);
    for (Py_ssize_t i = 0; i < v->nhashed; i++)
        XXH3_UPDATE(&st, head + v->hashed[i].a, (size_t)(v->hashed[i].b - v->hashed[i].a));
    for (size_t off = 0; off < n; off += STEP) {
        size_t len = n - off < STEP ? n - off : STEP;
#if CAN_STREAM
        if (stream) {
            XXH3_UPDATE(&st, src + off, len);
            stream_copy(dst + off, src + off, len);
            continue;
        }
#endif
        memcpy(dst + off, src + off, len);
        XXH3_UPDATE(&st, dst + off, len);
    }
#if CAN_STREAM
    if (stream) _mm_sfence(); /* the streamed stores are visible before the caller reports the copy */
#endif
    return XXH3_64bits_digest(&st);
}

/* The rule of a header's version, or NULL: not a header of a version this module checks. */
static const version_rule *header_rule(const uint8_t *h, const uint8_t *key, size_t klen, uint64_t n) {
    if (memcmp(h + L.magic_at, L.magic, (size_t)L.magic_len) != 0) return NULL;
    if (get_le(h + L.header_size.at, L.header_size.width) != (uint64_t)L.header) return NULL;
    if (get_le(h + L.length.at, L.length.width) != n) return NULL;
    Py_ssize_t fp = L.fingerprint.b - L.fingerprint.a, group = L.group.b - L.group.a;
    if (memcmp(h + L.fingerprint.a, key, (size_t)fp) != 0) return NULL;
    for (Py_ssize_t i = 0; i < group; i++)
        if (h[L.group.a + i] != key[klen - 1 - (size_t)i]) return NULL;
    uint64_t version = get_le(h + L.version.at, L.version.width);
    for (Py_ssize_t i = 0; i < L.nversions; i++) {
        const version_rule *v = &L.versions[i];
        if (v->version != version) continue;
        if (get_le(h + L.flags.at, L.flags.width) & v->refused) return NULL;
        return is_zero(h + v->zero.a, v->zero.b - v->zero.a) ? v : NULL;
    }
    return NULL;
}

/* A record's checked copy, on plain memory, the GIL held or not: its header ``h``, its payload
 * ``p`` of n bytes, delivered into out (dlen bytes) if it is good for key. Returns the payload
 * length, -1 (not a good record for key: out's first n bytes zeroed if any landed) or -2 (a good
 * header, a payload longer than out: nothing copied). A payload under STREAM_AT is copied, then
 * hashed where it landed; a larger one is hashed piece by piece where it is as each piece is
 * streamed out (copy_checksum). Which header field is wrong is for format.verify_record to say
 * (the C answer is only -1). */
static Py_ssize_t check_parts(const uint8_t *h, const uint8_t *p, Py_ssize_t n, const uint8_t *key, size_t klen,
                              uint8_t *out, Py_ssize_t dlen) {
    const version_rule *v = header_rule(h, key, klen, (uint64_t)n);
    if (v == NULL) return -1;
    if (n > dlen) return -2;
    uint64_t want = get_le(h + L.checksum.at, L.checksum.width);
    uint64_t got = copy_checksum(out, p, (size_t)n, key, klen, h, v, n >= STREAM_AT);
    if (got != want) {
        memset(out, 0, (size_t)n); /* nothing unchecked stays where it landed */
        return -1;
    }
    return n;
}

static Py_ssize_t check_copy(const uint8_t *r, Py_ssize_t rlen, const uint8_t *key, size_t klen, uint8_t *out,
                             Py_ssize_t dlen) {
    if (rlen < L.header) return -1;
    return check_parts(r, r + L.header, rlen - L.header, key, klen, out, dlen);
}

/* ---- arguments ---- */

static int key_arg(PyObject *obj, const uint8_t **key, Py_ssize_t *klen) {
    if (!PyBytes_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "key must be bytes, not %.80s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    *klen = PyBytes_GET_SIZE(obj);
    Py_ssize_t least = (L.fingerprint.b - L.fingerprint.a) + (L.group.b - L.group.a);
    if (*klen < least) {
        PyErr_Format(PyExc_ValueError, "key of %zd bytes is shorter than a stored key", *klen);
        return -1;
    }
    *key = (const uint8_t *)PyBytes_AS_STRING(obj);
    return 0;
}

/* Both buffers of a call (``a`` with flags ``fa``, ``b`` with ``fb``), or -1 with neither held. */
static int two_buffers(PyObject *a, Py_buffer *ba, int fa, PyObject *b, Py_buffer *bb, int fb) {
    if (PyObject_GetBuffer(a, ba, fa) < 0) return -1;
    if (PyObject_GetBuffer(b, bb, fb) < 0) {
        PyBuffer_Release(ba);
        return -1;
    }
    return 0;
}

/* The GIL is let go for RELEASE_AT bytes or more (below that, taking it back costs more than the
 * copy): ``unlocked(n)`` before the work, ``relock(state)`` after it. */
static PyThreadState *unlocked(Py_ssize_t n) { return n >= RELEASE_AT ? PyEval_SaveThread() : NULL; }

static void relock(PyThreadState *state) {
    if (state != NULL) PyEval_RestoreThread(state);
}

/* A new list of the n integers v[0..n), or NULL with an exception set. */
static PyObject *int_list(const Py_ssize_t *v, Py_ssize_t n) {
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list != NULL && i < n; i++) {
        PyObject *e = PyLong_FromSsize_t(v[i]);
        if (e == NULL)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, i, e);
    }
    return list;
}

/* ---- checked copies of records in memory ---- */

/* The work of verify_many (apart == 0: args records, keys, dsts) and verify_parts_many
 * (apart == 1: args heads, payloads, keys, dsts[, head_at]): check_copy or check_parts for each
 * item, the GIL let go once for every check and copy of the call. A record kept apart has its header at
 * head_at (default 0) in heads[i], which must be exactly head_at + the header long, else the
 * record is not good (-1). */
static PyObject *verify_batch(PyObject *const *args, Py_ssize_t nargs, int apart) {
    Py_ssize_t lists = apart ? 4 : 3, count = 0, head_at = 0;
    int good = nargs == lists || (apart && nargs == lists + 1);
    for (Py_ssize_t j = 0; good && j < lists; j++)
        good = PyList_Check(args[j]) && PyList_GET_SIZE(args[j]) == PyList_GET_SIZE(args[0]);
    if (!good) {
        PyErr_SetString(PyExc_TypeError, apart ? "verify_parts_many(heads: list, payloads: list, keys: list, "
                                                 "dsts: list, head_at=0), of one length"
                                               : "verify_many(records: list, keys: list, dsts: list), of one length");
        return NULL;
    }
    if (need_layout() < 0) return NULL;
    if (nargs == lists + 1) {
        head_at = PyLong_AsSsize_t(args[lists]);
        if (head_at == -1 && PyErr_Occurred()) return NULL;
        if (head_at < 0) {
            PyErr_SetString(PyExc_ValueError, "head_at must not be negative");
            return NULL;
        }
    }
    count = PyList_GET_SIZE(args[0]);
    PyObject *const *srcs = args + apart, *keylist = args[lists - 2], *dstlist = args[lists - 1];
    Py_ssize_t held = 0, total = 0;
    PyObject *result = NULL;
    /* per item 3 buffers (header or nothing, record or payload, destination) and its key (held:
     * the lists may change while the GIL is let go, the keys and buffers stay) */
    Py_buffer *bufs = PyMem_Calloc(3 * (size_t)(count ? count : 1), sizeof(Py_buffer));
    PyObject **keys = PyMem_Calloc(count ? (size_t)count : 1, sizeof(PyObject *));
    Py_ssize_t *got = PyMem_Calloc(count ? (size_t)count : 1, sizeof(Py_ssize_t));
    if (bufs == NULL || keys == NULL || got == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < count; held++) {
        const uint8_t *key;
        Py_ssize_t klen;
        Py_buffer *b = &bufs[3 * held];
        if (key_arg(PyList_GET_ITEM(keylist, held), &key, &klen) < 0) goto done;
        if (apart && PyObject_GetBuffer(PyList_GET_ITEM(args[0], held), &b[0], PyBUF_SIMPLE) < 0) goto done;
        if (two_buffers(PyList_GET_ITEM(srcs[0], held), &b[1], PyBUF_SIMPLE, PyList_GET_ITEM(dstlist, held), &b[2],
                        PyBUF_WRITABLE) < 0) {
            if (apart) PyBuffer_Release(&b[0]);
            goto done;
        }
        keys[held] = Py_NewRef(PyList_GET_ITEM(keylist, held));
        total += b[1].len;
    }
    PyThreadState *state = unlocked(total);
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_buffer *b = &bufs[3 * i];
        const uint8_t *key = (const uint8_t *)PyBytes_AS_STRING(keys[i]);
        size_t klen = (size_t)PyBytes_GET_SIZE(keys[i]);
        if (!apart)
            got[i] = check_copy(b[1].buf, b[1].len, key, klen, b[2].buf, b[2].len);
        else if (b[0].len != head_at + L.header)
            got[i] = -1;
        else
            got[i] = check_parts((const uint8_t *)b[0].buf + head_at, b[1].buf, b[1].len, key, klen, b[2].buf, b[2].len);
    }
    relock(state);
    result = int_list(got, count);
done:
    for (Py_ssize_t i = 0; i < held; i++) {
        for (int j = apart ? 0 : 1; j < 3; j++) PyBuffer_Release(&bufs[3 * i + j]);
        Py_DECREF(keys[i]);
    }
    PyMem_Free(bufs);
    PyMem_Free(keys);
    PyMem_Free(got);
    return result;
}

/* verify_many(records, keys, dsts) -> list of payload lengths, -1 (not a good record for its key)
 * or -2 (a good header, a payload longer than its destination: nothing copied)
 * check_copy of each (record, key, dst) of three lists of one length (verify_batch): the LMDB
 * tier's records held whole (header beside payload), read in its read transaction. */
static PyObject *verify_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return verify_batch(args, nargs, 0);
}

/* verify_parts_many(heads, payloads, keys, dsts, head_at=0) -> list of verify_many's answers
 * verify_many for records kept as a header and a payload apart (heads[i] holds the header of
 * payloads[i] at head_at; verify_batch): the LMDB tier's records, their headers at the end of
 * their access entries. */
static PyObject *verify_parts_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return verify_batch(args, nargs, 1);
}

/* ---- checksums of headers written apart from their payloads ---- */

/* The rule of the version a header names, or NULL. */
static const version_rule *version_of(const uint8_t *h) {
    uint64_t version = get_le(h + L.version.at, L.version.width);
    for (Py_ssize_t i = 0; i < L.nversions; i++)
        if (L.versions[i].version == version) return &L.versions[i];
    return NULL;
}

static void put_le(uint8_t *p, Py_ssize_t n, uint64_t v) {
    for (Py_ssize_t b = 0; b < n; b++) p[b] = (uint8_t)(v >> (8 * b));
}

/* The work of sum_heads (version == 0: the headers are written, their checksums are summed here)
 * and heads_many (version != 0: the whole header of that version written here, as
 * format._header_into writes it for the default tenant, then summed): per item, the key, the
 * header ranges its version's rule hashes and the payload where it is; the GIL let go once for
 * the batch (the LMDB tier's put: py-lmdb then writes each payload once, from where it is). Every
 * offset is format.py's (set_layout). */
static PyObject *heads_batch(PyObject *const *args, Py_ssize_t nargs, int write) {
    uint64_t version = 0;
    int good = nargs == 3 + write && PyList_Check(args[1]) && PyList_Check(args[2]) &&
               PyList_GET_SIZE(args[1]) == PyList_GET_SIZE(args[2]);
    if (!good) {
        PyErr_SetString(PyExc_TypeError, write ? "heads_many(heads: buffer, keys: list, payloads: list, version: int), "
                                                 "lists of one length"
                                               : "sum_heads(heads: buffer, keys: list, payloads: list), lists of one length");
        return NULL;
    }
    if (need_layout() < 0) return NULL;
    if (write) {
        version = PyLong_AsUnsignedLongLong(args[3]);
        if (version == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(args[1]), held = 0, total = 0;
    Py_buffer heads;
    if (PyObject_GetBuffer(args[0], &heads, PyBUF_WRITABLE) < 0) return NULL;
    PyObject *result = NULL;
    Py_buffer *bufs = PyMem_Calloc(count ? (size_t)count : 1, sizeof(Py_buffer));
    PyObject **keys = PyMem_Calloc(count ? (size_t)count : 1, sizeof(PyObject *));
    const version_rule **rules = PyMem_Calloc(count ? (size_t)count : 1, sizeof(version_rule *));
    const version_rule *wrote = NULL;
    if (bufs == NULL || keys == NULL || rules == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (heads.len < count * L.header) {
        PyErr_Format(PyExc_ValueError, "heads of %zd bytes is smaller than %zd headers", heads.len, count);
        goto done;
    }
    for (Py_ssize_t i = 0; write && i < L.nversions; i++)
        if (L.versions[i].version == version) wrote = &L.versions[i];
    if (write && wrote == NULL) {
        PyErr_Format(PyExc_ValueError, "version %llu is not one of this layout's", (unsigned long long)version);
        goto done;
    }
    for (; held < count; held++) {
        const uint8_t *key;
        Py_ssize_t klen;
        const uint8_t *h = (const uint8_t *)heads.buf + held * L.header;
        if (key_arg(PyList_GET_ITEM(args[1], held), &key, &klen) < 0) goto done;
        rules[held] = write ? wrote : version_of(h);
        if (rules[held] == NULL) {
            PyErr_Format(PyExc_ValueError, "header %zd names a version this layout does not have", held);
            goto done;
        }
        if (PyObject_GetBuffer(PyList_GET_ITEM(args[2], held), &bufs[held], PyBUF_SIMPLE) < 0) goto done;
        keys[held] = Py_NewRef(PyList_GET_ITEM(args[1], held));
        total += bufs[held].len;
    }
    PyThreadState *state = unlocked(total);
    for (Py_ssize_t i = 0; i < count; i++) {
        uint8_t *h = (uint8_t *)heads.buf + i * L.header;
        const version_rule *v = rules[i];
        const uint8_t *key = (const uint8_t *)PyBytes_AS_STRING(keys[i]);
        size_t klen = (size_t)PyBytes_GET_SIZE(keys[i]);
        if (write) {
            Py_ssize_t fp = L.fingerprint.b - L.fingerprint.a, group = L.group.b - L.group.a;
            memset(h, 0, (size_t)L.header);
            memcpy(h + L.magic_at, L.magic, (size_t)L.magic_len);
            put_le(h + L.version.at, L.version.width, version);
            put_le(h + L.header_size.at, L.header_size.width, (uint64_t)L.header);
            memcpy(h + L.fingerprint.a, key, (size_t)fp);
            for (Py_ssize_t b = 0; b < group; b++) h[L.group.a + b] = key[klen - 1 - (size_t)b];
            put_le(h + L.length.at, L.length.width, (uint64_t)bufs[i].len);
        }
        XXH3_state_t st;
        XXH3_64bits_reset(&st);
        XXH3_UPDATE(&st, key, klen);
        for (Py_ssize_t r = 0; r < v->nhashed; r++)
            XXH3_UPDATE(&st, h + v->hashed[r].a, (size_t)(v->hashed[r].b - v->hashed[r].a));
        XXH3_UPDATE(&st, bufs[i].buf, (size_t)bufs[i].len);
        put_le(h + L.checksum.at, L.checksum.width, XXH3_64bits_digest(&st));
    }
    relock(state);
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < held; i++) {
        PyBuffer_Release(&bufs[i]);
        Py_DECREF(keys[i]);
    }
    PyBuffer_Release(&heads);
    PyMem_Free(bufs);
    PyMem_Free(keys);
    PyMem_Free(rules);
    return result;
}

/* sum_heads(heads, keys, payloads) -> None
 * heads holds len(keys) headers one after another, written by format.encode_heads_into but for
 * their checksums (records with a tenant); each gets the checksum its version's rule says. */
static PyObject *sum_heads(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return heads_batch(args, nargs, 0);
}

/* heads_many(heads, keys, payloads, version) -> None
 * The whole header of each payload under its key, of ``version`` (the default tenant's: no field
 * beyond the key's, the length and the checksum), one after another in heads. */
static PyObject *heads_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return heads_batch(args, nargs, 1);
}

/* stream_into(dst, src) -> bytes copied
 * Copies ``src`` to the start of ``dst`` with non-temporal stores where the CPU has them (see
 * stream_copy), the GIL released from RELEASE_AT bytes: for copies whose destination is not read
 * again soon (a chunk into the CPU tier's slab, or into blocks the engine reads after a step). */
static PyObject *stream_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "stream_into(dst, src)");
        return NULL;
    }
    Py_buffer dst, src;
    if (two_buffers(args[0], &dst, PyBUF_WRITABLE, args[1], &src, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = src.len;
    if (n > dst.len) {
        PyErr_Format(PyExc_ValueError, "destination of %zd bytes is smaller than the source (%zd)", dst.len, n);
    } else {
        PyThreadState *state = unlocked(n);
#if CAN_STREAM
        if (n >= RELEASE_AT) {
            stream_copy((uint8_t *)dst.buf, (const uint8_t *)src.buf, (size_t)n);
            _mm_sfence();
        } else
#endif
            memcpy(dst.buf, src.buf, (size_t)n);
        relock(state);
        result = PyLong_FromSsize_t(n);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

/* ---- scattered blocks: one call per job and tensor (staging.py's host copies) ---- */

typedef struct {
    uint8_t *dst;
    const uint8_t *src;
    const int64_t *doff, *soff;
    Py_ssize_t count; /* items [0, count) */
    Py_ssize_t batch; /* items a thread claims at a time */
    Py_ssize_t next;  /* the first item not yet claimed (atomic) */
    size_t piece;
    int overlap; /* the buffers share memory: memmove, one thread */
} move_work;

/* One thread of a move_pieces call: it claims batches of items until none is left (a thread
 * the scheduler holds back takes fewer, so one late or preempted thread does not hold the call
 * back by a fixed share); runs of items next to each other on both sides move as one copy, and
 * a run of MOVE_STREAM_AT bytes or more streams (non-temporal stores). */
#define MOVE_STREAM_AT (4 * 1024)
#define MOVE_PREFETCH 512 /* bytes of the next run's source prefetched */
static void *move_run(void *arg) {
    move_work *p = arg;
    for (;;) {
        Py_ssize_t lo = __atomic_fetch_add(&p->next, p->batch, __ATOMIC_RELAXED);
        if (lo >= p->count) break;
        Py_ssize_t hi = lo + p->batch < p->count ? lo + p->batch : p->count;
        Py_ssize_t i = lo;
        while (i < hi) {
            Py_ssize_t j = i + 1;
            while (!p->overlap && j < hi && p->doff[j] == p->doff[j - 1] + (int64_t)p->piece &&
                   p->soff[j] == p->soff[j - 1] + (int64_t)p->piece)
                j++;
            size_t n = (size_t)(j - i) * p->piece;
            uint8_t *d = p->dst + p->doff[i];
            const uint8_t *s = p->src + p->soff[i];
#if CAN_STREAM
            if (j < hi) { /* the next run's first lines, asked for now: its source lies elsewhere, where
                           * no hardware prefetcher looks (scattered 16 KiB gathers: +7 %, docs/native.md) */
                const char *ns = (const char *)(p->src + p->soff[j]);
                size_t ahead = p->piece < MOVE_PREFETCH ? p->piece : MOVE_PREFETCH;
                for (size_t k = 0; k < ahead; k += 64) _mm_prefetch(ns + k, _MM_HINT_T0);
            }
#endif
            if (p->overlap)
                memmove(d, s, n);
#if CAN_STREAM
            else if (n >= MOVE_STREAM_AT)
                stream_copy(d, s, n);
#endif
            else
                memcpy(d, s, n);
            i = j;
        }
    }
#if CAN_STREAM
    _mm_sfence();
#endif
    return NULL;
}

/* ---- the move pool: helper threads kept between calls ----
 * A thread created per call often starts a millisecond late on a virtual machine whose other
 * vCPU went idle (halted) since the last call: a 16 MiB move then ran on one thread, at half the
 * speed, in every other pipeline job (docs/native.md). Helpers are created once (lazily, and
 * again in a forked child) and, after a call, spin for MOVE_SPIN_NS waiting for the next one
 * before they sleep on a condition variable: a pipeline's back-to-back jobs find them running.
 * One call uses the pool at a time; a call that finds it busy creates threads of its own. */
#define MOVE_SPIN_NS 2000000L
#define MOVE_MAX_THREADS 8
/* pool.state: POOL_OPEN while a call's work takes helpers, plus the helpers working on it. */
#define POOL_OPEN (1L << 32)
static struct {
    pthread_mutex_t use;  /* held by the call that uses the pool */
    pthread_mutex_t lock; /* guards sleepers and the condition */
    pthread_cond_t wake;
    long size;            /* helpers started */
    long wanted;          /* at most this many helpers join the current call */
    unsigned long gen;    /* bumped (atomic) for each call */
    long state;           /* POOL_OPEN | helpers working (atomic) */
    long sleepers;        /* helpers waiting on the condition */
    move_work *work;
    unsigned long born[MOVE_MAX_THREADS]; /* the generation each helper was created in */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, NULL, {0}};

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__SSE2__)
    _mm_pause();
#endif
}

/* A helper joins the open call (if it still is, and has room) and claims batches of its work;
 * one that wakes after the call closed does nothing: the caller never waits for a late helper,
 * only for those that joined, and none touches a call's work after it returned. */
static void pool_join(void) {
    long s = __atomic_load_n(&pool.state, __ATOMIC_ACQUIRE);
    while ((s & POOL_OPEN) && (s & (POOL_OPEN - 1)) < pool.wanted) {
        if (__atomic_compare_exchange_n(&pool.state, &s, s + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            move_run(pool.work);
            __atomic_fetch_sub(&pool.state, 1, __ATOMIC_RELEASE);
            return;
        }
    }
}

static void *pool_helper(void *arg) {
    unsigned long seen = pool.born[(intptr_t)arg]; /* it may start after its call bumped gen */
    for (;;) {
        long until = now_ns() + MOVE_SPIN_NS;
        unsigned long g;
        int spins = 0;
        while ((g = __atomic_load_n(&pool.gen, __ATOMIC_ACQUIRE)) == seen) {
            cpu_relax();
            if (++spins % 256 == 0) { /* a thread woken onto this CPU (the caller's) runs first */
                if (now_ns() > until) break;
                sched_yield();
            }
        }
        if (g == seen) {
            pthread_mutex_lock(&pool.lock);
            pool.sleepers++;
            while ((g = __atomic_load_n(&pool.gen, __ATOMIC_ACQUIRE)) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            pool.sleepers--;
            pthread_mutex_unlock(&pool.lock);
        }
        seen = g;
        pool_join();
    }
    return NULL;
}

/* A forked child has none of the parent's helpers (and maybe a lock held by a parent thread). */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.use, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.size = pool.wanted = pool.state = pool.sleepers = 0;
    pool.work = NULL;
}

/* Runs ``w`` on this thread and up to ``helpers`` pool threads (the GIL released): 1. Returns 0,
 * nothing done, when another call holds the pool or its threads cannot be started (the caller
 * then moves ``w`` with threads of its own). */
static int atfork_done;
/* Starts helpers until the pool holds ``helpers`` (pool.use held). */
static void pool_grow(long helpers) {
    if (!atfork_done) atfork_done = pthread_atfork(NULL, NULL, pool_after_fork) == 0 ? 1 : -1;
    while (pool.size < helpers && atfork_done > 0) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 64 * 1024);
        pool.born[pool.size] = pool.gen;
        int rc = pthread_create(&t, &attr, pool_helper, (void *)(intptr_t)pool.size);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pool.size++;
    }
}

static int pool_run(move_work *w, long helpers) {
    if (pthread_mutex_trylock(&pool.use) != 0) return 0;
    pool_grow(helpers);
    if (pool.size < helpers) {
        pthread_mutex_unlock(&pool.use);
        return 0;
    }
    pool.work = w;
    pool.wanted = helpers;
    __atomic_store_n(&pool.state, POOL_OPEN, __ATOMIC_RELEASE);
    __atomic_fetch_add(&pool.gen, 1, __ATOMIC_RELEASE);
    pthread_mutex_lock(&pool.lock);
    if (pool.sleepers) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    move_run(w);
    __atomic_fetch_and(&pool.state, ~POOL_OPEN, __ATOMIC_ACQ_REL); /* no helper joins from here */
    for (int spins = 1; __atomic_load_n(&pool.state, __ATOMIC_ACQUIRE) != 0; spins++) { /* those that joined */
        cpu_relax();
        if (spins % 256 == 0) sched_yield();
    }
    pthread_mutex_unlock(&pool.use);
    return 1;
}

/* move_wake(threads) -> None
 * Wakes the pool's helpers (starting them if the pool holds fewer than ``threads`` - 1), so that
 * they spin, ready, for the next MOVE_SPIN_NS: called when a job is queued, so the move it will
 * make finds them running instead of paying their wake-up (a millisecond on this VM) itself. A
 * pool in use is awake already: nothing is done. */
static PyObject *move_wake(PyObject *self, PyObject *arg) {
    long threads = PyLong_AsLong(arg);
    if (threads == -1 && PyErr_Occurred()) return NULL;
    if (threads < 1 || threads > MOVE_MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "move_wake: threads must be 1..%d, got %ld", MOVE_MAX_THREADS, threads);
        return NULL;
    }
    if (threads > 1 && pthread_mutex_trylock(&pool.use) == 0) {
        pool_grow(threads - 1);
        __atomic_fetch_add(&pool.gen, 1, __ATOMIC_RELEASE); /* no call open: they join nothing, and spin */
        pthread_mutex_lock(&pool.lock);
        if (pool.sleepers) pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
        pthread_mutex_unlock(&pool.use);
    }
    Py_RETURN_NONE;
}

/* An int64 offsets buffer (format 'q', or 'l' where long is 64 bits), contiguous; -1 with a
 * TypeError when it is not one. */
static int offsets(PyObject *o, Py_buffer *b, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    const char *f = b->format ? b->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (b->itemsize != 8 || !(strcmp(f, "q") == 0 || (strcmp(f, "l") == 0 && sizeof(long) == 8))) {
        PyErr_Format(PyExc_TypeError, "move_pieces: %s must be an int64 array, got format %s of %zd bytes", what,
                     b->format ? b->format : "B", b->itemsize);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* Below this many bytes per thread a second thread costs more than it gives. */
#define MOVE_THREAD_AT (1024 * 1024)
/* Bytes a thread claims at a time when several share a call. */
#define MOVE_BATCH (256 * 1024)

/* move_pieces(dst, dst_offsets, src, src_offsets, piece, threads=1) -> bytes copied
 * Copies, for each i, the ``piece`` bytes of ``src`` at src_offsets[i] to ``dst`` at
 * dst_offsets[i] (int64 arrays of the same length): a job's scattered blocks gathered into
 * staging, or scattered back, in one call, the GIL released. Every offset is checked before the
 * first byte moves (a ValueError names the first one out of range; nothing is copied). With
 * ``threads`` > 1 the items are split among that many threads (this one included) when each gets
 * MOVE_THREAD_AT bytes or more. Destination ranges must not overlap one another (what lands
 * there is then the last writer's); buffers that share memory are copied item by item with
 * memmove, in order, on one thread. */
/* A move_pieces call's arguments checked and held: its four buffers (released by move_release)
 * and its work; 0, or -1 with an exception set and nothing held. */
typedef struct {
    Py_buffer dst, src, db, sb;
    move_work work;
    long nt;            /* threads it runs on */
    Py_ssize_t total;   /* bytes it moves */
} move_args;

static int move_prepare(const char *name, PyObject *const *args, Py_ssize_t nargs, move_args *m) {
    Py_ssize_t piece = PyLong_AsSsize_t(args[4]);
    if (piece == -1 && PyErr_Occurred()) return -1;
    long threads = nargs >= 6 ? PyLong_AsLong(args[5]) : 1;
    if (threads == -1 && PyErr_Occurred()) return -1;
    if (piece <= 0 || threads < 1 || threads > MOVE_MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "%s: piece must be > 0 (got %zd) and threads 1..%d (got %ld)", name, piece,
                     MOVE_MAX_THREADS, threads);
        return -1;
    }
    Py_buffer *dst = &m->dst, *src = &m->src, *db = &m->db, *sb = &m->sb;
    if (two_buffers(args[0], dst, PyBUF_WRITABLE, args[2], src, PyBUF_SIMPLE) < 0) return -1;
    if (offsets(args[1], db, "dst_offsets") < 0) goto out2;
    if (offsets(args[3], sb, "src_offsets") < 0) goto out1;
    Py_ssize_t count = db->len / 8;
    if (sb->len / 8 != count) {
        PyErr_Format(PyExc_ValueError, "%s: %zd destination offsets but %zd source offsets", name, count, sb->len / 8);
        goto out0;
    }
    const int64_t *doff = db->buf, *soff = sb->buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (doff[i] < 0 || doff[i] > (int64_t)(dst->len - piece) || dst->len < piece) {
            PyErr_Format(PyExc_ValueError, "%s: destination offset %lld (item %zd) is outside %zd bytes", name,
                         (long long)doff[i], i, dst->len);
            goto out0;
        }
        if (soff[i] < 0 || soff[i] > (int64_t)(src->len - piece) || src->len < piece) {
            PyErr_Format(PyExc_ValueError, "%s: source offset %lld (item %zd) is outside %zd bytes", name,
                         (long long)soff[i], i, src->len);
            goto out0;
        }
    }
    uintptr_t d0 = (uintptr_t)dst->buf, s0 = (uintptr_t)src->buf;
    int overlap = d0 < s0 + (uintptr_t)src->len && s0 < d0 + (uintptr_t)dst->len;
    m->total = count * piece;
    long nt = overlap ? 1 : threads;
    while (nt > 1 && m->total / nt < MOVE_THREAD_AT) nt--;
    m->nt = nt;
    /* one thread: one batch; else batches of about MOVE_BATCH bytes, in order */
    Py_ssize_t batch = nt == 1 ? (count ? count : 1) : (MOVE_BATCH + piece - 1) / piece;
    m->work = (move_work){(uint8_t *)dst->buf, (const uint8_t *)src->buf, doff, soff, count, batch, 0, (size_t)piece,
                          overlap};
    return 0;
out0:
    PyBuffer_Release(sb);
out1:
    PyBuffer_Release(db);
out2:
    PyBuffer_Release(src);
    PyBuffer_Release(dst);
    return -1;
}

static void move_release(move_args *m) {
    PyBuffer_Release(&m->sb);
    PyBuffer_Release(&m->db);
    PyBuffer_Release(&m->src);
    PyBuffer_Release(&m->dst);
}

/* Runs a prepared move on nt threads, this one included (no GIL needed). */
static void move_exec(move_work *work, long nt) {
    pthread_t tids[MOVE_MAX_THREADS];
    int started[MOVE_MAX_THREADS] = {0};
    if (nt == 1 || !pool_run(work, nt - 1)) { /* the pool busy (another call): threads of its own */
        for (long t = 1; t < nt; t++) started[t] = pthread_create(&tids[t], NULL, move_run, work) == 0;
        move_run(work); /* this thread claims batches too, and the rest when no thread could start */
        for (long t = 1; t < nt; t++)
            if (started[t]) pthread_join(tids[t], NULL);
    }
}

/* move_pieces(dst, dst_offsets, src, src_offsets, piece, threads=1) -> bytes copied
 * Copies, for each i, the ``piece`` bytes of ``src`` at src_offsets[i] to ``dst`` at
 * dst_offsets[i] (int64 arrays of the same length): a job's scattered blocks gathered into
 * staging, or scattered back, in one call, the GIL released. Every offset is checked before the
 * first byte moves (a ValueError names the first one out of range; nothing is copied). With
 * ``threads`` > 1 the items are split among that many threads (this one included) when each gets
 * MOVE_THREAD_AT bytes or more. Destination ranges must not overlap one another (what lands
 * there is then the last writer's); buffers that share memory are copied item by item with
 * memmove, in order, on one thread. */
static PyObject *move_pieces(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 5 || nargs > 6) {
        PyErr_SetString(PyExc_TypeError, "move_pieces(dst, dst_offsets, src, src_offsets, piece, threads=1)");
        return NULL;
    }
    move_args m;
    if (move_prepare("move_pieces", args, nargs, &m) < 0) return NULL;
    PyThreadState *state = unlocked(m.total);
    move_exec(&m.work, m.nt);
    relock(state);
    move_release(&m);
    return PyLong_FromSsize_t(m.total);
}

/* ---- moves in the background: one mover thread runs queued moves in order ----
 * move_pieces_async queues a checked move and returns a MoveTicket at once; the mover thread
 * (started at the first, again in a forked child) runs the queue in order, each move on the
 * pool as move_pieces would, and never takes the GIL: the caller's loop goes on meanwhile. When
 * a move is over the mover writes one byte to the ticket's ``notify_fd`` (a pipe the caller's
 * loop watches; -1: none), so nobody polls. The ticket holds the buffers until the move is over:
 * dropping it waits for that (or takes it off the queue if it has not started), so no move
 * writes or reads memory that was given back. */
typedef struct MoveTicket {
    PyObject_HEAD
    move_args m;
    int notify_fd;
    int state; /* 0 queued, 1 running, 2 done, 3 cancelled (under mover.lock; 2 and 3 final) */
    struct MoveTicket *next;
} MoveTicket;

static struct {
    pthread_mutex_t lock;
    pthread_cond_t work; /* a move was queued */
    pthread_cond_t done; /* a move ended */
    MoveTicket *head, *tail;
    MoveTicket *current; /* the move running */
    int started;
} mover = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, NULL, 0};

static void *mover_main(void *arg) {
    (void)arg;
    pthread_mutex_lock(&mover.lock);
    for (;;) {
        while (mover.head == NULL) pthread_cond_wait(&mover.work, &mover.lock);
        MoveTicket *t = mover.head;
        mover.head = t->next;
        if (mover.head == NULL) mover.tail = NULL;
        t->state = 1;
        mover.current = t;
        pthread_mutex_unlock(&mover.lock);
        move_exec(&t->m.work, t->m.nt);
        pthread_mutex_lock(&mover.lock);
        mover.current = NULL;
        int fd = t->notify_fd;
        __atomic_store_n(&t->state, 2, __ATOMIC_RELEASE); /* t may be freed once the lock is let go */
        pthread_cond_broadcast(&mover.done);
        if (fd >= 0) { /* after the state (a reader woken sees it done), under the lock (move_fence) */
            ssize_t w = write(fd, "m", 1); /* a full pipe has news to read already */
            (void)w;
        }
    }
    return NULL;
}

static void mover_after_fork(void) {
    /* the parent's mover is not in the child: the parent's queued moves never run there */
    pthread_mutex_init(&mover.lock, NULL);
    pthread_cond_init(&mover.work, NULL);
    pthread_cond_init(&mover.done, NULL);
    for (MoveTicket *t = mover.head; t != NULL; t = t->next) t->state = 3;
    if (mover.current != NULL) mover.current->state = 3; /* half moved, in the parent */
    mover.head = mover.tail = mover.current = NULL;
    mover.started = 0;
}

/* Waits (the GIL let go) until the ticket's move is over, or takes it off the queue when it has
 * not started and ``cancel``. Returns its final state. */
static int ticket_settle(MoveTicket *t, int cancel) {
    int st;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&mover.lock);
    if (cancel && t->state == 0) {
        MoveTicket **p = &mover.head, *prev = NULL;
        while (*p != NULL && *p != t) {
            prev = *p;
            p = &(*p)->next;
        }
        if (*p == t) {
            *p = t->next;
            if (mover.tail == t) mover.tail = prev;
        }
        t->state = 3;
    }
    while (t->state < 2) pthread_cond_wait(&mover.done, &mover.lock);
    st = t->state;
    pthread_mutex_unlock(&mover.lock);
    Py_END_ALLOW_THREADS
    return st;
}

static void ticket_dealloc(MoveTicket *t) {
    ticket_settle(t, 1);
    move_release(&t->m);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyObject *ticket_query(MoveTicket *t, PyObject *unused) {
    (void)unused;
    return PyBool_FromLong(__atomic_load_n(&t->state, __ATOMIC_ACQUIRE) >= 2);
}

static PyObject *ticket_synchronize(MoveTicket *t, PyObject *unused) {
    (void)unused;
    ticket_settle(t, 0);
    Py_RETURN_NONE;
}

static PyObject *ticket_cancel(MoveTicket *t, PyObject *unused) {
    (void)unused;
    return PyBool_FromLong(ticket_settle(t, 1) == 3);
}

/* move_fence() -> None
 * Returns once the mover has finished any notification it was writing: it writes a move's byte
 * while it holds its lock, after marking the move done, so a move seen done (query(), no lock)
 * may still be writing. Copier.close calls it before it closes the pipe, so the mover never
 * writes to a descriptor that was closed or reused. */
static PyObject *move_fence(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&mover.lock);
    pthread_mutex_unlock(&mover.lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef ticket_methods[] = {
    {"query", (PyCFunction)ticket_query, METH_NOARGS, "query() -> whether the move is over (done or cancelled)"},
    {"synchronize", (PyCFunction)ticket_synchronize, METH_NOARGS,
     "synchronize() -> None: wait until the move is over (the GIL let go)"},
    {"cancel", (PyCFunction)ticket_cancel, METH_NOARGS,
     "cancel() -> True when the move was taken off the queue before it started (nothing moved); "
     "else waits for it to end and returns False"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MoveTicketType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tieredkv._fastrec.MoveTicket",
    .tp_basicsize = sizeof(MoveTicket),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A queued move_pieces_async move: query(), synchronize(), cancel().",
    .tp_dealloc = (destructor)ticket_dealloc,
    .tp_methods = ticket_methods,
};

static int mover_atfork;

/* move_pieces_async(dst, dst_offsets, src, src_offsets, piece, threads, notify_fd) -> MoveTicket
 * move_pieces, checked now (the same errors, raised here; nothing queued then), run by the mover
 * thread after the moves queued before it; one byte is written to ``notify_fd`` (>= 0) when it is
 * over. Without a mover thread to be had, the move runs here and the ticket comes back done
 * (nothing written). */
static PyObject *move_pieces_async(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "move_pieces_async(dst, dst_offsets, src, src_offsets, piece, threads, notify_fd)");
        return NULL;
    }
    long fdl = PyLong_AsLong(args[6]);
    if (fdl == -1 && PyErr_Occurred()) return NULL;
    if (fdl < -1 || fdl > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "move_pieces_async: notify_fd must be a file descriptor or -1, got %ld", fdl);
        return NULL;
    }
    int fd = (int)fdl;
    MoveTicket *t = PyObject_New(MoveTicket, &MoveTicketType);
    if (t == NULL) return NULL;
    if (move_prepare("move_pieces_async", args, nargs, &t->m) < 0) {
        PyObject_Free(t); /* not a whole ticket: no dealloc */
        return NULL;
    }
    t->next = NULL;
    t->notify_fd = fd;
    int queued = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&mover.lock);
    if (!mover_atfork) mover_atfork = pthread_atfork(NULL, NULL, mover_after_fork) == 0 ? 1 : -1;
    if (!mover.started && mover_atfork > 0) {
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        mover.started = pthread_create(&tid, &attr, mover_main, NULL) == 0;
        pthread_attr_destroy(&attr);
    }
    if (mover.started) {
        t->state = 0;
        if (mover.tail != NULL)
            mover.tail->next = t;
        else
            mover.head = t;
        mover.tail = t;
        queued = 1;
        pthread_cond_signal(&mover.work);
    }
    pthread_mutex_unlock(&mover.lock);
    if (!queued) {
        move_exec(&t->m.work, t->m.nt);
        __atomic_store_n(&t->state, 2, __ATOMIC_RELEASE);
    }
    Py_END_ALLOW_THREADS
    return (PyObject *)t;
}

/* ---- records in record files (the LMDB tier's large batches, written by format.write_records) ---- */

/* The reads of read_records and read_placed, the GIL let go by the caller: item i is the record of
 * lens[i] bytes at offs[i] of file paths[i] (a run of items in one file, next to each other, maps
 * the part of it they span once: read-only, populated in one go, page-cache pages and no bounce
 * buffer), delivered into bufs[i] checked for keys[i] as check_copy checks one; got[i] as
 * read_records returns it, -3 for an OSError of errno errs[i]. The files must not shrink meanwhile
 * (tieredkv never truncates one; blocks given back read as zeros: a record that fails). A file
 * another writer changes during the call (a dead record's blocks punched, a spare written over)
 * can change a piece between its hash and its copy: what is delivered then verified without being
 * what was hashed. The caller rules that out after the call (the LMDB tier checks that each record
 * is still where it was read from: a writer changes a file only after the records there have left
 * it). Hashing what landed instead cost a third of the read's speed (measured). */
static void read_core(Py_ssize_t count, char *const *paths, const uint64_t *offs, const uint64_t *lens,
                      PyObject *const *keys, Py_buffer *bufs, Py_ssize_t *got, int *errs) {
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), header = (uint64_t)L.header;
    for (Py_ssize_t i = 0; i < count;) {
        const char *path = paths[i];
        Py_ssize_t end = i + 1;
        while (end < count && strcmp(paths[end], path) == 0) end++;
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        struct stat st;
        int err = fd < 0 ? errno : (fstat(fd, &st) < 0 ? errno : 0);
        uint64_t lo = UINT64_MAX, hi = 0, fsize = err ? 0 : (uint64_t)st.st_size;
        for (Py_ssize_t j = i; j < end && !err; j++) {
            if (lens[j] < header || offs[j] > fsize || lens[j] > fsize - offs[j]) continue; /* ends early */
            if (offs[j] < lo) lo = offs[j];
            if (offs[j] + lens[j] > hi) hi = offs[j] + lens[j];
        }
        uint8_t *map = NULL;
        uint64_t base = 0;
        if (!err && hi > 0) {
            base = lo - lo % page;
            void *m = mmap(NULL, (size_t)(hi - base), PROT_READ, MAP_SHARED | MAP_POPULATE, fd, (off_t)base);
            if (m == MAP_FAILED)
                err = errno;
            else
                map = m;
        }
        for (Py_ssize_t j = i; j < end; j++) {
            if (err) {
                got[j] = -3;
                errs[j] = err;
            } else if (lens[j] < header || offs[j] > fsize || lens[j] > fsize - offs[j]) {
                got[j] = -1;
            } else {
                const uint8_t *rec = map + (offs[j] - base);
                got[j] = check_copy(rec, (Py_ssize_t)lens[j], (const uint8_t *)PyBytes_AS_STRING(keys[j]),
                                    (size_t)PyBytes_GET_SIZE(keys[j]), bufs[j].buf, bufs[j].len);
            }
        }
        if (map != NULL) munmap(map, (size_t)(hi - base));
        if (fd >= 0) close(fd);
        i = end;
    }
}

/* What read_core found for an item, as a Python object (an int, or the OSError naming ``path``). */
static PyObject *read_result(Py_ssize_t got, int err, PyObject *path) {
    if (got == -3) return PyObject_CallFunction(PyExc_OSError, "isO", err, strerror(err), path);
    return PyLong_FromSsize_t(got);
}

/* Per-item arrays of a read (count items), freed by read_arrays_free; 0, or -1 with MemoryError. */
typedef struct {
    char **paths;
    PyObject **keys;
    Py_buffer *bufs;
    Py_ssize_t *got;
    uint64_t *offs, *lens;
    int *errs;
} read_arrays;

static int read_arrays_new(read_arrays *a, Py_ssize_t count) {
    size_t slots = count ? (size_t)count : 1;
    a->paths = PyMem_Calloc(slots, sizeof(char *));
    a->keys = PyMem_Calloc(slots, sizeof(PyObject *));
    a->bufs = PyMem_Calloc(slots, sizeof(Py_buffer));
    a->got = PyMem_Calloc(slots, sizeof(Py_ssize_t));
    a->offs = PyMem_Calloc(slots, sizeof(uint64_t));
    a->lens = PyMem_Calloc(slots, sizeof(uint64_t));
    a->errs = PyMem_Calloc(slots, sizeof(int));
    if (a->paths == NULL || a->keys == NULL || a->bufs == NULL || a->got == NULL || a->offs == NULL ||
        a->lens == NULL || a->errs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* Releases the first ``held`` items' buffers and keys, then the arrays. */
static void read_arrays_free(read_arrays *a, Py_ssize_t held) {
    for (Py_ssize_t i = 0; i < held; i++) {
        PyBuffer_Release(&a->bufs[i]);
        Py_DECREF(a->keys[i]);
    }
    PyMem_Free(a->paths);
    PyMem_Free(a->keys);
    PyMem_Free(a->bufs);
    PyMem_Free(a->got);
    PyMem_Free(a->offs);
    PyMem_Free(a->lens);
    PyMem_Free(a->errs);
}

/* read_core over the first n items of a, the GIL let go. */
static void read_arrays_run(read_arrays *a, Py_ssize_t n) {
    Py_BEGIN_ALLOW_THREADS
    read_core(n, a->paths, a->offs, a->lens, a->keys, a->bufs, a->got, a->errs);
    Py_END_ALLOW_THREADS
}

/* read_records(paths, offsets, sizes, keys, dsts) -> list
 * Delivers the record of sizes[i] bytes (header and payload) at offsets[i] of file paths[i] into
 * dsts[i], checked for keys[i] (read_core); per item the payload length, -1 (not a good record
 * for its key, or the file ends before it), -2 (does not fit) or an OSError naming the path
 * (FileNotFoundError: removed meanwhile). The GIL is let go once for all of them. */
static PyObject *read_records_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int good = nargs == 5;
    for (Py_ssize_t j = 0; good && j < 5; j++)
        good = PyList_Check(args[j]) && PyList_GET_SIZE(args[j]) == PyList_GET_SIZE(args[0]);
    if (!good) {
        PyErr_SetString(PyExc_TypeError,
                        "read_records(paths: list, offsets: list, sizes: list, keys: list, dsts: list), of one length");
        return NULL;
    }
    if (need_layout() < 0) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(args[0]), held = 0;
    PyObject *result = NULL, **names = PyMem_Calloc(count ? (size_t)count : 1, sizeof(PyObject *));
    read_arrays a;
    if (read_arrays_new(&a, count) < 0 || names == NULL) {
        if (names == NULL) PyErr_NoMemory();
        goto done;
    }
    for (; held < count; held++) {
        const uint8_t *key;
        Py_ssize_t klen;
        unsigned long long at = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(args[1], held));
        if (at == (unsigned long long)-1 && PyErr_Occurred()) goto done;
        unsigned long long n = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(args[2], held));
        if (n == (unsigned long long)-1 && PyErr_Occurred()) goto done;
        a.offs[held] = at;
        a.lens[held] = n;
        if (key_arg(PyList_GET_ITEM(args[3], held), &key, &klen) < 0) goto done;
        if (!PyUnicode_FSConverter(PyList_GET_ITEM(args[0], held), &names[held])) goto done;
        if (PyObject_GetBuffer(PyList_GET_ITEM(args[4], held), &a.bufs[held], PyBUF_WRITABLE) < 0) {
            Py_CLEAR(names[held]);
            goto done;
        }
        a.paths[held] = PyBytes_AS_STRING(names[held]);
        a.keys[held] = Py_NewRef(PyList_GET_ITEM(args[3], held));
    }
    read_arrays_run(&a, count);
    result = PyList_New(count);
    for (Py_ssize_t i = 0; result != NULL && i < count; i++) {
        PyObject *item = read_result(a.got[i], a.errs[i], PyList_GET_ITEM(args[0], i));
        if (item == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, item);
    }
done:
    if (names != NULL)
        for (Py_ssize_t i = 0; i < held; i++) Py_DECREF(names[i]);
    PyMem_Free(names);
    read_arrays_free(&a, held);
    return result;
}

/* read_placed(directory, entries, keys, dsts, layout) -> list
 * read_records for records whose place is in an index entry: entries[i] (a buffer, or None) of
 * layout = (entry_size, size_at, token_at, offset_at) names the record's size (u64 LE), its file
 * (a 16-byte token: the file is directory/<token as 32 hex digits>) and its offset (u64 LE). Per
 * item None where entries[i] is not of entry_size bytes or dsts[i] is None (not read here), else
 * what read_records returns for it. For the LMDB tier's reads of records in record files: the
 * entries are read in its read transaction and their places never reach Python. */
static PyObject *read_placed_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t esize, size_at, token_at, offset_at;
    int good = nargs == 5 && PyBytes_Check(args[0]) && PyList_Check(args[1]) && PyList_Check(args[2]) &&
               PyList_Check(args[3]) && PyList_GET_SIZE(args[2]) == PyList_GET_SIZE(args[1]) &&
               PyList_GET_SIZE(args[3]) == PyList_GET_SIZE(args[1]) &&
               PyArg_ParseTuple(args[4], "nnnn", &esize, &size_at, &token_at, &offset_at);
    if (good)
        good = size_at >= 0 && token_at >= 0 && offset_at >= 0 && size_at + 8 <= esize && token_at + 16 <= esize &&
               offset_at + 8 <= esize;
    if (!good) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "read_placed(directory: bytes, entries: list, keys: list, dsts: list, "
                                             "layout: (entry_size, size_at, token_at, offset_at)), lists of one length");
        return NULL;
    }
    if (need_layout() < 0) return NULL;
    static const char hex[] = "0123456789abcdef";
    Py_ssize_t count = PyList_GET_SIZE(args[1]), held = 0, dlen = PyBytes_GET_SIZE(args[0]);
    size_t plen = (size_t)dlen + 1 + 32 + 1;
    Py_ssize_t *which = PyMem_Calloc(count ? (size_t)count : 1, sizeof(Py_ssize_t));
    char *names = PyMem_Malloc((count ? (size_t)count : 1) * plen);
    PyObject *result = NULL;
    read_arrays a;
    if (read_arrays_new(&a, count) < 0 || which == NULL || names == NULL) {
        if (which == NULL || names == NULL) PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *entry = PyList_GET_ITEM(args[1], i), *dst = PyList_GET_ITEM(args[3], i);
        if (entry == Py_None || dst == Py_None) continue;
        Py_buffer e;
        if (PyObject_GetBuffer(entry, &e, PyBUF_SIMPLE) < 0) goto done;
        int placed = e.len == esize;
        const uint8_t *p = e.buf;
        if (placed) {
            a.lens[held] = get_le(p + size_at, 8);
            a.offs[held] = get_le(p + offset_at, 8);
            char *path = names + (size_t)held * plen;
            memcpy(path, PyBytes_AS_STRING(args[0]), (size_t)dlen);
            path[dlen] = '/';
            for (int b = 0; b < 16; b++) {
                path[dlen + 1 + 2 * b] = hex[p[token_at + b] >> 4];
                path[dlen + 2 + 2 * b] = hex[p[token_at + b] & 15];
            }
            path[dlen + 33] = '\0';
        }
        PyBuffer_Release(&e);
        if (!placed) continue;
        const uint8_t *key;
        Py_ssize_t klen;
        if (key_arg(PyList_GET_ITEM(args[2], i), &key, &klen) < 0) goto done;
        if (PyObject_GetBuffer(dst, &a.bufs[held], PyBUF_WRITABLE) < 0) goto done;
        a.paths[held] = names + (size_t)held * plen;
        a.keys[held] = Py_NewRef(PyList_GET_ITEM(args[2], i));
        which[held++] = i;
    }
    read_arrays_run(&a, held);
    result = PyList_New(count);
    for (Py_ssize_t i = 0; result != NULL && i < count; i++) PyList_SET_ITEM(result, i, Py_NewRef(Py_None));
    for (Py_ssize_t j = 0; result != NULL && j < held; j++) {
        PyObject *path = a.got[j] == -3 ? PyUnicode_DecodeFSDefault(a.paths[j]) : NULL;
        PyObject *item = a.got[j] == -3 && path == NULL ? NULL : read_result(a.got[j], a.errs[j], path);
        Py_XDECREF(path);
        if (item == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyObject *none = PyList_GET_ITEM(result, which[j]);
        PyList_SET_ITEM(result, which[j], item);
        Py_DECREF(none);
    }
done:
    PyMem_Free(which);
    PyMem_Free(names);
    read_arrays_free(&a, held);
    return result;
}

/* ---- the engine thread's check of a store or load call (tieredkv.store.TieredStore._checked) ---- */

/* One ids sequence of a chunk in the form this takes: an exact tuple or list of exactly bpc
 * exact ints, each in 0..n_blocks-1. Returns a new tuple of them (the same tuple when it is one),
 * or NULL with no exception set when the chunk is not in that form (the caller's Python path
 * then says what is wrong, or accepts a form this does not take). */
static PyObject *checked_ids(PyObject *ids, Py_ssize_t bpc, Py_ssize_t n_blocks) {
    int is_tuple = PyTuple_CheckExact(ids);
    if (!is_tuple && !PyList_CheckExact(ids)) return NULL;
    if (Py_SIZE(ids) != bpc) return NULL;
    PyObject **items = is_tuple ? &PyTuple_GET_ITEM(ids, 0) : PySequence_Fast_ITEMS(ids);
    for (Py_ssize_t j = 0; j < bpc; j++) {
        PyObject *v = items[j];
        if (!PyLong_CheckExact(v)) return NULL;
        int overflow = 0;
        long long b = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || b < 0 || b >= n_blocks) return NULL; /* never sets an error for an exact int */
    }
    return is_tuple ? Py_NewRef(ids) : PyList_AsTuple(ids);
}

/* check_chunks(chunks, ref_type, fp, suffix, bpc, n_blocks, min_key, max_key): the chunks of a
 * call, each (key, block_ids), as a tuple of ref_type (a tuple subclass of two fields, e.g.
 * ChunkRef), when every chunk is in the form this takes: an exact tuple or list (or ref_type) of
 * two; the key exact bytes of min_key..max_key bytes starting with fp and ending with suffix;
 * block_ids as checked_ids takes them. Else the index (int) of the first chunk it does not take:
 * the caller checks the call again in Python, which raises what is wrong or takes a form this
 * does not (any iterable, keys of other buffer types, ids of other index types). Nothing here
 * calls back into Python, so no list it reads can change under it. */
static PyObject *check_chunks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8 || !(PyList_CheckExact(args[0]) || PyTuple_CheckExact(args[0])) || !PyType_Check(args[1]) ||
        !PyBytes_CheckExact(args[2]) || !PyBytes_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError, "check_chunks(chunks: list | tuple, ref_type: type, fp: bytes, suffix: "
                                         "bytes, bpc: int, n_blocks: int, min_key: int, max_key: int)");
        return NULL;
    }
    PyTypeObject *ref = (PyTypeObject *)args[1];
    if (!PyType_IsSubtype(ref, &PyTuple_Type) || ref->tp_basicsize != PyTuple_Type.tp_basicsize ||
        ref->tp_itemsize != PyTuple_Type.tp_itemsize) {
        PyErr_SetString(PyExc_TypeError, "check_chunks: ref_type must be a tuple subclass with no fields of its own");
        return NULL;
    }
    Py_ssize_t num[4];
    for (int i = 0; i < 4; i++) {
        num[i] = PyLong_AsSsize_t(args[4 + i]);
        if (num[i] == -1 && PyErr_Occurred()) return NULL;
    }
    Py_ssize_t bpc = num[0], n_blocks = num[1], min_key = num[2], max_key = num[3];
    if (bpc < 1 || n_blocks < 0) {
        PyErr_SetString(PyExc_ValueError, "check_chunks: bpc must be at least 1 and n_blocks not negative");
        return NULL;
    }
    const char *fp = PyBytes_AS_STRING(args[2]), *suffix = PyBytes_AS_STRING(args[3]);
    Py_ssize_t fplen = PyBytes_GET_SIZE(args[2]), sufflen = PyBytes_GET_SIZE(args[3]);
    PyObject *chunks = args[0];
    Py_ssize_t n = Py_SIZE(chunks);
    PyObject *out = PyTuple_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_CheckExact(chunks) ? PyList_GET_ITEM(chunks, i) : PyTuple_GET_ITEM(chunks, i);
        PyObject *key, *ids;
        if ((PyTuple_CheckExact(item) || Py_IS_TYPE(item, ref)) && PyTuple_GET_SIZE(item) == 2) {
            key = PyTuple_GET_ITEM(item, 0);
            ids = PyTuple_GET_ITEM(item, 1);
        } else if (PyList_CheckExact(item) && PyList_GET_SIZE(item) == 2) {
            key = PyList_GET_ITEM(item, 0);
            ids = PyList_GET_ITEM(item, 1);
        } else
            goto refuse;
        if (!PyBytes_CheckExact(key)) goto refuse;
        Py_ssize_t klen = PyBytes_GET_SIZE(key);
        const char *k = PyBytes_AS_STRING(key);
        if (klen < min_key || klen > max_key || klen < fplen || klen < sufflen || memcmp(k, fp, (size_t)fplen) != 0 ||
            memcmp(k + klen - sufflen, suffix, (size_t)sufflen) != 0)
            goto refuse;
        PyObject *block_ids = checked_ids(ids, bpc, n_blocks);
        if (block_ids == NULL) {
            if (PyErr_Occurred()) goto fail;
            goto refuse;
        }
        PyObject *r = ref->tp_alloc(ref, 2);
        if (r == NULL) {
            Py_DECREF(block_ids);
            goto fail;
        }
        PyTuple_SET_ITEM(r, 0, Py_NewRef(key));
        PyTuple_SET_ITEM(r, 1, block_ids);
        PyTuple_SET_ITEM(out, i, r);
        continue;
    refuse:
        Py_DECREF(out);
        return PyLong_FromSsize_t(i);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"set_layout", (PyCFunction)(void (*)(void))set_layout, METH_VARARGS | METH_KEYWORDS,
     "set_layout(*, header, magic, magic_at, version, header_size, fingerprint, group, flags, length, checksum, "
     "versions) -> None: the record layout (tieredkv.format.native_layout())"},
    {"layout", layout, METH_NOARGS, "layout() -> dict of set_layout's arguments as held here, or None"},
    {"verify_many", (PyCFunction)(void (*)(void))verify_many, METH_FASTCALL,
     "verify_many(records, keys, dsts) -> list of payload lengths, -1 (bad record) or -2 (does not fit)"},
    {"verify_parts_many", (PyCFunction)(void (*)(void))verify_parts_many, METH_FASTCALL,
     "verify_parts_many(heads, payloads, keys, dsts, head_at=0) -> list of verify_many's answers"},
    {"heads_many", (PyCFunction)(void (*)(void))heads_many, METH_FASTCALL,
     "heads_many(heads, keys, payloads, version) -> None: the default tenant's headers written (the LMDB put)"},
    {"sum_heads", (PyCFunction)(void (*)(void))sum_heads, METH_FASTCALL,
     "sum_heads(heads, keys, payloads) -> None: each header's checksum written in (the LMDB put)"},
    {"stream_into", (PyCFunction)(void (*)(void))stream_into, METH_FASTCALL,
     "stream_into(dst, src) -> bytes copied (non-temporal stores)"},
    {"move_pieces", (PyCFunction)(void (*)(void))move_pieces, METH_FASTCALL,
     "move_pieces(dst, dst_offsets, src, src_offsets, piece, threads=1) -> bytes copied (scattered blocks)"},
    {"move_pieces_async", (PyCFunction)(void (*)(void))move_pieces_async, METH_FASTCALL,
     "move_pieces_async(dst, dst_offsets, src, src_offsets, piece, threads, notify_fd) -> MoveTicket"},
    {"move_fence", (PyCFunction)move_fence, METH_NOARGS,
     "move_fence() -> None: wait until the mover writes no notification byte any more for moves seen done"},
    {"move_wake", (PyCFunction)move_wake, METH_O,
     "move_wake(threads) -> None: wake move_pieces' helper threads ahead of a move"},
    {"read_placed", (PyCFunction)(void (*)(void))read_placed_py, METH_FASTCALL,
     "read_placed(directory, entries, keys, dsts, layout) -> list: read_records of records placed by index entries"},
    {"check_chunks", (PyCFunction)(void (*)(void))check_chunks, METH_FASTCALL,
     "check_chunks(chunks, ref_type, fp, suffix, bpc, n_blocks, min_key, max_key) -> tuple of ref_type, or the "
     "index of the first chunk to check again in Python"},
    {"read_records", (PyCFunction)(void (*)(void))read_records_py, METH_FASTCALL,
     "read_records(paths, offsets, sizes, keys, dsts) -> list of payload lengths, -1, -2 or OSError"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tieredkv._fastrec", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fastrec(void) {
    if (PyType_Ready(&MoveTicketType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "MoveTicket", (PyObject *)&MoveTicketType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
