/*
 * kvbeam.proto._frames: index lists packed and unpacked in one call: the engine channel's,
 * and the daemons' packed lists (protocol 7).
 *
 * Why: a RESERVE or SEND frame carries a request's index lists (kvbeam.proto.engine_frames:
 * "u8 count | per list: u8 pool | u8 kind | u32 n | n u32", little-endian throughout).
 * Packing each list took some eight numpy calls on the engine and unpacking it two on
 * the daemon: about 1 us each in a loop, 5-7 us each in a process whose caches the
 * host's other processes emptied between two requests, on the path from an engine's
 * SEND to its daemon (docs/performance.md, "What limits the missed targets").
 *
 * pack_lists(items) -> bytes | None
 *   items: a sequence of (pool, kind, values): pool 0 (target) or 1 (draft), kind the
 *   IndexKind's number, values a C-contiguous buffer of 8-byte signed integers (numpy
 *   int64) or a list or tuple of Python ints. Returns the lists' bytes, count included;
 *   None when a value is outside 0 .. 2**32 - 1, an argument is of another kind, or
 *   there are more than 255 lists: the Python path then runs and names what is wrong.
 *
 * unpack_lists(body, at, max_lists, max_indices, kinds) -> (meta, data, end) | None
 *   body: the frame's bytes; at: where its lists start. Returns meta, a list of (pool,
 *   kind, start, count) per list in frame order; data, a bytearray of every list's
 *   indices as native int64, list after list (start and count index it); end, the
 *   offset after the lists. None when the lists are malformed (the frame ends early, a
 *   pool other than 0 or 1, a kind not below `kinds`, more than max_lists lists or
 *   max_indices indices in one, a (pool, kind) twice): the Python path then raises the
 *   FrameError that names the field.
 *
 * unpack_int64(buffers) -> (data, counts, negative)
 *   The daemons' packed index lists (kvbeam.proto.transfer_codec: IndexList.packed, each
 *   a buffer of little-endian int64s) joined into one bytearray of int64s, each list's
 *   count, and the first list holding a negative index (-1: none). A buffer that is not
 *   whole int64s is a ValueError (the codec checks that first).
 *
 * Optional, like the other helpers: without it numpy packs and unpacks (the same bytes
 * and lists: tests/unit/test_engine_frames_helper.py compares them).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the engine channel's indices are little-endian and so must the host be"
#endif

#define LIST_HEAD 6 /* u8 pool, u8 kind, u32 n */

/* The host is little-endian (checked above), as every field of the frame is. */
static void put_le32(unsigned char *at, uint32_t v) { memcpy(at, &v, sizeof v); }

static uint32_t get_le32(const unsigned char *at) {
    uint32_t v;
    memcpy(&v, at, sizeof v);
    return v;
}

/* One list's values as 0 .. 2**32 - 1 into `out` (NULL: only count them). The count, or
 * -1 for "not this helper's" (no exception set), or -2 with an exception set. */
static Py_ssize_t list_values(PyObject *values, uint32_t *out) {
    if (PyList_Check(values) || PyTuple_Check(values)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(values);
        if (out == NULL)
            return n;
        PyObject **items = PySequence_Fast_ITEMS(values);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (!PyLong_Check(items[i]))
                return -1;
            int overflow = 0;
            long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
            if (v == -1 && PyErr_Occurred())
                return -2;
            if (overflow || v < 0 || v > 0xFFFFFFFFLL)
                return -1;
            out[i] = (uint32_t)v;
        }
        return n;
    }
    if (!PyObject_CheckBuffer(values))
        return -1;
    Py_buffer view;
    if (PyObject_GetBuffer(values, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear(); /* a strided array: the numpy path reads it */
        return -1;
    }
    const char *fmt = view.format;
    if (fmt != NULL && (*fmt == '@' || *fmt == '=' || *fmt == '<'))
        fmt++;
    Py_ssize_t n = -1;
    if (fmt != NULL && view.itemsize == 8 && (fmt[0] == 'l' || fmt[0] == 'q') && fmt[1] == '\0') {
        n = view.len / 8;
        if (out != NULL) {
            const int64_t *v = view.buf;
            for (Py_ssize_t i = 0; i < n; i++) {
                if (v[i] < 0 || v[i] > 0xFFFFFFFFLL) {
                    n = -1;
                    break;
                }
                out[i] = (uint32_t)v[i];
            }
        }
    }
    PyBuffer_Release(&view);
    return n;
}

