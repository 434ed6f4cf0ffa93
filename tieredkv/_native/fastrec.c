/* tieredkv._fastrec: a record's encode and its checked copy in one call each, the GIL released
 * for the copy and the checksum; also a record's header alone (heads_many) and the checked copy
 * of a record kept as header and payload apart (verify_parts_many), for the LMDB tier's layout.
 *
 * The record format is tieredkv/format.py's (a 64-byte header, then the payload); this module
 * computes exactly what format.py computes, and tests/unit/test_format.py checks both ways (a
 * record written by one path verifies on the other, a damaged one fails on both). The checksum is
 * XXH3-64 (seed 0) of the stored key, header bytes 0..31 (a version 2 record: then bytes 48..63,
 * its tenant) and the payload, streamed through the
 * system's libxxhash (Debian's libxxhash0, a dependency of apt); its prototypes are declared here
 * because the -dev header is not on a new machine. Built as an optional extension: where it does
 * not build or load, format.py keeps its pure-Python path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

typedef struct XXH3_state_s XXH3_state_t; /* opaque here: only created, fed and freed */
extern XXH3_state_t *XXH3_createState(void);
extern int XXH3_freeState(XXH3_state_t *state);
extern int XXH3_64bits_reset(XXH3_state_t *state);
#if defined(__x86_64__) || defined(__i386__)
/* xxh_x86dispatch: AVX2 / AVX-512 picked at run time (the plain update is the SSE2 build: about
 * half the speed on this machine kind, 10 against 23 GB/s at 64 KiB). */
#define XXH3_UPDATE XXH3_64bits_update_dispatch
#else
#define XXH3_UPDATE XXH3_64bits_update
#endif
extern int XXH3_UPDATE(XXH3_state_t *state, const void *input, size_t length);
extern unsigned long long XXH3_64bits_digest(const XXH3_state_t *state);

#define HEADER_SIZE 64
#define PREFIX 32
#define FP_BYTES 16
#define GROUP_BYTES 4
#define FORMAT_VERSION 1 /* a record of the default tenant: as every earlier version wrote it */
#define TENANT_VERSION 2 /* a record with a tenant (bytes 48..55), covered by the checksum */
#define TENANT_AT 48
#define FLAG_SEALED 1u /* sealed (AES-256-GCM) records are opened in Python, never here */
/* Below this many payload bytes the GIL is kept: releasing and taking it back costs more than
 * the copy and the checksum of a small payload. */
#define RELEASE_AT (16 * 1024)
/* From this many payload bytes a checked copy streams to its destination (see copy_checksum). */
#define STREAM_AT (64 * 1024)

