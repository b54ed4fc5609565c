/*
 * kvbeam.transport._blocks: a write's blocks checked, sliced and laid out for the wire in
 * one call each, without numpy.
 *
 * Why: a small request's write went through some 25 numpy calls to be checked against
 * both sides' registered regions and sliced (kvbeam.transport.core.prepare), 15 more to
 * become the TCP stream's frames and iovecs (kvbeam.transport.tcp.wire.transfer_stream),
 * and a dozen on the receiver to check a WRITEV frame's descriptors. Each numpy call costs
 * about 1 us in a loop but 5-7 us in a daemon, whose caches the other processes of the
 * host have emptied between two requests (docs/performance.md, "What limits the missed
 * targets"); these loops are a few hundred instructions.
 *
 * prepare(src, dst, lengths, slice_bytes, local, remote)
 *   src, dst, lengths: C-contiguous uint64 buffers of one length (a write's blocks);
 *   local, remote: (starts, ends, keys) of a region table: uint64 starts in ascending
 *   order, uint64 ends, uint32 keys (kvbeam.transport.regions.RegionTable.arrays).
 *   Returns (blocks, keys): bytearrays of 3 * m uint64 (every slice's source address,
 *   then destination addresses, then lengths) and of 2 * m uint32 (local keys, then
 *   remote keys): every block cut into slices of at most slice_bytes, zero-length blocks
 *   dropped, exactly what the Python path gives. None when a block (zero-length ones
 *   included) is not inside one region of its side: the Python path then raises the
 *   RegionError that names it. Nothing is computed from an address before every block
 *   passed both checks, so nothing wraps.
 *
 * stream(transfer_id, notify, src, dst, lengths, max_vec)
 *   The prepared blocks as the TCP transport's outgoing stream: WRITEV frames of at most
 *   max_vec blocks (a 24-byte header, then each block's destination and length as
 *   little-endian uint64), each followed by its blocks' payloads read in place, then the
 *   END frame. Returns (iov, heads, total): the struct iovec array (bytearray of 16-byte
 *   rows: base address, length), the frame headers it points into (keep it alive, and do
 *   not resize it, while the iovecs are in use) and the stream's bytes.
 *
 * check_descs(descs, starts, ends)
 *   A received WRITEV frame's descriptors (a buffer of count little-endian uint64 pairs:
 *   destination address, length) against the receiver's writable regions. Returns
 *   (ok, ok_bytes, rest_bytes): how many leading blocks lie inside one region each (the
 *   first that does not, and every later one, are refused), their bytes, and the bytes
 *   of the refused ones (read and dropped to stay in step). On a little-endian host the
 *   descriptors are the iovecs that land the payloads (rows 0 .. ok - 1).
 *
 * A malformed argument (a buffer of the wrong type or length, slice_bytes or max_vec not
 * positive) is a ValueError: the transport built it, so that is a bug, not a peer's input.
 * Optional, like the other helpers: without it the numpy paths run (the same results:
 * tests/unit/test_blocks_helper.py compares them).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvbeam's wire formats are little-endian and so must the host be"
#endif

/* The TCP wire format (kvbeam/transport/tcp/wire.py; wire.py checks these against its own). */
#define HEADER_BYTES 24 /* struct "<BBHIQQ": kind, flags, reserved, transfer_id, addr, length */
#define KIND_END 3
#define KIND_WRITEV 6
#define FLAG_NOTIFY 1

/* A pinned buffer of `itemsize`-byte unsigned integers (numpy's uint64 exports "L" or "Q",
 * uint32 "I"), or -1 with ValueError set. */