static PyObject *pack_lists(PyObject *self, PyObject *arg) {
    PyObject *items = PySequence_Fast(arg, "pack_lists: a sequence of (pool, kind, values)");
    if (items == NULL)
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(items);
    if (count > 255) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    /* First the sizes, then one bytes object written in place. */
    Py_ssize_t total = 1;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(items, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
            PyErr_Format(PyExc_ValueError, "pack_lists: item %zd is not (pool, kind, values)", i);
            goto done;
        }
        Py_ssize_t n = list_values(PyTuple_GET_ITEM(item, 2), NULL);
        if (n == -2)
            goto done;
        if (n < 0 || n > 0xFFFFFFFFLL) {
            out = Py_NewRef(Py_None);
            goto done;
        }
        total += LIST_HEAD + 4 * n;
    }
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, total);
    if (bytes == NULL)
        goto done;
    unsigned char *at = (unsigned char *)PyBytes_AS_STRING(bytes);
    *at++ = (unsigned char)count;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(items, i);
        long pool = PyLong_AsLong(PyTuple_GET_ITEM(item, 0));
        long kind = PyLong_AsLong(PyTuple_GET_ITEM(item, 1));
        if ((pool == -1 || kind == -1) && PyErr_Occurred()) {
            Py_DECREF(bytes);
            goto done;
        }
        if (pool < 0 || pool > 255 || kind < 0 || kind > 255) {
            Py_DECREF(bytes);
            PyErr_Format(PyExc_ValueError, "pack_lists: item %zd: pool %ld, kind %ld do not "
                         "fit a byte", i, pool, kind);
            goto done;
        }
        Py_ssize_t n = list_values(PyTuple_GET_ITEM(item, 2), (uint32_t *)(at + LIST_HEAD));
        if (n < 0) {
            Py_DECREF(bytes);
            if (n == -1)
                out = Py_NewRef(Py_None);
            goto done;
        }
        at[0] = (unsigned char)pool;
        at[1] = (unsigned char)kind;
        put_le32(at + 2, (uint32_t)n);
        at += LIST_HEAD + 4 * n;
    }
    out = bytes;
done:
    Py_DECREF(items);
    return out;
}

static PyObject *unpack_lists(PyObject *self, PyObject *args) {
    Py_buffer body;
    Py_ssize_t at, max_lists, max_indices, kinds;
    if (!PyArg_ParseTuple(args, "y*nnnn", &body, &at, &max_lists, &max_indices, &kinds))
        return NULL;
    PyObject *out = NULL, *meta = NULL, *data = NULL;
    const unsigned char *raw = body.buf;
    Py_ssize_t len = body.len;
    if (at < 0 || at >= len || kinds <= 0 || kinds > 64) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    Py_ssize_t count = raw[at++];
    if (count > max_lists) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    /* A pass to check the lists and size the data, then one to copy. */
    uint64_t seen[2] = {0, 0}; /* (pool, kind) pairs met */
    Py_ssize_t total = 0, pos = at;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (len - pos < LIST_HEAD) {
            out = Py_NewRef(Py_None);
            goto done;
        }
        unsigned pool = raw[pos], kind = raw[pos + 1];
        uint32_t n = get_le32(raw + pos + 2);
        if (pool > 1 || kind >= (unsigned)kinds || n > (uint64_t)max_indices ||
            (seen[pool] >> kind) & 1u || (uint64_t)(len - pos - LIST_HEAD) < 4 * (uint64_t)n) {
            out = Py_NewRef(Py_None);
            goto done;
        }
        seen[pool] |= (uint64_t)1 << kind;
        total += n;
        pos += LIST_HEAD + 4 * (Py_ssize_t)n;
    }
    meta = PyList_New(count);
    data = PyByteArray_FromStringAndSize(NULL, 8 * total);
    if (meta == NULL || data == NULL)
        goto done;
    int64_t *dst = (int64_t *)PyByteArray_AS_STRING(data);
    Py_ssize_t start = 0;
    pos = at;
    for (Py_ssize_t i = 0; i < count; i++) {
        unsigned pool = raw[pos], kind = raw[pos + 1];
        uint32_t n = get_le32(raw + pos + 2);
        const unsigned char *v = raw + pos + LIST_HEAD;
        for (uint32_t j = 0; j < n; j++) {
            uint32_t x;
            memcpy(&x, v + 4 * (size_t)j, 4);
            dst[start + j] = (int64_t)x;
        }
        PyObject *entry = Py_BuildValue("IInI", pool, kind, start, n);
        if (entry == NULL)
            goto done;
        PyList_SET_ITEM(meta, i, entry);
        start += n;
        pos += LIST_HEAD + 4 * (Py_ssize_t)n;
    }
    out = Py_BuildValue("OOn", meta, data, pos);