static void put_le(uint8_t *p, uint64_t v, int n) {
    for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

#define STEP (64 * 1024)

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

/* Copies n bytes from src to dst and returns the XXH3-64 of key, then the header's first 32
 * bytes, then the payload, in one pass of STEP-byte pieces:
 *  - plain (stream == 0): each piece copied, then hashed where it landed while still in cache
 *    (what is checked is what was delivered);
 *  - streamed: each piece hashed where it is (which brings it into cache), then streamed to dst
 *    from there, so the payload is read from memory once and dst written once. The source must
 *    not change during the call (a record in an LMDB read transaction's snapshot, or bytes of
 *    this process): then the bytes that reach dst are the bytes hashed.
 * *ok is 0 when the state could not be allocated (the only way it can fail). */
static uint64_t copy_checksum(uint8_t *dst, const uint8_t *src, size_t n, const uint8_t *key, size_t klen,
                              const uint8_t *head, int stream, int *ok) {
    XXH3_state_t *st = XXH3_createState();
    if (st == NULL) {
        *ok = 0;
        return 0;
    }
    XXH3_64bits_reset(st);
    XXH3_UPDATE(st, key, klen);
    XXH3_UPDATE(st, head, PREFIX);
    if (get_le(head + 4, 2) == TENANT_VERSION) XXH3_UPDATE(st, head + TENANT_AT, HEADER_SIZE - TENANT_AT);
    if (dst == NULL) { /* the checksum alone: the payload stays where it is */
        XXH3_UPDATE(st, src, n);
        n = 0;
    }
    for (size_t off = 0; off < n; off += STEP) {
        size_t len = n - off < STEP ? n - off : STEP;
#if CAN_STREAM
        if (stream) {
            XXH3_UPDATE(st, src + off, len);
            stream_copy(dst + off, src + off, len);
            continue;
        }
#endif
        memcpy(dst + off, src + off, len);
        XXH3_UPDATE(st, dst + off, len);
    }
#if CAN_STREAM
    if (stream) _mm_sfence(); /* the streamed stores are visible before the caller reports the copy */
#endif
    uint64_t h = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    *ok = 1;
    return h;
}

/* The 20 header bytes 8..27 of a stored key: its fingerprint, then its group little-endian. */
static void header_ids(const uint8_t *key, size_t klen, uint8_t *out) {
    memcpy(out, key, FP_BYTES);
    for (int i = 0; i < GROUP_BYTES; i++) out[FP_BYTES + i] = key[klen - 1 - i];
}

static int key_arg(PyObject *obj, const uint8_t **key, Py_ssize_t *klen) {
    if (!PyBytes_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "key must be bytes, not %.80s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    *klen = PyBytes_GET_SIZE(obj);
    if (*klen < FP_BYTES + GROUP_BYTES) {
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

/* The GIL is let go for a copy of RELEASE_AT bytes or more (below that, taking it back costs more
 * than the copy): ``unlocked(n)`` before the work, ``relock(state)`` after it. */
static PyThreadState *unlocked(Py_ssize_t n) { return n >= RELEASE_AT ? PyEval_SaveThread() : NULL; }

static void relock(PyThreadState *state) {
    if (state != NULL) PyEval_RestoreThread(state);
}

/* The header of a record for ``key`` with an n-byte payload, all but its checksum (bytes 40..47,
 * zero until the payload is hashed): version 1 for the default tenant (0), else version 2 with
 * the tenant in bytes 48..55. */
static void write_header(uint8_t *out, const uint8_t *key, size_t klen, uint64_t n, uint32_t flags, uint64_t tenant) {
    memcpy(out, "TKVR", 4);
    put_le(out + 4, tenant ? TENANT_VERSION : FORMAT_VERSION, 2);
    put_le(out + 6, HEADER_SIZE, 2);
    header_ids(key, klen, out + 8);
    put_le(out + 28, flags, 4);
    put_le(out + 32, n, 8);
    memset(out + 40, 0, HEADER_SIZE - 40);
    put_le(out + TENANT_AT, tenant, 8);
}

/* A tenant argument (an int of 64 bits), or -1 with an exception set. */
static int tenant_arg(PyObject *obj, uint64_t *tenant) {
    unsigned long long t = PyLong_AsUnsignedLongLong(obj);
    if (t == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *tenant = (uint64_t)t;
    return 0;
}

/* encode_into(dst, key, payload, flags, tenant=0) -> record length
 * Writes the header and the payload for ``key`` into ``dst`` (format.encode_record_into). */
static PyObject *encode_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "encode_into(dst, key, payload, flags, tenant=0)");
        return NULL;
    }
    uint64_t tenant = 0;
    if (nargs == 5 && tenant_arg(args[4], &tenant) < 0) return NULL;
    const uint8_t *key;
    Py_ssize_t klen;
    if (key_arg(args[1], &key, &klen) < 0) return NULL;
    unsigned long flags = PyLong_AsUnsignedLong(args[3]);
    if (flags == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    if (flags > 0xffffffffUL) {
        PyErr_SetString(PyExc_OverflowError, "flags must fit 32 bits");
        return NULL;
    }
    Py_buffer dst, src;
    if (two_buffers(args[0], &dst, PyBUF_WRITABLE, args[2], &src, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t n = src.len, total = HEADER_SIZE + src.len;
    PyObject *result = NULL;
    if (dst.len < total) {
        PyErr_Format(PyExc_ValueError, "destination of %zd bytes is smaller than the record (%zd)", dst.len, total);
        goto done;
    }
    uint8_t *out = (uint8_t *)dst.buf;
    write_header(out, key, (size_t)klen, (uint64_t)n, (uint32_t)flags, tenant);
    int ok;
    PyThreadState *state = unlocked(n);
    uint64_t h = copy_checksum(out + HEADER_SIZE, src.buf, (size_t)n, key, (size_t)klen, out, 0, &ok);
    relock(state);
    if (!ok) {
        PyErr_NoMemory();
        goto done;
    }
    put_le(out + 40, h, 8);
    result = PyLong_FromSsize_t(total);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
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

/* The work of encode_many (apart == 0) and heads_many (apart == 1): per (key, payload) or
 * (key, payload, tenant) of the list ``items`` (flags 0), one after another from the start of
 * ``dst``, the whole record
 * (header, then the payload copied) or the header alone (the payload left where it is), the GIL
 * released once for every copy and checksum of the call. Returns where each record ends in
 * ``dst`` (apart: each payload's length). Nothing is written unless every item is good and all
 * fit. */
static PyObject *encode_batch(PyObject *const *args, Py_ssize_t nargs, int apart) {
    if (nargs != 2 || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, apart ? "heads_many(dst, items: list)" : "encode_many(dst, items: list)");
        return NULL;
    }
    PyObject *items = args[1], *result = NULL;
    Py_ssize_t count = PyList_GET_SIZE(items), held = 0, total = 0;
    int ok = 1;
    Py_buffer dst;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_WRITABLE) < 0) return NULL;
    /* per item its payload's buffer and its key (a reference held: the list may change while
     * the GIL is let go, the keys and buffers stay) */
    Py_buffer *bufs = PyMem_Calloc(count ? (size_t)count : 1, sizeof(Py_buffer));
    PyObject **keys = PyMem_Calloc(count ? (size_t)count : 1, sizeof(PyObject *));
    Py_ssize_t *ends = PyMem_Calloc(count ? (size_t)count : 1, sizeof(Py_ssize_t));
    uint64_t *tenants = PyMem_Calloc(count ? (size_t)count : 1, sizeof(uint64_t));
    if (bufs == NULL || keys == NULL || ends == NULL || tenants == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < count; held++) {
        PyObject *item = PyList_GET_ITEM(items, held);
        const uint8_t *key;
        Py_ssize_t klen;
        if (!PyTuple_Check(item) || (PyTuple_GET_SIZE(item) != 2 && PyTuple_GET_SIZE(item) != 3)) {
            PyErr_Format(PyExc_TypeError, "item %zd is not a (key, payload) pair or (key, payload, tenant)", held);
            goto done;
        }
        if (PyTuple_GET_SIZE(item) == 3 && tenant_arg(PyTuple_GET_ITEM(item, 2), &tenants[held]) < 0) goto done;
        if (key_arg(PyTuple_GET_ITEM(item, 0), &key, &klen) < 0) goto done;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(item, 1), &bufs[held], PyBUF_SIMPLE) < 0) goto done;
        keys[held] = Py_NewRef(PyTuple_GET_ITEM(item, 0));
        total += bufs[held].len;
    }
    Py_ssize_t need = HEADER_SIZE * count + (apart ? 0 : total);
    if (dst.len < need) {
        PyErr_Format(PyExc_ValueError, "destination of %zd bytes is smaller than the %s (%zd)", dst.len,
                     apart ? "headers" : "records", need);
        goto done;
    }
    PyThreadState *state = unlocked(total);
    uint8_t *out = (uint8_t *)dst.buf;
    for (Py_ssize_t i = 0; i < count && ok; i++) {
        const uint8_t *key = (const uint8_t *)PyBytes_AS_STRING(keys[i]);
        size_t klen = (size_t)PyBytes_GET_SIZE(keys[i]), n = (size_t)bufs[i].len;
        write_header(out, key, klen, n, 0, tenants[i]);
        uint64_t h = copy_checksum(apart ? NULL : out + HEADER_SIZE, bufs[i].buf, n, key, klen, out, 0, &ok);
        put_le(out + 40, h, 8);
        out += HEADER_SIZE + (apart ? 0 : n);
        ends[i] = apart ? (Py_ssize_t)n : out - (uint8_t *)dst.buf;
    }
    relock(state);
    if (!ok)
        PyErr_NoMemory();
    else
        result = int_list(ends, count);
done:
    for (Py_ssize_t i = 0; i < held; i++) {
        PyBuffer_Release(&bufs[i]);
        Py_XDECREF(keys[i]);
    }
    PyMem_Free(bufs);
    PyMem_Free(keys);
    PyMem_Free(ends);
    PyMem_Free(tenants);
    PyBuffer_Release(&dst);
    return result;
}

/* encode_many(dst, items) -> list of record ends
 * Encodes each (key, payload) of the list ``items`` (flags 0), one record after another from the
 * start of ``dst`` (encode_batch). */
static PyObject *encode_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return encode_batch(args, nargs, 0);
}

