/*
 * kvbeam.pools._xxh3: a request's per-buffer XXH3-128 digests in one call, without the GIL
 * and without copying scattered items together first.
 *
 * Why: kvbeam.pools.digest digests each buffer with python-xxhash, one Python call per
 * buffer (27 for a 128-token request of docker/config/prefill.yaml, 182 for a 61-layer
 * one), with a numpy gather first when the buffer's items are not one run, and xxhash
 * holds the GIL for inputs under 64 KiB. Per small request that Python work, not the
 * hash, was most of the digests' cost on both daemons (docs/performance.md, "Digests").
 *
 * digest_parts(parts) takes a sequence of (items, idx, item_len, offset, width) tuples:
 * `items` a C-contiguous buffer of whole items (a pool buffer's memory), `idx` a
 * C-contiguous int64 buffer of item numbers, and the bytes [offset, offset + width) of
 * each item are what is digested, items in idx order. It returns one bytes object, 16
 * per part: the XXH3-128 (seed 0) of those bytes concatenated, little-endian (python-
 * xxhash's xxh3_128_intdigest(...).to_bytes(16, "little")), the layout the digest record
 * carries, so a request's digests never become Python ints one by one. XXH3's streaming
 * form digests the pieces
 * as they lie; its result equals the one-shot digest of the concatenation. Consecutive
 * whole items are one piece.
 *
 * Every item number and window is checked against its buffer before a byte is read
 * (ValueError for a malformed part, IndexError naming the part and the item for an item
 * outside its buffer). The hashing runs with the GIL released unless the caller passes
 * release_gil=False (a small job: taking the GIL back from a busy thread can cost up to
 * the interpreter's switch interval, 5 ms, far more than hashing a few hundred KB); the
 * buffers stay pinned (PyObject_GetBuffer) until it is done.
 *
 * Optional, like the WR poster: setup.py builds it where <xxhash.h> (Debian's
 * libxxhash-dev) is installed; without it kvbeam.pools.digest digests through python-xxhash.
 * XXH_INLINE_ALL compiles the header's implementation in, so nothing is linked. The loop
 * is built for the baseline CPU (pools/_xxh3_loop.h: SSE2 on x86-64, NEON on aarch64,
 * xxhash's own choice elsewhere) and, on x86-64 only, for AVX2 too (pools/_xxh3_avx2.c);
 * where the CPU reports AVX2 both are timed when the module loads and the faster is kept
 * (VECTOR names it, VECTOR_CHOICE says why: an emulator may run AVX2 slower).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_int64_buffer.h"
#include "_xxh3_arch.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

/* What one part holds while its digest is computed (the buffers pinned). */
struct part {
    Py_buffer items;
    Py_buffer idx;
    Py_ssize_t item_len;
    Py_ssize_t offset;
    Py_ssize_t width;
    uint64_t hash[2]; /* high 64 bits, low 64 bits */
};

/* Pin the part's buffers and check its shape; 0, or -1 with an exception set (nothing
 * left pinned). */
