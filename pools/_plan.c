/*
 * kvbeam.pools._plan: a request's transfer plan (its blocks) in one call.
 *
 * Why: kvbeam.pools.plan finds each index kind's runs (index pairs contiguous on both
 * sides), checks every buffer's index range and assembles the blocks buffer by buffer.
 * For a small request that was a few hundred Python calls, the largest single share of
 * prefill's CPU per request (docs/performance.md, "What limits the missed targets"); a
 * large one is a few dozen numpy broadcasts. This does the same work in one loop.
 *
 * plan_blocks(pairs, jobs, src_addrs, dst_addrs) takes:
 *   pairs      a sequence of (src_idx, dst_idx): one per index key (a kind, and whether
 *              each side uses the draft's own list of it), C-contiguous int64 buffers of
 *              equal length, already paired (the source's tail where decode holds a prefix);
 *   jobs       a C-contiguous int64 buffer of JOB_FIELDS per planned buffer, in positional
 *              order: flat position, key, source items, destination items, source item
 *              length, destination item length, windowed (0/1), window source offset,
 *              window destination offset, window width;
 *   src_addrs, dst_addrs  the flat buffers' base addresses (sequences of ints).
 * It returns (blocks, meta): `blocks` a bytearray of 3 * n uint64 (every block's source
 * address, then every destination address, then every length), `meta` a bytearray of
 * int64: the jobs' starts (jobs + 1 entries) then each job's item count. Blocks of job j
 * are [starts[j], starts[j + 1]) in the run order of its key (a windowed job: one block
 * per index pair, in list order), exactly what the Python and numpy paths produce.
 *
 * It returns None when an index is outside a buffer (negative, or not below the buffer's
 * item count, on either side): the caller runs the Python checks, which name the first
 * such buffer in positional order. Nothing is computed from an index before every index
 * of its key passed the range check of every job using it, so no address wraps.
 * A malformed argument (a job naming a key or a flat position that does not exist,
 * lists of different lengths, a buffer that is not int64) is a ValueError: the caller
 * built them, so that is a bug, not an engine's input.
 *
 * Optional, like the digests: without a C compiler plans are built in Python and numpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_int64_buffer.h"

#include <stdint.h>
#include <string.h>

#define JOB_FIELDS 10
/* Above this many blocks the assembly runs with the GIL released (a 128k-token request
 * plans tens of thousands); below it releasing and retaking the GIL costs more. */
#define RELEASE_GIL_BLOCKS 8192

enum { J_FLAT, J_KEY, J_SRC_ITEMS, J_DST_ITEMS, J_SRC_LEN, J_DST_LEN, J_WINDOWED,
       J_SRC_OFF, J_DST_OFF, J_WIDTH };

/* One key's paired lists (pinned), runs and bounds. */
struct key {
    Py_buffer src, dst;
    Py_ssize_t n;         /* index pairs */
    Py_ssize_t runs;      /* runs contiguous on both sides */
    int64_t *run_at;      /* each run's first pair */
    int64_t *run_len;     /* each run's pairs */
    int64_t s_lo, s_hi, d_lo, d_hi;
};

static void key_close(struct key *k) {
    PyBuffer_Release(&k->src);
    PyBuffer_Release(&k->dst);
    PyMem_Free(k->run_at);
    PyMem_Free(k->run_len);
}

/* Pin a key's lists, find its runs and bounds; 0, or -1 with an exception set (nothing
 * left pinned). */