static int get_uint(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *fmt = view->format;
    if (fmt != NULL && (*fmt == '@' || *fmt == '=' || *fmt == '<'))
        fmt++;
    int ok = fmt != NULL && view->itemsize == itemsize && fmt[1] == '\0' &&
             (itemsize == 8 ? (fmt[0] == 'L' || fmt[0] == 'Q' || fmt[0] == 'l' || fmt[0] == 'q')
                            : (fmt[0] == 'I' || fmt[0] == 'i'));
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s: a buffer of %zd-byte unsigned integers is needed "
                     "(got format %s, item size %zd)", what, itemsize,
                     view->format ? view->format : "B", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* A region table's arrays, pinned. */
struct table {
    Py_buffer starts, ends, keys;
    Py_ssize_t n;
    int pinned; /* how many of the three are */
};

static void table_close(struct table *t) {
    if (t->pinned > 0) PyBuffer_Release(&t->starts);
    if (t->pinned > 1) PyBuffer_Release(&t->ends);
    if (t->pinned > 2) PyBuffer_Release(&t->keys);
    t->pinned = 0;
}

/* Pin (starts, ends[, keys]) from a tuple; 0, or -1 with an exception set. */
static int table_open(PyObject *tuple, struct table *t, int with_keys, const char *side) {
    PyObject *starts, *ends, *keys = NULL;
    memset(t, 0, sizeof(*t));
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != (with_keys ? 3 : 2)) {
        PyErr_Format(PyExc_ValueError, "%s regions: a tuple of (starts, ends%s) is needed",
                     side, with_keys ? ", keys" : "");
        return -1;
    }
    starts = PyTuple_GET_ITEM(tuple, 0);
    ends = PyTuple_GET_ITEM(tuple, 1);
    if (with_keys)
        keys = PyTuple_GET_ITEM(tuple, 2);
    if (get_uint(starts, &t->starts, 8, side) < 0)
        return -1;
    t->pinned = 1;
    if (get_uint(ends, &t->ends, 8, side) < 0) {
        table_close(t);
        return -1;
    }
    t->pinned = 2;
    t->n = t->starts.len / 8;
    if (t->ends.len / 8 != t->n) {
        PyErr_Format(PyExc_ValueError, "%s regions: %zd starts but %zd ends", side, t->n,
                     t->ends.len / 8);
        table_close(t);
        return -1;
    }
    if (with_keys) {
        if (get_uint(keys, &t->keys, 4, side) < 0) {
            table_close(t);
            return -1;
        }
        t->pinned = 3;
        if (t->keys.len / 4 != t->n) {
            PyErr_Format(PyExc_ValueError, "%s regions: %zd starts but %zd keys", side, t->n,
                         t->keys.len / 4);
            table_close(t);
            return -1;
        }
    }
    return 0;
}

/* The region holding [addr, addr + len), or -1: the last region starting at or below
 * addr, if addr + len does not pass its end (no addition: nothing wraps). */
static Py_ssize_t region_of(const struct table *t, uint64_t addr, uint64_t len) {
    const uint64_t *starts = t->starts.buf, *ends = t->ends.buf;
    Py_ssize_t lo = 0, hi = t->n; /* first start above addr, by bisection */
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (starts[mid] <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    Py_ssize_t i = lo - 1;
    if (i < 0 || addr > ends[i] || len > ends[i] - addr)
        return -1;
    return i;
}

/* A write's blocks: its three arrays, pinned. */
struct blocks {
    Py_buffer src, dst, len;
    Py_ssize_t n;
    int pinned; /* how many of the three are */
};

static void blocks_close(struct blocks *b) {
    if (b->pinned > 0) PyBuffer_Release(&b->src);
    if (b->pinned > 1) PyBuffer_Release(&b->dst);
    if (b->pinned > 2) PyBuffer_Release(&b->len);
    b->pinned = 0;
}

/* Pin (src, dst, lengths), uint64 and of one length; 0, or -1 with an exception set
 * (nothing left pinned). `what` names the caller in errors. */
static int blocks_open(PyObject *src, PyObject *dst, PyObject *len, struct blocks *b,
                       const char *what) {
    memset(b, 0, sizeof(*b));
    PyObject *objs[3] = {src, dst, len};
    Py_buffer *views[3] = {&b->src, &b->dst, &b->len};
    for (int i = 0; i < 3; i++) {
        if (get_uint(objs[i], views[i], 8, what) < 0) {
            blocks_close(b);
            return -1;
        }
        b->pinned = i + 1;
    }
    b->n = b->src.len / 8;
    if (b->dst.len / 8 != b->n || b->len.len / 8 != b->n) {
        PyErr_Format(PyExc_ValueError, "%s: src, dst and lengths differ in length (%zd, %zd, "
                     "%zd)", what, b->n, b->dst.len / 8, b->len.len / 8);
        blocks_close(b);
        return -1;
    }
    return 0;
}

static PyObject *prepare(PyObject *self, PyObject *args) {
    PyObject *src_obj, *dst_obj, *len_obj, *local_obj, *remote_obj;
    long long slice_arg;
    if (!PyArg_ParseTuple(args, "OOOLOO", &src_obj, &dst_obj, &len_obj, &slice_arg, &local_obj,
                          &remote_obj))
        return NULL;
    if (slice_arg <= 0)
        return PyErr_Format(PyExc_ValueError, "prepare: slice_bytes must be positive, got %lld",
                            slice_arg);
    uint64_t slice = (uint64_t)slice_arg;
    struct blocks in = {0};
    struct table local = {0}, remote = {0};
    PyObject *out = NULL, *blocks = NULL, *keys = NULL;
    uint32_t *found = NULL; /* each block's local key, then its remote key */

    if (blocks_open(src_obj, dst_obj, len_obj, &in, "prepare") < 0 ||
        table_open(local_obj, &local, 1, "prepare: local") < 0 ||
        table_open(remote_obj, &remote, 1, "prepare: remote") < 0)
        goto done;
    Py_ssize_t n = in.n;
    const uint64_t *s = in.src.buf, *d = in.dst.buf, *l = in.len.buf;
    found = PyMem_Malloc(2 * (n ? (size_t)n : 1) * sizeof(uint32_t));
    if (found == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* Every block's checks first, and the slices they make. */
    const uint32_t *lkeys = local.keys.buf, *rkeys = remote.keys.buf;
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t a = region_of(&local, s[i], l[i]), b = region_of(&remote, d[i], l[i]);
        if (a < 0 || b < 0) {
            out = Py_NewRef(Py_None); /* the Python path names the first bad block */
            goto done;
        }
        found[i] = lkeys[a];
        found[n + i] = rkeys[b];
        m += (Py_ssize_t)(l[i] / slice + (l[i] % slice != 0));
    }
    blocks = PyByteArray_FromStringAndSize(NULL, 3 * m * (Py_ssize_t)sizeof(uint64_t));
    keys = PyByteArray_FromStringAndSize(NULL, 2 * m * (Py_ssize_t)sizeof(uint32_t));
    if (blocks == NULL || keys == NULL)
        goto done;
    uint64_t *os = (uint64_t *)PyByteArray_AS_STRING(blocks), *od = os + m, *ol = od + m;
    uint32_t *olk = (uint32_t *)PyByteArray_AS_STRING(keys), *ork = olk + m;
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        for (uint64_t off = 0; off < l[i]; off += slice, at++) {
            uint64_t left = l[i] - off;
            os[at] = s[i] + off;
            od[at] = d[i] + off;
            ol[at] = left < slice ? left : slice;
            olk[at] = found[i];
            ork[at] = found[n + i];
        }
    }
    out = PyTuple_Pack(2, blocks, keys);

done:
    PyMem_Free(found);
    table_close(&local);
    table_close(&remote);
    blocks_close(&in);
    Py_XDECREF(blocks);
    Py_XDECREF(keys);
    return out;
}