static int part_open(PyObject *tuple, Py_ssize_t number, struct part *p) {
    PyObject *items, *idx;
    if (!PyTuple_Check(tuple) ||
        !PyArg_ParseTuple(tuple, "OOnnn", &items, &idx, &p->item_len, &p->offset, &p->width)) {
        if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "digest part %zd: not an (items, idx, item_len, "
                         "offset, width) tuple", number);
        }
        return -1;
    }
    if (p->item_len <= 0 || p->offset < 0 || p->width < 0 ||
        p->offset > p->item_len - p->width) {
        PyErr_Format(PyExc_ValueError, "digest part %zd: window [%zd, %zd + %zd) is not "
                     "inside an item of %zd bytes", number, p->offset, p->offset, p->width,
                     p->item_len);
        return -1;
    }
    if (PyObject_GetBuffer(items, &p->items, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (p->items.len % p->item_len != 0) {
        PyErr_Format(PyExc_ValueError, "digest part %zd: a buffer of %zd bytes is not whole "
                     "items of %zd bytes", number, p->items.len, p->item_len);
        PyBuffer_Release(&p->items);
        return -1;
    }
    if (PyObject_GetBuffer(idx, &p->idx, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&p->items);
        return -1;
    }
    if (!is_int64(&p->idx)) {
        PyErr_Format(PyExc_ValueError, "digest part %zd: item numbers must be int64 "
                     "(format %s, itemsize %zd)", number,
                     p->idx.format ? p->idx.format : "?", p->idx.itemsize);
        PyBuffer_Release(&p->idx);
        PyBuffer_Release(&p->items);
        return -1;
    }
    return 0;
}

static void part_close(struct part *p) {
    PyBuffer_Release(&p->idx);
    PyBuffer_Release(&p->items);
}

/* The first item number outside [0, count) in the part, or -1 when all are inside. */
static Py_ssize_t first_outside(const struct part *p) {
    const int64_t *idx = (const int64_t *)p->idx.buf;
    Py_ssize_t n = p->idx.len / 8;
    int64_t count = (int64_t)(p->items.len / p->item_len);
    for (Py_ssize_t i = 0; i < n; i++)
        if (idx[i] < 0 || idx[i] >= count)
            return i;
    return -1;
}

/* The baseline build of the loop, and on x86-64 the AVX2 build (pools/_xxh3_avx2.c). */
#define KVBEAM_XXH3_DIGEST kvbeam_xxh3_digest_base
#include "_xxh3_loop.h"
#if defined(KVBEAM_XXH3_AVX2)
void kvbeam_xxh3_digest_avx2(const unsigned char *base, const int64_t *idx, ptrdiff_t n,
                             size_t item_len, size_t offset, size_t width, uint64_t out[2]);
#endif
#if defined(__x86_64__)
#define BASELINE_NAME "sse2"
#elif defined(__ARM_NEON) || defined(__aarch64__)
#define BASELINE_NAME "neon"
#else
#define BASELINE_NAME "scalar"
#endif

typedef void (*digest_fn)(const unsigned char *, const int64_t *, ptrdiff_t, size_t, size_t,
                          size_t, uint64_t[2]);
/* Chosen once, when the module loads. */
static digest_fn part_digest_fn = kvbeam_xxh3_digest_base;
static const char *vector_name = BASELINE_NAME;

static void part_digest(struct part *p) {
    part_digest_fn((const unsigned char *)p->items.buf, (const int64_t *)p->idx.buf,
                   p->idx.len / 8, (size_t)p->item_len, (size_t)p->offset, (size_t)p->width,
                   p->hash);
}

/* A digest as the record carries it: the 128-bit value little-endian (low 64 bits first),
 * what int.to_bytes(16, "little") gives for python-xxhash's xxh3_128_intdigest. */
static void put_digest(unsigned char *out, const uint64_t hash[2]) {
    for (int i = 0; i < 8; i++) {
        out[i] = (unsigned char)(hash[1] >> (8 * i));
        out[8 + i] = (unsigned char)(hash[0] >> (8 * i));
    }
}

/* Hash every part (item numbers checked first). */
static void digest_all(struct part *parts, Py_ssize_t n, Py_ssize_t *bad_part,
                       Py_ssize_t *bad_item) {
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t outside = first_outside(&parts[i]);
        if (outside >= 0) {
            *bad_part = i;
            *bad_item = outside;
            return;
        }
        part_digest(&parts[i]);
    }
}

