/*
 * kvbeam.transport.verbs._dmabuf: ibv_reg_dmabuf_mr on the PD of a pyverbs transport.
 *
 * An engine's GPU memory reaches its daemon as a dma-buf fd (memory_kind dmabuf); the daemon
 * registers it with libibverbs' ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access).
 * pyverbs' own DmaBufMR cannot take a raw fd (only its DRM/Habana buffer objects) and fixes
 * iova = offset; kvbeam gives each dma-buf region an iova of its own (an address range the
 * daemon reserved, kvbeam.server.engines.dmabuf), so this module calls the C symbol itself.
 *
 * The PD: pyverbs 44 exposes no pointer to a PD's struct ibv_pd (only its handle). The
 * pointer is the first field of pyverbs.pd.PD as pyverbs/pd.pxd declares it, followed by
 * the pyverbs.device.Context the PD was made on, whose own first field is its struct
 * ibv_context pointer. The structs below mirror rdma-core 44.0's declarations exactly and
 * are read only when the loaded pyverbs is that release's (_pyverbs_layout.h). What pd_of()
 * reads, in order, and only after the step before it passed:
 *   1. the object's type name (pyverbs.pd.PD), then the loaded rdma-core release;
 *   2. the type's tp_basicsize (PYVERBS_44_PD_SIZE): nothing of the object itself yet;
 *   3. its ctx field: compared by its type's name and size (a pyverbs.device.Context);
 *   4. the struct ibv_pd pointer (the first field): NULL is a closed PD;
 *   5. the Context's struct ibv_context pointer (its first field), and through the PD
 *      pointer the verbs PD's context and handle: they must be that context and the PD
 *      object's handle.
 * The same approach as _post.c's qp_ready; nothing is ever written into pyverbs' objects.
 *
 * libibverbs is resolved at run time (dlopen of the library pyverbs loaded, dlsym): the
 * module builds with <infiniband/verbs.h> alone, and a libibverbs older than rdma-core 34
 * (no ibv_reg_dmabuf_mr) gives a clear error instead of an import failure.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <infiniband/verbs.h>

#include "_pyverbs_layout.h"

/* pyverbs.pd.PD and the head of pyverbs.device.Context as pyverbs 44 lays them out
 * (base.pxd: __weakref__, logger; PyverbsCM's vtable pointer; then the class's fields). */
struct pyverbs_cm_head {
    PyObject_HEAD
    PyObject *weakref;
    PyObject *logger;
    void *vtab;
};

struct pyverbs_pd {
    struct pyverbs_cm_head head;
    struct ibv_pd *pd;
    PyObject *ctx;
};

struct pyverbs_context {
    struct pyverbs_cm_head head;
    struct ibv_context *context;
};

/* tp_basicsize of pyverbs 44's PD (its ten object fields after ctx). */
#define PYVERBS_44_PD_SIZE 136

typedef struct ibv_mr *(*reg_dmabuf_mr_fn)(struct ibv_pd *, uint64_t, size_t, uint64_t, int,
                                           int);
typedef int (*dereg_mr_fn)(struct ibv_mr *);

static reg_dmabuf_mr_fn reg_dmabuf_mr_sym;
static dereg_mr_fn dereg_mr_sym;

/* 0 with both symbols resolved; -1 with RuntimeError saying which is missing. */
static int resolve(void) {
    void *lib;
    if (reg_dmabuf_mr_sym != NULL && dereg_mr_sym != NULL)
        return 0;
    lib = dlopen("libibverbs.so.1", RTLD_NOW);
    if (lib == NULL) {
        PyErr_Format(PyExc_RuntimeError, "libibverbs.so.1 cannot be loaded: %s", dlerror());
        return -1;
    }
    reg_dmabuf_mr_sym = (reg_dmabuf_mr_fn)dlsym(lib, "ibv_reg_dmabuf_mr");
    dereg_mr_sym = (dereg_mr_fn)dlsym(lib, "ibv_dereg_mr");
    if (reg_dmabuf_mr_sym == NULL || dereg_mr_sym == NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "this libibverbs has no ibv_reg_dmabuf_mr (rdma-core 34 or newer has it)");
        return -1;
    }
    return 0;
}

static int is_type(PyObject *obj, const char *name) {
    return strcmp(Py_TYPE(obj)->tp_name, name) == 0;
}