static void put_header(unsigned char *at, unsigned kind, unsigned flags, uint32_t transfer_id,
                       uint64_t addr, uint64_t length) {
    uint16_t reserved = 0;
    at[0] = (unsigned char)kind;
    at[1] = (unsigned char)flags;
    memcpy(at + 2, &reserved, 2);
    memcpy(at + 4, &transfer_id, 4);
    memcpy(at + 8, &addr, 8);
    memcpy(at + 16, &length, 8);
}

static PyObject *stream(PyObject *self, PyObject *args) {
    unsigned long transfer_id;
    int notify;
    PyObject *src_obj, *dst_obj, *len_obj;
    Py_ssize_t max_vec;
    if (!PyArg_ParseTuple(args, "kpOOOn", &transfer_id, &notify, &src_obj, &dst_obj, &len_obj,
                          &max_vec))
        return NULL;
    if (max_vec <= 0)
        return PyErr_Format(PyExc_ValueError, "stream: max_vec must be positive, got %zd",
                            max_vec);
    if (transfer_id > 0xFFFFFFFFul)
        return PyErr_Format(PyExc_ValueError, "stream: transfer id %lu does not fit in 32 bits",
                            transfer_id);
    struct blocks in = {0};
    PyObject *out = NULL, *iov = NULL, *heads = NULL, *total_obj = NULL;
    if (blocks_open(src_obj, dst_obj, len_obj, &in, "stream") < 0)
        goto done;
    Py_ssize_t n = in.n;
    Py_ssize_t frames = (n + max_vec - 1) / max_vec;
    heads = PyByteArray_FromStringAndSize(NULL, HEADER_BYTES * (frames + 1) + 16 * n);
    iov = PyByteArray_FromStringAndSize(NULL, 16 * (n + frames + 1));
    if (heads == NULL || iov == NULL)
        goto done;
    const uint64_t *s = in.src.buf, *d = in.dst.buf, *l = in.len.buf;
    unsigned char *h = (unsigned char *)PyByteArray_AS_STRING(heads);
    uint64_t *row = (uint64_t *)PyByteArray_AS_STRING(iov);
    uint64_t total = 0;
    Py_ssize_t at = 0; /* a byte offset in heads */
    for (Py_ssize_t lo = 0; lo < n; lo += max_vec) {
        Py_ssize_t k = n - lo < max_vec ? n - lo : max_vec;
        unsigned char *frame = h + at;
        put_header(frame, KIND_WRITEV, 0, 0, 0, (uint64_t)k);
        for (Py_ssize_t i = 0; i < k; i++) {
            memcpy(frame + HEADER_BYTES + 16 * i, &d[lo + i], 8);
            memcpy(frame + HEADER_BYTES + 16 * i + 8, &l[lo + i], 8);
        }
        *row++ = (uint64_t)(uintptr_t)frame;
        *row++ = (uint64_t)(HEADER_BYTES + 16 * k);
        total += (uint64_t)(HEADER_BYTES + 16 * k);
        for (Py_ssize_t i = 0; i < k; i++) {
            *row++ = s[lo + i];
            *row++ = l[lo + i];
            total += l[lo + i];
        }
        at += HEADER_BYTES + 16 * k;
    }
    put_header(h + at, KIND_END, notify ? FLAG_NOTIFY : 0, (uint32_t)transfer_id, 0, 0);
    *row++ = (uint64_t)(uintptr_t)(h + at);
    *row++ = HEADER_BYTES;
    total += HEADER_BYTES;
    total_obj = PyLong_FromUnsignedLongLong(total);
    if (total_obj != NULL)
        out = PyTuple_Pack(3, iov, heads, total_obj);

done:
    blocks_close(&in);
    Py_XDECREF(iov);
    Py_XDECREF(heads);
    Py_XDECREF(total_obj);
    return out;
}