static int key_open(PyObject *pair, Py_ssize_t number, struct key *k) {
    PyObject *src, *dst;
    memset(k, 0, sizeof(*k));
    if (!PyTuple_Check(pair) || !PyArg_ParseTuple(pair, "OO", &src, &dst)) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "plan key %zd: not a (src_idx, dst_idx) tuple", number);
        return -1;
    }
    if (PyObject_GetBuffer(src, &k->src, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (PyObject_GetBuffer(dst, &k->dst, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&k->src);
        return -1;
    }
    if (!is_int64(&k->src) || !is_int64(&k->dst) || k->src.len != k->dst.len) {
        PyErr_Format(PyExc_ValueError, "plan key %zd: the lists must be int64 and of equal "
                     "length (%zd and %zd bytes)", number, k->src.len, k->dst.len);
        PyBuffer_Release(&k->src);
        PyBuffer_Release(&k->dst);
        return -1;
    }
    k->n = k->src.len / 8;
    k->s_lo = k->d_lo = 0;
    k->s_hi = k->d_hi = -1; /* empty: every range check passes */
    if (k->n == 0)
        return 0;
    k->run_at = PyMem_Malloc((size_t)k->n * sizeof(int64_t));
    k->run_len = PyMem_Malloc((size_t)k->n * sizeof(int64_t));
    if (k->run_at == NULL || k->run_len == NULL) {
        key_close(k);
        PyErr_NoMemory();
        return -1;
    }
    const int64_t *s = k->src.buf, *d = k->dst.buf;
    k->s_lo = k->s_hi = s[0];
    k->d_lo = k->d_hi = d[0];
    Py_ssize_t runs = 0;
    k->run_at[0] = 0;
    k->run_len[0] = 1;
    for (Py_ssize_t i = 1; i < k->n; i++) {
        if (s[i] < k->s_lo) k->s_lo = s[i];
        if (s[i] > k->s_hi) k->s_hi = s[i];
        if (d[i] < k->d_lo) k->d_lo = d[i];
        if (d[i] > k->d_hi) k->d_hi = d[i];
        /* Unsigned: a list holding INT64_MAX must not overflow (it fails the range check
         * anyway, but the comparison runs first). */
        if ((uint64_t)s[i] == (uint64_t)s[i - 1] + 1 && (uint64_t)d[i] == (uint64_t)d[i - 1] + 1) {
            k->run_len[runs]++;
        } else {
            runs++;
            k->run_at[runs] = i;
            k->run_len[runs] = 1;
        }
    }
    k->runs = runs + 1;
    return 0;
}

/* The base address of flat buffer `flat`, or -1 with an exception set. */
static int base_of(PyObject *fast, int64_t flat, const char *side, uint64_t *out) {
    if (flat < 0 || flat >= PySequence_Fast_GET_SIZE(fast)) {
        PyErr_Format(PyExc_ValueError, "plan: no %s address for flat buffer %lld", side,
                     (long long)flat);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(fast, flat));
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uint64_t)v;
    return 0;
}

struct fill {
    const int64_t *jobs;
    Py_ssize_t n_jobs;
    const struct key *keys;
    const uint64_t *s_base, *d_base;
    const int64_t *starts;
    uint64_t *src, *dst, *len;
};

/* Every job's blocks into place (no Python object touched: may run without the GIL). */
static void assemble(const struct fill *f) {
    for (Py_ssize_t j = 0; j < f->n_jobs; j++) {
        const int64_t *job = f->jobs + j * JOB_FIELDS;
        const struct key *k = &f->keys[job[J_KEY]];
        const int64_t *s = k->src.buf, *d = k->dst.buf;
        uint64_t sb = f->s_base[j], db = f->d_base[j];
        Py_ssize_t at = f->starts[j];
        if (job[J_WINDOWED]) { /* a head window of every page: one block each */
            uint64_t si = (uint64_t)job[J_SRC_LEN], di = (uint64_t)job[J_DST_LEN];
            uint64_t so = (uint64_t)job[J_SRC_OFF], dof = (uint64_t)job[J_DST_OFF];
            uint64_t w = (uint64_t)job[J_WIDTH];
            for (Py_ssize_t i = 0; i < k->n; i++, at++) {
                f->src[at] = sb + (uint64_t)s[i] * si + so;
                f->dst[at] = db + (uint64_t)d[i] * di + dof;
                f->len[at] = w;
            }
        } else { /* whole items: a block per run (the item length is the same both sides) */
            uint64_t item = (uint64_t)job[J_SRC_LEN];
            for (Py_ssize_t r = 0; r < k->runs; r++, at++) {
                int64_t first = k->run_at[r];
                f->src[at] = sb + (uint64_t)s[first] * item;
                f->dst[at] = db + (uint64_t)d[first] * item;
                f->len[at] = (uint64_t)k->run_len[r] * item;
            }
        }
    }
}

