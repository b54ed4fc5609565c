/*
 * kvbeam.pools._owners: which live reservation owns each destination item of decode's
 * pools, entered and freed in one call per reservation.
 *
 * Why: server/core/decode_pages.py's PageBook checked and entered a reservation's lists
 * with a handful of numpy calls per list (some 25 for a small request of a DSV4 layout,
 * its target and draft lists), then freed them the same way: about 1 us each in a loop,
 * 5-7 us each in a daemon whose caches the host's other processes emptied between two
 * requests (docs/performance.md, "What limits the missed targets").
 *
 * claim(owners, lists, handle) -> (code, a, b)
 *   owners: a sequence of writable C-contiguous int64 buffers, one per (pool, kind): 0 a
 *   free item, else the handle of the reservation holding it; lists: the reservation's
 *   index lists, one int64 buffer per owner buffer, every index checked non-negative
 *   already (kvbeam.pools.engine_indices.validate); handle: non-zero.
 *   (0, 0, 0): every item was free and is now the handle's. (1, k, n): owners[k] is too
 *   short for list k: grow it to at least n items and call again. (2, k, p): item
 *   lists[k][p] is held by another live reservation (the first such, list by list). In
 *   both refusals nothing was entered.
 *
 * release(owners, lists, handle)
 *   Frees each listed item the handle holds (items it does not hold are left alone).
 *
 * A malformed argument (not int64, read-only owners, a negative index, a zero handle,
 * sequences of different lengths) is a ValueError: the decode core built them, so that
 * is a bug, not an engine's input. Optional, like the other helpers: without it the
 * numpy path runs (tests/unit/test_decode_pages.py runs both).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_int64_buffer.h"

#include <stdint.h>
#include <string.h>

struct pinned {
    Py_buffer *owners, *lists;
    Py_ssize_t n, opened_owners, opened_lists;
};

static void unpin(struct pinned *p) {
    for (Py_ssize_t i = 0; i < p->opened_owners; i++)
        PyBuffer_Release(&p->owners[i]);
    for (Py_ssize_t i = 0; i < p->opened_lists; i++)
        PyBuffer_Release(&p->lists[i]);
    PyMem_Free(p->owners);
    PyMem_Free(p->lists);
    memset(p, 0, sizeof(*p));
}

/* Pin every owner buffer (writable) and list; 0, or -1 with an exception set (nothing
 * left pinned). */
static int pin(PyObject *owners_obj, PyObject *lists_obj, struct pinned *p) {
    memset(p, 0, sizeof(*p));
    PyObject *owners = PySequence_Fast(owners_obj, "owners must be a sequence");
    if (owners == NULL)
        return -1;
    PyObject *lists = PySequence_Fast(lists_obj, "lists must be a sequence");
    if (lists == NULL) {
        Py_DECREF(owners);
        return -1;
    }
    int rc = -1;
    p->n = PySequence_Fast_GET_SIZE(owners);
    if (PySequence_Fast_GET_SIZE(lists) != p->n) {
        PyErr_Format(PyExc_ValueError, "owners: %zd owner buffers for %zd lists", p->n,
                     PySequence_Fast_GET_SIZE(lists));
        goto done;
    }
    p->owners = PyMem_Calloc(p->n ? (size_t)p->n : 1, sizeof(Py_buffer));
    p->lists = PyMem_Calloc(p->n ? (size_t)p->n : 1, sizeof(Py_buffer));
    if (p->owners == NULL || p->lists == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < p->n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(owners, i), &p->owners[i],
                               PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
            goto done;
        p->opened_owners++;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(lists, i), &p->lists[i],
                               PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            goto done;
        p->opened_lists++;
        if (!is_int64(&p->owners[i]) || !is_int64(&p->lists[i])) {
            PyErr_Format(PyExc_ValueError, "owners: buffer pair %zd is not int64", i);
            goto done;
        }
        const int64_t *v = p->lists[i].buf;
        for (Py_ssize_t j = 0; j < p->lists[i].len / 8; j++)
            if (v[j] < 0) {
                PyErr_Format(PyExc_ValueError, "owners: list %zd holds a negative index at "
                             "position %zd (lists are validated first)", i, j);
                goto done;
            }
    }
    rc = 0;
done:
    if (rc < 0)
        unpin(p);
    Py_DECREF(owners);
    Py_DECREF(lists);
    return rc;
}

/* Both calls' arguments: (owners, lists, handle), pinned; 0, or -1 with an exception set. */
static int arguments(PyObject *args, struct pinned *p, long long *handle) {
    PyObject *owners_obj, *lists_obj;
    if (!PyArg_ParseTuple(args, "OOL", &owners_obj, &lists_obj, handle))
        return -1;
    if (*handle == 0) {
        PyErr_SetString(PyExc_ValueError, "owners: the handle 0 means a free item");
        return -1;
    }
    return pin(owners_obj, lists_obj, p);
}

static PyObject *claim(PyObject *self, PyObject *args) {
    struct pinned p;
    long long handle;
    if (arguments(args, &p, &handle) < 0)
        return NULL;
    PyObject *out = NULL;
    /* Every list checked before anything is entered. */
    for (Py_ssize_t k = 0; k < p.n && out == NULL; k++) {
        const int64_t *own = p.owners[k].buf, *v = p.lists[k].buf;
        Py_ssize_t items = p.owners[k].len / 8, count = p.lists[k].len / 8;
        int64_t top = -1;
        for (Py_ssize_t j = 0; j < count; j++) {
            if (v[j] > top)
                top = v[j];
            if (v[j] < items && own[v[j]] != 0) {
                out = Py_BuildValue("inn", 2, k, j);
                break;
            }
        }
        if (out == NULL && top >= items)
            out = Py_BuildValue("inL", 1, k, (long long)top + 1);
    }
    if (out == NULL) {
        for (Py_ssize_t k = 0; k < p.n; k++) {
            int64_t *own = p.owners[k].buf;
            const int64_t *v = p.lists[k].buf;
            for (Py_ssize_t j = 0; j < p.lists[k].len / 8; j++)
                own[v[j]] = handle;
        }
        out = Py_BuildValue("iii", 0, 0, 0);
    }
    unpin(&p);
    return out;
}

static PyObject *release(PyObject *self, PyObject *args) {
    struct pinned p;
    long long handle;
    if (arguments(args, &p, &handle) < 0)
        return NULL;
    for (Py_ssize_t k = 0; k < p.n; k++) {
        int64_t *own = p.owners[k].buf;
        const int64_t *v = p.lists[k].buf;
        Py_ssize_t items = p.owners[k].len / 8;
        for (Py_ssize_t j = 0; j < p.lists[k].len / 8; j++)
            if (v[j] < items && own[v[j]] == handle)
                own[v[j]] = 0;
    }
    unpin(&p);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"claim", claim, METH_VARARGS,
     "claim(owners, lists, handle) -> (code, a, b): enter a reservation's items, or say "
     "which owner buffer must grow or which item another holds (see pools/_owners.c)."},
    {"release", release, METH_VARARGS,
     "release(owners, lists, handle): free the listed items the handle holds."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_owners",
    "Decode's item owners, claimed and freed in one call (see pools/_owners.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__owners(void) { return PyModule_Create(&module); }