static PyObject *check_descs(PyObject *self, PyObject *args) {
    PyObject *descs_obj, *starts_obj, *ends_obj;
    if (!PyArg_ParseTuple(args, "OOO", &descs_obj, &starts_obj, &ends_obj))
        return NULL;
    Py_buffer descs = {0};
    if (PyObject_GetBuffer(descs_obj, &descs, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = NULL;
    struct table t = {0};
    PyObject *pair = PyTuple_Pack(2, starts_obj, ends_obj);
    if (pair == NULL || table_open(pair, &t, 0, "check_descs: writable") < 0)
        goto done;
    if (descs.len % 16 != 0) {
        PyErr_Format(PyExc_ValueError, "check_descs: %zd bytes are not whole descriptors",
                     descs.len);
        goto done;
    }
    Py_ssize_t n = descs.len / 16, ok = n;
    const unsigned char *raw = descs.buf;
    uint64_t ok_bytes = 0, rest_bytes = 0; /* wrap like the numpy sums they replace */
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t addr, length;
        memcpy(&addr, raw + 16 * i, 8);
        memcpy(&length, raw + 16 * i + 8, 8);
        if (ok == n && region_of(&t, addr, length) < 0)
            ok = i;
        if (ok == n)
            ok_bytes += length;
        else
            rest_bytes += length;
    }
    out = Py_BuildValue("nKK", ok, (unsigned long long)ok_bytes, (unsigned long long)rest_bytes);

done:
    table_close(&t);
    Py_XDECREF(pair);
    PyBuffer_Release(&descs);
    return out;
}

static PyMethodDef methods[] = {
    {"prepare", prepare, METH_VARARGS,
     "prepare(src, dst, lengths, slice_bytes, local, remote) -> (blocks, keys) | None: a "
     "write's blocks checked against both sides' regions and sliced (transport/_blocks.c)."},
    {"stream", stream, METH_VARARGS,
     "stream(transfer_id, notify, src, dst, lengths, max_vec) -> (iov, heads, total): the "
     "TCP transport's outgoing stream of a write (transport/_blocks.c)."},
    {"check_descs", check_descs, METH_VARARGS,
     "check_descs(descs, starts, ends) -> (ok, ok_bytes, rest_bytes): a received WRITEV "
     "frame's descriptors against the writable regions (transport/_blocks.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_blocks",
    "A write's blocks checked, sliced and laid out for the wire (see transport/_blocks.c).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__blocks(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "HEADER_BYTES", HEADER_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "KIND_END", KIND_END) < 0 ||
        PyModule_AddIntConstant(m, "KIND_WRITEV", KIND_WRITEV) < 0 ||
        PyModule_AddIntConstant(m, "FLAG_NOTIFY", FLAG_NOTIFY) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