/* heads_many(dst, items) -> list of payload lengths
 * Writes the 64-byte header of each (key, payload) of the list ``items``, one after another from
 * the start of ``dst``, the payloads left where they are: a record kept as its header and its
 * payload apart (the LMDB tier's layout; encode_batch). */
static PyObject *heads_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return encode_batch(args, nargs, 1);
}

/* verify_copy(record, key, dst) -> payload length, -1 (not a good record for key), -2 (does not
 * fit dst)
 * Checks the header against ``key`` and copies the payload to the start of ``dst`` with its
 * checksum: a payload under STREAM_AT is copied, then hashed where it landed; a larger one is
 * hashed piece by piece in ``record`` as each piece is streamed out (copy_checksum). A record
 * that fails leaves ``dst``'s first bytes zeroed: no damaged byte stays where it landed. Which
 * header field is wrong is for format.verify_record to say (it raises, naming it). */
/* The work of verify_copy on plain memory, the GIL held or not: the payload length, -1 (not a
 * good record for key: dst's first bytes zeroed if any landed) or -2 (does not fit dst).
 * *ok is 0 when the hash state could not be allocated. */
static Py_ssize_t check_parts(const uint8_t *h, const uint8_t *p, Py_ssize_t n, const uint8_t *key, size_t klen,
                              uint8_t *out, Py_ssize_t dlen, int *ok) {
    static const uint8_t zero[HEADER_SIZE - 48] = {0};
    uint8_t ids[FP_BYTES + GROUP_BYTES];
    header_ids(key, klen, ids);
    uint64_t version = get_le(h + 4, 2);
    if (memcmp(h, "TKVR", 4) != 0 || (version != FORMAT_VERSION && version != TENANT_VERSION) ||
        get_le(h + 6, 2) != HEADER_SIZE || memcmp(h + 8, ids, sizeof ids) != 0 || get_le(h + 32, 8) != (uint64_t)n)
        return -1;
    if (version == FORMAT_VERSION ? memcmp(h + 48, zero, 16) != 0  /* version 1: bytes 48..63 zero */
                                  : (get_le(h + 28, 4) & FLAG_SEALED) != 0 || memcmp(h + 56, zero, 8) != 0)
        return -1;
    if (n > dlen) return -2;
    uint64_t want = get_le(h + 40, 8);
    uint64_t got = copy_checksum(out, p, (size_t)n, key, klen, h, n >= STREAM_AT, ok);
    if (!*ok || got != want) {
        memset(out, 0, (size_t)n); /* nothing unchecked stays where it landed */
        return -1;
    }
    return n;
}