static PyObject *plan_blocks(PyObject *self, PyObject *args) {
    PyObject *pairs_obj, *jobs_obj, *src_obj, *dst_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &pairs_obj, &jobs_obj, &src_obj, &dst_obj))
        return NULL;
    PyObject *out = NULL, *pairs = NULL, *src_fast = NULL, *dst_fast = NULL;
    PyObject *blocks = NULL, *meta = NULL;
    struct key *keys = NULL;
    Py_ssize_t n_keys = 0, opened = 0;
    uint64_t *bases = NULL; /* each job's source base address, then its destination's */
    Py_buffer jobs_view = {0};
    int have_jobs = 0;

    pairs = PySequence_Fast(pairs_obj, "plan: pairs must be a sequence");
    src_fast = PySequence_Fast(src_obj, "plan: src_addrs must be a sequence");
    dst_fast = PySequence_Fast(dst_obj, "plan: dst_addrs must be a sequence");
    if (pairs == NULL || src_fast == NULL || dst_fast == NULL)
        goto done;
    if (PyObject_GetBuffer(jobs_obj, &jobs_view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        goto done;
    have_jobs = 1;
    if (!is_int64(&jobs_view) || jobs_view.len % (JOB_FIELDS * 8) != 0) {
        PyErr_SetString(PyExc_ValueError, "plan: jobs must be int64, JOB_FIELDS per job");
        goto done;
    }
    Py_ssize_t n_jobs = jobs_view.len / (JOB_FIELDS * 8);
    const int64_t *jobs = jobs_view.buf;
    n_keys = PySequence_Fast_GET_SIZE(pairs);
    keys = PyMem_Calloc(n_keys ? (size_t)n_keys : 1, sizeof(struct key));
    bases = PyMem_Malloc(2 * (n_jobs ? (size_t)n_jobs : 1) * sizeof(uint64_t));
    if (keys == NULL || bases == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; opened < n_keys; opened++)
        if (key_open(PySequence_Fast_GET_ITEM(pairs, opened), opened, &keys[opened]) < 0)
            goto done;
    /* Range checks and block counts, every job before any address is computed. */
    Py_ssize_t total = 0;
    for (Py_ssize_t j = 0; j < n_jobs; j++) {
        const int64_t *job = jobs + j * JOB_FIELDS;
        if (job[J_KEY] < 0 || job[J_KEY] >= n_keys) {
            PyErr_Format(PyExc_ValueError, "plan: job %zd names key %lld of %zd", j,
                         (long long)job[J_KEY], n_keys);
            goto done;
        }
        const struct key *k = &keys[job[J_KEY]];
        if (k->s_lo < 0 || k->s_hi >= job[J_SRC_ITEMS] || k->d_lo < 0 ||
            k->d_hi >= job[J_DST_ITEMS]) {
            out = Py_NewRef(Py_None); /* the caller names the first bad buffer */
            goto done;
        }
        if (base_of(src_fast, job[J_FLAT], "source", &bases[j]) < 0 ||
            base_of(dst_fast, job[J_FLAT], "destination", &bases[n_jobs + j]) < 0)
            goto done;
        total += job[J_WINDOWED] ? k->n : k->runs;
    }
    blocks = PyByteArray_FromStringAndSize(NULL, 3 * total * (Py_ssize_t)sizeof(uint64_t));
    meta = PyByteArray_FromStringAndSize(NULL, (2 * n_jobs + 1) * (Py_ssize_t)sizeof(int64_t));
    if (blocks == NULL || meta == NULL)
        goto done;
    int64_t *starts = (int64_t *)PyByteArray_AS_STRING(meta);
    int64_t *items = starts + n_jobs + 1;
    starts[0] = 0;
    for (Py_ssize_t j = 0; j < n_jobs; j++) {
        const struct key *k = &keys[jobs[j * JOB_FIELDS + J_KEY]];
        starts[j + 1] = starts[j] + (jobs[j * JOB_FIELDS + J_WINDOWED] ? k->n : k->runs);
        items[j] = k->n;
    }
    uint64_t *all = (uint64_t *)PyByteArray_AS_STRING(blocks);
    struct fill f = {jobs, n_jobs, keys, bases, bases + n_jobs, starts,
                     all, all + total, all + 2 * total};
    if (total >= RELEASE_GIL_BLOCKS) {
        Py_BEGIN_ALLOW_THREADS
        assemble(&f);
        Py_END_ALLOW_THREADS
    } else {
        assemble(&f);
    }
    out = PyTuple_Pack(2, blocks, meta);

done:
    for (Py_ssize_t i = 0; i < opened; i++)
        key_close(&keys[i]);
    PyMem_Free(keys);
    PyMem_Free(bases);
    if (have_jobs)
        PyBuffer_Release(&jobs_view);
    Py_XDECREF(blocks);
    Py_XDECREF(meta);
    Py_XDECREF(pairs);
    Py_XDECREF(src_fast);
    Py_XDECREF(dst_fast);
    return out;
}

static PyMethodDef methods[] = {
    {"plan_blocks", plan_blocks, METH_VARARGS,
     "plan_blocks(pairs, jobs, src_addrs, dst_addrs) -> (blocks, meta) | None: a request's "
     "blocks (see pools/_plan.c); None when an index is outside its buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_plan",
    "A request's transfer plan in one call (see pools/_plan.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__plan(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "JOB_FIELDS", JOB_FIELDS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