done:
    Py_XDECREF(meta);
    Py_XDECREF(data);
    PyBuffer_Release(&body);
    return out;
}

static PyObject *unpack_int64(PyObject *self, PyObject *arg) {
    PyObject *items = PySequence_Fast(arg, "unpack_int64: a sequence of buffers");
    if (items == NULL)
        return NULL;
    PyObject *out = NULL, *counts = NULL, *data = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items), total = 0;
    Py_buffer *views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    Py_ssize_t opened = 0;
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; opened < n; opened++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(items, opened), &views[opened],
                               PyBUF_SIMPLE) < 0)
            goto done;
        if (views[opened].len % 8) {
            opened++;
            PyErr_Format(PyExc_ValueError, "unpack_int64: buffer %zd holds %zd bytes, not "
                         "whole int64s", opened - 1, views[opened - 1].len);
            goto done;
        }
        total += views[opened].len / 8;
    }
    counts = PyList_New(n);
    data = PyByteArray_FromStringAndSize(NULL, 8 * total);
    if (counts == NULL || data == NULL)
        goto done;
    char *at = PyByteArray_AS_STRING(data);
    Py_ssize_t negative = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t k = views[i].len / 8;
        memcpy(at, views[i].buf, (size_t)views[i].len); /* little-endian int64s: as they are */
        if (negative < 0) {
            const int64_t *v = (const int64_t *)at;
            for (Py_ssize_t j = 0; j < k; j++)
                if (v[j] < 0) {
                    negative = i;
                    break;
                }
        }
        at += views[i].len;
        PyObject *count = PyLong_FromSsize_t(k);
        if (count == NULL)
            goto done;
        PyList_SET_ITEM(counts, i, count);
    }
    out = Py_BuildValue("OOn", data, counts, negative);
done:
    for (Py_ssize_t i = 0; i < opened; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    Py_XDECREF(counts);
    Py_XDECREF(data);
    Py_DECREF(items);
    return out;
}

static PyMethodDef methods[] = {
    {"pack_lists", pack_lists, METH_O,
     "pack_lists(items) -> bytes | None: index lists as an engine frame carries them "
     "(see proto/_frames.c)."},
    {"unpack_lists", unpack_lists, METH_VARARGS,
     "unpack_lists(body, at, max_lists, max_indices, kinds) -> (meta, data, end) | None: "
     "an engine frame's index lists (see proto/_frames.c)."},
    {"unpack_int64", unpack_int64, METH_O,
     "unpack_int64(buffers) -> (data, counts, negative): packed int64 lists joined into "
     "one int64 bytearray (see proto/_frames.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_frames",
    "The engine channel's index lists packed and unpacked in one call (see proto/_frames.c).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__frames(void) { return PyModule_Create(&module); }