static PyObject *digest_parts(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *arg;
    int release_gil = 1;
    if (!PyArg_ParseTuple(args, "O|p:digest_parts", &arg, &release_gil))
        return NULL;
    PyObject *seq = PySequence_Fast(arg, "digest_parts takes a sequence of parts");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    struct part *parts = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(*parts));
    PyObject *out = NULL;
    Py_ssize_t opened = 0, bad_part = -1, bad_item = -1;
    if (parts == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (; opened < n; opened++)
        if (part_open(PySequence_Fast_GET_ITEM(seq, opened), opened, &parts[opened]) < 0)
            goto done;
    if (release_gil) {
        Py_BEGIN_ALLOW_THREADS
        digest_all(parts, n, &bad_part, &bad_item);
        Py_END_ALLOW_THREADS
    } else {
        digest_all(parts, n, &bad_part, &bad_item);
    }
    if (bad_part >= 0) {
        const struct part *p = &parts[bad_part];
        PyErr_Format(PyExc_IndexError, "digest part %zd: item %lld (position %zd) is outside "
                     "its buffer of %zd items", bad_part,
                     (long long)((const int64_t *)p->idx.buf)[bad_item], bad_item,
                     p->items.len / p->item_len);
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, n * 16);
    if (out != NULL) {
        unsigned char *at = (unsigned char *)PyBytes_AS_STRING(out);
        for (Py_ssize_t i = 0; i < n; i++)
            put_digest(at + 16 * i, parts[i].hash);
    }
done:
    for (Py_ssize_t i = 0; i < opened; i++)
        part_close(&parts[i]);
    PyMem_Free(parts);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"digest_parts", digest_parts, METH_VARARGS,
     "digest_parts(parts, release_gil=True) -> bytes: XXH3-128 (seed 0) of each "
     "(items, idx, item_len, offset, width) part's bytes, 16 little-endian bytes per part, "
     "the GIL released unless release_gil is false."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_xxh3",
    "Per-buffer XXH3-128 digests of a request in one call (see pools/_xxh3.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

/* Nanoseconds the loop takes over `len` bytes, the best of `rounds` runs. */
#if defined(KVBEAM_XXH3_AVX2)
static long long best_ns(digest_fn fn, const unsigned char *data, size_t len, int rounds) {
    int64_t first = 0;
    uint64_t hash[2];
    long long best = -1;
    for (int r = 0; r < rounds; r++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        fn(data, &first, 1, len, 0, len, hash);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        long long ns = (t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);
        if (best < 0 || ns < best)
            best = ns;
    }
    return best;
}

/* Where the CPU reports AVX2, time both builds over 64 KiB and keep the faster: on real
 * x86 CPUs that is AVX2 (about 1.5x), but an emulator (qemu's TCG, the soft-RoCE guest)
 * may run AVX2 slower than SSE2. A few tens of microseconds once, at import. */
static void choose_loop(char *why, size_t why_len) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2")) {
        snprintf(why, why_len, "sse2: the CPU reports no AVX2");
        return;
    }
    const size_t len = 64 << 10;
    unsigned char *data = malloc(len);
    if (data == NULL) {
        part_digest_fn = kvbeam_xxh3_digest_avx2;
        vector_name = "avx2";
        snprintf(why, why_len, "avx2: the CPU reports it (not timed: no memory)");
        return;
    }
    for (size_t i = 0; i < len; i++)
        data[i] = (unsigned char)(i * 131u + 7u);
    long long sse2 = best_ns(kvbeam_xxh3_digest_base, data, len, 1); /* warm up both */
    long long avx2 = best_ns(kvbeam_xxh3_digest_avx2, data, len, 1);
    sse2 = best_ns(kvbeam_xxh3_digest_base, data, len, 3);
    avx2 = best_ns(kvbeam_xxh3_digest_avx2, data, len, 3);
    free(data);
    if (avx2 <= sse2) {
        part_digest_fn = kvbeam_xxh3_digest_avx2;
        vector_name = "avx2";
    }
    snprintf(why, why_len, "%s: 64 KiB in %.1f us with AVX2, %.1f us with SSE2", vector_name,
             avx2 / 1e3, sse2 / 1e3);
}

#else
/* Without the AVX2 build (off x86-64) there is one loop: the baseline's (NEON on aarch64). */
static void choose_loop(char *why, size_t why_len) {
    snprintf(why, why_len, "%s: the baseline build (no AVX2 build: x86-64's only)",
             vector_name);
}
#endif

PyMODINIT_FUNC PyInit__xxh3(void) {
    char why[160];
    choose_loop(why, sizeof(why));
    PyObject *mod = PyModule_Create(&module);
    if (mod != NULL && (PyModule_AddStringConstant(mod, "VECTOR", vector_name) < 0 ||
                        PyModule_AddStringConstant(mod, "VECTOR_CHOICE", why) < 0))
        Py_CLEAR(mod);
    return mod;
}