static Py_ssize_t check_copy(const uint8_t *r, Py_ssize_t rlen, const uint8_t *key, size_t klen, uint8_t *out,
                             Py_ssize_t dlen, int *ok) {
    if (rlen < HEADER_SIZE) return -1;
    return check_parts(r, r + HEADER_SIZE, rlen - HEADER_SIZE, key, klen, out, dlen, ok);
}

static PyObject *verify_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "verify_copy(record, key, dst)");
        return NULL;
    }
    const uint8_t *key;
    Py_ssize_t klen;
    if (key_arg(args[1], &key, &klen) < 0) return NULL;
    Py_buffer rec, dst;
    if (two_buffers(args[0], &rec, PyBUF_SIMPLE, args[2], &dst, PyBUF_WRITABLE) < 0) return NULL;
    int ok = 1;
    PyThreadState *state = unlocked(rec.len);
    Py_ssize_t result = check_copy(rec.buf, rec.len, key, (size_t)klen, dst.buf, dst.len, &ok);
    relock(state);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&rec);
    return ok ? PyLong_FromSsize_t(result) : PyErr_NoMemory();
}

/* The work of verify_many (apart == 0: args records, keys, dsts) and verify_parts_many
 * (apart == 1: args heads, payloads, keys, dsts[, head_at]): verify_copy for each item, the GIL
 * let go once for every check and copy of the call. A record kept apart has its header at
 * head_at (default 0) in heads[i], which must be exactly head_at + 64 bytes long, else the
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
    int ok = 1;
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
    for (Py_ssize_t i = 0; i < count && ok; i++) {
        Py_buffer *b = &bufs[3 * i];
        const uint8_t *key = (const uint8_t *)PyBytes_AS_STRING(keys[i]);
        size_t klen = (size_t)PyBytes_GET_SIZE(keys[i]);
        if (!apart)
            got[i] = check_copy(b[1].buf, b[1].len, key, klen, b[2].buf, b[2].len, &ok);
        else if (b[0].len != head_at + HEADER_SIZE)
            got[i] = -1;
        else
            got[i] = check_parts((const uint8_t *)b[0].buf + head_at, b[1].buf, b[1].len, key, klen, b[2].buf, b[2].len, &ok);
    }
    relock(state);
    if (!ok)
        PyErr_NoMemory();
    else
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

/* verify_many(records, keys, dsts) -> list of verify_copy's answers
 * verify_copy for each (record, key, dst) of three lists of one length (verify_batch). */