/* The verbs PD of a pyverbs.pd.PD, or NULL with TypeError/ValueError saying what differs. */
static struct ibv_pd *pd_of(PyObject *obj) {
    struct pyverbs_pd *o;
    struct pyverbs_context *c;
    PyObject *v;
    unsigned long long handle;
    if (!is_type(obj, "pyverbs.pd.PD")) {
        PyErr_Format(PyExc_TypeError, "expected a pyverbs.pd.PD, got %s", Py_TYPE(obj)->tp_name);
        return NULL;
    }
    if (pyverbs_release_check() < 0)
        return NULL;
    if (Py_TYPE(obj)->tp_basicsize != PYVERBS_44_PD_SIZE) {
        PyErr_Format(PyExc_TypeError, "pyverbs.pd.PD is %zd bytes, not the %d of pyverbs 44's "
                     "layout", Py_TYPE(obj)->tp_basicsize, PYVERBS_44_PD_SIZE);
        return NULL;
    }
    o = (struct pyverbs_pd *)obj;
    if (o->ctx == NULL || !is_type(o->ctx, "pyverbs.device.Context")
        || Py_TYPE(o->ctx)->tp_basicsize < (Py_ssize_t)sizeof(struct pyverbs_context)) {
        PyErr_SetString(PyExc_TypeError, "pyverbs.pd.PD's fields are not where pyverbs 44 "
                        "declares them (expected its Context after the PD pointer)");
        return NULL;
    }
    if (o->pd == NULL) {
        PyErr_SetString(PyExc_ValueError, "the pyverbs PD is closed");
        return NULL;
    }
    v = PyObject_GetAttrString(obj, "handle");
    if (v == NULL)
        return NULL;
    handle = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    if (handle == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    c = (struct pyverbs_context *)o->ctx;
    if (c->context == NULL || o->pd->context != c->context || o->pd->handle != handle) {
        PyErr_SetString(PyExc_TypeError,
                        "pyverbs.pd.PD's verbs PD does not match the object (context or handle)");
        return NULL;
    }
    return o->pd;
}

PyDoc_STRVAR(reg_doc,
"reg(pd, offset, length, iova, fd, access) -> (mr, lkey, rkey)\n\n"
"ibv_reg_dmabuf_mr on ``pd`` (a pyverbs.pd.PD): ``length`` bytes at ``offset`` of dma-buf\n"
"``fd``, addressed from ``iova`` by work requests and peers. ``mr`` is an opaque handle for\n"
"dereg(). OSError with the verbs errno when the device refuses (rdma_rxe: EOPNOTSUPP).");

static PyObject *reg(PyObject *self, PyObject *args) {
    PyObject *pd_obj;
    unsigned long long offset, length, iova;
    int fd, access, err;
    struct ibv_pd *pd;
    struct ibv_mr *mr;
    if (!PyArg_ParseTuple(args, "OKKKii", &pd_obj, &offset, &length, &iova, &fd, &access))
        return NULL;
    if (resolve() < 0 || (pd = pd_of(pd_obj)) == NULL)
        return NULL;
    if (length == 0 || fd < 0) {
        PyErr_Format(PyExc_ValueError, "dma-buf registration of %llu bytes of fd %d", length, fd);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS /* pinning device memory may take a while */
    errno = 0;
    mr = reg_dmabuf_mr_sym(pd, offset, (size_t)length, iova, fd, access);
    err = errno;
    Py_END_ALLOW_THREADS
    if (mr == NULL) {
        errno = err ? err : EINVAL;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("KII", (unsigned long long)(uintptr_t)mr, mr->lkey, mr->rkey);
}

PyDoc_STRVAR(dereg_doc,
"dereg(mr) -> None\n\nibv_dereg_mr of a handle reg() returned (once). OSError on failure.");

static PyObject *dereg(PyObject *self, PyObject *arg) {
    unsigned long long handle = PyLong_AsUnsignedLongLong(arg);
    int rc;
    if (handle == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (handle == 0 || resolve() < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "dereg: no MR");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = dereg_mr_sym((struct ibv_mr *)(uintptr_t)handle);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(available_doc,
"available() -> str\n\n\"\" when libibverbs has ibv_reg_dmabuf_mr, else why not.");

static PyObject *available(PyObject *self, PyObject *unused) {
    if (resolve() == 0)
        return PyUnicode_FromString("");
    {
        PyObject *type, *value, *tb, *text;
        PyErr_Fetch(&type, &value, &tb);
        text = value != NULL ? PyObject_Str(value) : PyUnicode_FromString("unknown");
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return text;
    }
}

static PyMethodDef methods[] = {
    {"reg", reg, METH_VARARGS, reg_doc},
    {"dereg", dereg, METH_O, dereg_doc},
    {"available", available, METH_NOARGS, available_doc},
    {"pyverbs_release", pyverbs_release, METH_VARARGS, pyverbs_release_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_dmabuf",
    "ibv_reg_dmabuf_mr on a pyverbs PD, with an iova of the caller's choice.", -1, methods,
};

PyMODINIT_FUNC PyInit__dmabuf(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "ACCESS_LOCAL_WRITE", IBV_ACCESS_LOCAL_WRITE) < 0
        || PyModule_AddIntConstant(m, "ACCESS_REMOTE_WRITE", IBV_ACCESS_REMOTE_WRITE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