static PyObject *verify_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return verify_batch(args, nargs, 0);
}

/* verify_parts_many(heads, payloads, keys, dsts, head_at=0) -> list of verify_copy's answers
 * verify_many for records kept as a header and a payload apart (heads[i] holds the 64-byte
 * header of payloads[i] at head_at; verify_batch). */
static PyObject *verify_parts_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return verify_batch(args, nargs, 1);
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


/* ---- record files (the LMDB tier's large batches: a file of records beside the index) ---- */

#define IOV_BATCH 512 /* iovecs per pwritev (IOV_MAX is 1024 on Linux) */

/* Writes all of iov[0..cnt) at offset *off of fd (short writes resumed; *off advanced): 0, or -1
 * with errno set. */
static int write_all(int fd, struct iovec *iov, int cnt, off_t *off) {
    while (cnt > 0) {
        ssize_t w = pwritev(fd, iov, cnt, *off);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        *off += w;
        while (cnt > 0 && (size_t)w >= iov->iov_len) {
            w -= (ssize_t)iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + w;
            iov->iov_len -= (size_t)w;
        }
    }
    return 0;
}

/* One record file: created (never an existing one), or with ``reuse`` an existing file
 * overwritten from its start (never made shorter: a reader may have it mapped, and a map past
 * the end of its file faults); each header then its payload, synced when asked; on a failure
 * the file is removed (never a partial file under its name). */
static int write_records(const char *path, const uint8_t *heads, Py_buffer *bufs, Py_ssize_t count, int sync,
                         int reuse) {
    int fd = open(path, reuse ? O_WRONLY | O_CLOEXEC : O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return -1;
    struct iovec iov[2 * IOV_BATCH];
    off_t off = 0;
    int rc = 0;
    for (Py_ssize_t i = 0; i < count && rc == 0;) {
        int cnt = 0;
        for (; i < count && cnt < 2 * IOV_BATCH; i++) {
            iov[cnt].iov_base = (void *)(heads + HEADER_SIZE * i);
            iov[cnt++].iov_len = HEADER_SIZE;
            iov[cnt].iov_base = bufs[i].buf;
            iov[cnt++].iov_len = (size_t)bufs[i].len;
        }
        rc = write_all(fd, iov, cnt, &off);
    }
    if (rc == 0 && sync) rc = fdatasync(fd);
    int saved = errno;
    if (close(fd) < 0 && rc == 0) {
        rc = -1;
        saved = errno;
    }
    if (rc < 0) unlink(path);
    errno = saved;
    return rc;
}

/* write_records(path, heads, payloads, sync, reuse=False) -> None
 * Creates the file ``path`` (str or bytes; must not exist; with ``reuse``, an existing file
 * overwritten from its start, never shortened) holding, one after another, each record: heads' i-th 64 bytes,
 * then payloads[i]; fdatasync'd when ``sync``. The GIL is let go for the whole write. On a
 * failure the file is removed and OSError, naming it, raised. */
static PyObject *write_records_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if ((nargs != 4 && nargs != 5) || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "write_records(path, heads, payloads: list, sync, reuse=False)");
        return NULL;
    }
    int sync = PyObject_IsTrue(args[3]);
    if (sync < 0) return NULL;
    int reuse = nargs == 5 ? PyObject_IsTrue(args[4]) : 0;
    if (reuse < 0) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(args[2]), held = 0;
    PyObject *result = NULL, *name = NULL;
    Py_buffer heads, *bufs = PyMem_Calloc(count ? (size_t)count : 1, sizeof(Py_buffer));
    int have_heads = 0, rc = 0;
    if (bufs == NULL) return PyErr_NoMemory();
    if (!PyUnicode_FSConverter(args[0], &name)) goto done;
    if (PyObject_GetBuffer(args[1], &heads, PyBUF_SIMPLE) < 0) goto done;
    have_heads = 1;
    if (heads.len < HEADER_SIZE * count) {
        PyErr_Format(PyExc_ValueError, "heads of %zd bytes is short of %zd headers", heads.len, count);
        goto done;
    }
    for (; held < count; held++)
        if (PyObject_GetBuffer(PyList_GET_ITEM(args[2], held), &bufs[held], PyBUF_SIMPLE) < 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    rc = write_records(PyBytes_AS_STRING(name), heads.buf, bufs, count, sync, reuse);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, args[0]);
    else
        result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&bufs[i]);
    if (have_heads) PyBuffer_Release(&heads);
    Py_XDECREF(name);
    PyMem_Free(bufs);
    return result;
}

/* read_records(paths, offsets, sizes, keys, dsts) -> list
 * Delivers the record of sizes[i] bytes (header and payload) at offsets[i] of file paths[i] (as
 * write_records wrote it) into dsts[i], checked for keys[i], as verify_copy does (the header
 * checked, the payload hashed where it is and streamed out); per item the payload length, -1
 * (not a good record for its key, or the file ends before it), -2 (does not fit) or an OSError
 * naming the path (FileNotFoundError: removed meanwhile). Each run of items in one file maps the
 * part of the file they span once (read-only, populated in one go: page-cache pages, no copy into
 * a bounce buffer). The GIL is let go once for all of them. The files must not shrink meanwhile
 * (tieredkv never truncates one; blocks given back read as zeros: a record that fails).
 * A file another writer changes during the call (a dead record's blocks punched, a spare written
 * over) can change a piece between its hash and its copy: what is delivered then verified without
 * being what was hashed. The caller rules that out after the call (the LMDB tier checks that each
 * record is still where it was read from: a writer changes a file only after the records there
 * have left it). Hashing what landed instead cost a third of the read's speed (measured). */
/* The reads of read_records and read_placed, the GIL let go by the caller: item i is the record of
 * lens[i] bytes at offs[i] of file paths[i] (a run of items in one file, next to each other, maps
 * the part of it they span once), delivered into bufs[i] checked for keys[i]; got[i] as
 * read_records returns it, -3 for an OSError of errno errs[i]. */
static void read_core(Py_ssize_t count, char *const *paths, const uint64_t *offs, const uint64_t *lens,
                      PyObject *const *keys, Py_buffer *bufs, Py_ssize_t *got, int *errs, int *ok) {
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    for (Py_ssize_t i = 0; i < count && *ok;) {
        const char *path = paths[i];
        Py_ssize_t end = i + 1;
        while (end < count && strcmp(paths[end], path) == 0) end++;
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        struct stat st;
        int err = fd < 0 ? errno : (fstat(fd, &st) < 0 ? errno : 0);
        uint64_t lo = UINT64_MAX, hi = 0, fsize = err ? 0 : (uint64_t)st.st_size;
        for (Py_ssize_t j = i; j < end && !err; j++) {
            if (lens[j] < HEADER_SIZE || offs[j] > fsize || lens[j] > fsize - offs[j]) continue; /* ends early */
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
        for (Py_ssize_t j = i; j < end && *ok; j++) {
            if (err) {
                got[j] = -3;
                errs[j] = err;
            } else if (lens[j] < HEADER_SIZE || offs[j] > fsize || lens[j] > fsize - offs[j]) {
                got[j] = -1;
            } else {
                const uint8_t *rec = map + (offs[j] - base);
                got[j] = check_copy(rec, (Py_ssize_t)lens[j], (const uint8_t *)PyBytes_AS_STRING(keys[j]),
                                    (size_t)PyBytes_GET_SIZE(keys[j]), bufs[j].buf, bufs[j].len, ok);
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

/* read_core over the first n items of a, the GIL let go; 0, or -1 with MemoryError. */
static int read_arrays_run(read_arrays *a, Py_ssize_t n) {
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    read_core(n, a->paths, a->offs, a->lens, a->keys, a->bufs, a->got, a->errs, &ok);
    Py_END_ALLOW_THREADS
    if (!ok) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* read_records(paths, offsets, sizes, keys, dsts) -> list
 * Delivers the record of sizes[i] bytes (header and payload) at offsets[i] of file paths[i] (as
 * write_records wrote it) into dsts[i], checked for keys[i], as verify_copy does (the header
 * checked, the payload hashed where it is and streamed out); per item the payload length, -1
 * (not a good record for its key, or the file ends before it), -2 (does not fit) or an OSError
 * naming the path (FileNotFoundError: removed meanwhile). Each run of items in one file maps the
 * part of the file they span once (read-only, populated in one go: page-cache pages, no copy into
 * a bounce buffer). The GIL is let go once for all of them. The files must not shrink meanwhile
 * (tieredkv never truncates one; blocks given back read as zeros: a record that fails).
 * A file another writer changes during the call (a dead record's blocks punched, a spare written
 * over) can change a piece between its hash and its copy: what is delivered then verified without
 * being what was hashed. The caller rules that out after the call (the LMDB tier checks that each
 * record is still where it was read from: a writer changes a file only after the records there
 * have left it). Hashing what landed instead cost a third of the read's speed (measured). */
static PyObject *read_records_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int good = nargs == 5;
    for (Py_ssize_t j = 0; good && j < 5; j++)
        good = PyList_Check(args[j]) && PyList_GET_SIZE(args[j]) == PyList_GET_SIZE(args[0]);
    if (!good) {
        PyErr_SetString(PyExc_TypeError,
                        "read_records(paths: list, offsets: list, sizes: list, keys: list, dsts: list), of one length");
        return NULL;
    }
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
    if (read_arrays_run(&a, count) < 0) goto done;
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
    if (read_arrays_run(&a, held) < 0) goto done;
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

static PyMethodDef methods[] = {
    {"encode_into", (PyCFunction)(void (*)(void))encode_into, METH_FASTCALL,
     "encode_into(dst, key, payload, flags, tenant=0) -> record length"},
    {"encode_many", (PyCFunction)(void (*)(void))encode_many, METH_FASTCALL,
     "encode_many(dst, items) -> list of record ends"},
    {"heads_many", (PyCFunction)(void (*)(void))heads_many, METH_FASTCALL,
     "heads_many(dst, items) -> list of payload lengths (headers only, payloads left in place)"},
    {"verify_copy", (PyCFunction)(void (*)(void))verify_copy, METH_FASTCALL,
     "verify_copy(record, key, dst) -> payload length, -1 (bad record) or -2 (does not fit)"},
    {"verify_many", (PyCFunction)(void (*)(void))verify_many, METH_FASTCALL,
     "verify_many(records, keys, dsts) -> list of verify_copy's answers"},
    {"verify_parts_many", (PyCFunction)(void (*)(void))verify_parts_many, METH_FASTCALL,
     "verify_parts_many(heads, payloads, keys, dsts, head_at=0) -> list of verify_copy's answers"},
    {"stream_into", (PyCFunction)(void (*)(void))stream_into, METH_FASTCALL,
     "stream_into(dst, src) -> bytes copied (non-temporal stores)"},
    {"write_records", (PyCFunction)(void (*)(void))write_records_py, METH_FASTCALL,
     "write_records(path, heads, payloads, sync, reuse=False) -> None (one file of records)"},
    {"read_placed", (PyCFunction)(void (*)(void))read_placed_py, METH_FASTCALL,
     "read_placed(directory, entries, keys, dsts, layout) -> list: read_records of records placed by index entries"},
    {"read_records", (PyCFunction)(void (*)(void))read_records_py, METH_FASTCALL,
     "read_records(paths, offsets, sizes, keys, dsts) -> list of payload lengths, -1, -2 or OSError"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tieredkv._fastrec", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fastrec(void) { return PyModule_Create(&module); }
