/*
 * kvbeam.transport.verbs._post: ibv_post_send of a chain of RDMA WRITEs built from kvbeam's
 * prepared WR descriptor arrays, with no Python work per WR.
 *
 * The descriptors (struct kvbeam_wr_desc, one per WR; numpy's DESC_DTYPE in chain.py) are
 * built and checked in Python when a transfer is prepared: every block's source and
 * destination lie inside a registered region with the keys given (kvbeam.transport.core.
 * prepare), every length is in (0, 2**31), the marker is a zero-length WRITE WITH IMM
 * (chain.check_descriptors). This module checks again what it can without the regions
 * (opcode, flags, SGE count against the length, the slice bounds, the chain length) and
 * refuses a bad descriptor with ValueError before anything is posted.
 *
 * The QP: pyverbs 44 has no accessor for a QP's struct ibv_qp pointer (QP exposes only
 * qp_num, qp_state and qp_type). The pointer is the first field of pyverbs.qp.QP as its
 * pyverbs/qp.pxd declares it (the layout a Cython `cimport pyverbs.qp` compiles against);
 * struct pyverbs_qp below mirrors base.pxd and qp.pxd of rdma-core 44.0 exactly, and is read
 * only when the loaded pyverbs is that release's (_pyverbs_layout.h: from its libibverbs'
 * file name). What is read, in order, and only after the step before it passed:
 *   1. the object's type name (pyverbs.qp.QP), then the loaded rdma-core release, then the
 *      type's tp_basicsize (sizeof(struct pyverbs_qp)): nothing of the object itself;
 *   3. the object's own fields pd, context, scq, rcq: compared as pointers and by their
 *      types' names (a pyverbs.pd.PD, None, a pyverbs.cq.CQ, a CQ or None), nothing
 *      dereferenced beyond the type;
 *   4. the struct ibv_qp pointer itself (the first field): NULL is a closed QP;
 *   5. through it, the verbs QP's qp_num, qp_type, pd, send_cq and context, and through
 *      its pd the PD's handle: they must match the object's qp_num, RC, and its PD
 *      object's handle (qp_ready());
 *   6. post(): steps 1 and 4, then ibv_post_send on the pointer.
 * Nothing is ever written into pyverbs' objects.
 *
 * ibv_post_send is an inline of <infiniband/verbs.h> (the provider's post_send through the
 * QP's context), so the module does not link libibverbs; pyverbs has loaded it already.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <infiniband/verbs.h>

#include "_pyverbs_layout.h"

/* One WR as chain.py prepares it (all integers native-endian; imm_data in network order, as
 * the WR carries it). Python checks its numpy dtype against DESC_SIZE and DESC_OFFSETS. */
struct kvbeam_wr_desc {
    uint64_t wr_id;
    uint64_t remote_addr;
    uint64_t addr;
    uint32_t length;
    uint32_t lkey;
    uint32_t rkey;
    uint32_t imm_data;
    uint8_t opcode;
    uint8_t send_flags;
    uint8_t num_sge;
    uint8_t unused[5]; /* padding to 8: never read (numpy copies fields, not these bytes) */
};

/* The longest chain one call builds (its WRs and SGEs are allocated per call). kvbeam posts
 * at most a send queue's depth at once. */
#define MAX_CHAIN (1 << 16)

/* pyverbs.qp.QP as Cython lays out pyverbs 44's declarations: PyverbsObject (base.pxd:
 * __weakref__, logger), PyverbsCM (its cpdef close adds the vtable pointer), QP (qp.pxd). */
struct pyverbs_qp {
    PyObject_HEAD
    PyObject *weakref;
    PyObject *logger;
    void *vtab;
    struct ibv_qp *qp;
    int type;
    int state;
    PyObject *pd;
    PyObject *context;
    PyObject *xrcd;
    PyObject *scq;
    PyObject *rcq;
    PyObject *mws;
    PyObject *srq;
    PyObject *flows;
    PyObject *dr_actions;
};

static int is_type(PyObject *obj, const char *name) {
    return strcmp(Py_TYPE(obj)->tp_name, name) == 0;
}

/* NULL and an exception unless obj is a pyverbs QP, the loaded pyverbs is rdma-core
 * PYVERBS_LAYOUT_RELEASE's and the QP type is as large as struct pyverbs_qp (its type's
 * name and size: nothing of the object read yet). */
static struct pyverbs_qp *as_pyverbs_qp(PyObject *obj) {
    if (!is_type(obj, "pyverbs.qp.QP")) {
        PyErr_Format(PyExc_TypeError, "expected a pyverbs.qp.QP, got %s", Py_TYPE(obj)->tp_name);
        return NULL;
    }
    if (pyverbs_release_check() < 0)
        return NULL;
    if (Py_TYPE(obj)->tp_basicsize != (Py_ssize_t)sizeof(struct pyverbs_qp)) {
        PyErr_Format(PyExc_TypeError,
                     "pyverbs.qp.QP is %zd bytes, not the %zu of pyverbs 44's layout",
                     Py_TYPE(obj)->tp_basicsize, sizeof(struct pyverbs_qp));
        return NULL;
    }
    return (struct pyverbs_qp *)obj;
}

static int attr_u64(PyObject *obj, const char *name, unsigned long long *out) {
    PyObject *v = PyObject_GetAttrString(obj, name);
    if (v == NULL)
        return -1;
    *out = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    return (*out == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
}

PyDoc_STRVAR(qp_ready_doc,
"qp_ready(qp) -> None\n\n"
"Check that ``qp`` (a pyverbs.qp.QP) is laid out as pyverbs 44 declares it and names a live\n"
"RC verbs QP on its PD; TypeError saying what differs otherwise. post() needs this first.");

static PyObject *qp_ready(PyObject *self, PyObject *arg) {
    struct pyverbs_qp *o = as_pyverbs_qp(arg);
    unsigned long long qp_num, pd_handle;
    if (o == NULL)
        return NULL;
    /* Object fields first: pointer comparisons and type names only, nothing dereferenced. */
    if (o->pd == NULL || !is_type(o->pd, "pyverbs.pd.PD") || o->scq == NULL
        || !is_type(o->scq, "pyverbs.cq.CQ") || o->context != Py_None
        || (o->rcq != Py_None && (o->rcq == NULL || !is_type(o->rcq, "pyverbs.cq.CQ")))) {
        PyErr_SetString(PyExc_TypeError,
                        "pyverbs.qp.QP's fields are not where pyverbs 44 declares them "
                        "(expected a QP created on a PD with a CQ)");
        return NULL;
    }
    if (o->qp == NULL) {
        PyErr_SetString(PyExc_ValueError, "the pyverbs QP is closed");
        return NULL;
    }
    if (attr_u64(arg, "qp_num", &qp_num) < 0 || attr_u64(o->pd, "handle", &pd_handle) < 0)
        return NULL;
    if (o->qp->qp_num != qp_num || o->qp->qp_type != IBV_QPT_RC || o->qp->pd == NULL
        || o->qp->pd->handle != pd_handle || o->qp->send_cq == NULL || o->qp->context == NULL) {
        PyErr_Format(PyExc_TypeError,
                     "pyverbs.qp.QP's verbs QP does not match the object (qp_num %u vs %llu, "
                     "type %d)", o->qp->qp_num, qp_num, (int)o->qp->qp_type);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* The descriptors of a buffer: C-contiguous, aligned, whole descriptors. */
static int get_descs(PyObject *obj, Py_buffer *view, Py_ssize_t *count) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len % (Py_ssize_t)sizeof(struct kvbeam_wr_desc) != 0
        || ((uintptr_t)view->buf % _Alignof(struct kvbeam_wr_desc)) != 0) {
        PyErr_Format(PyExc_ValueError,
                     "WR descriptors: %zd bytes at %p are not aligned %zu-byte descriptors",
                     view->len, view->buf, sizeof(struct kvbeam_wr_desc));
        PyBuffer_Release(view);
        return -1;
    }
    *count = view->len / (Py_ssize_t)sizeof(struct kvbeam_wr_desc);
    return 0;
}

/* Fill wrs[0..n) and sges[0..n) from d[0..n), linked in order; -1 with ValueError on a
 * descriptor no kvbeam chain has (first = its index in the caller's array). */
static int build_chain(const struct kvbeam_wr_desc *d, Py_ssize_t n, Py_ssize_t first,
                       struct ibv_send_wr *wrs, struct ibv_sge *sges) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const struct kvbeam_wr_desc *x = &d[i];
        struct ibv_send_wr *w = &wrs[i];
        int imm = x->opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
        if ((x->opcode != IBV_WR_RDMA_WRITE && !imm) || (x->send_flags & ~IBV_SEND_SIGNALED)
            || x->num_sge > 1 || (x->num_sge == 1) != (x->length > 0)
            || x->length > (1u << 31)) {
            PyErr_Format(PyExc_ValueError,
                         "WR descriptor %zd: opcode %u, flags %u, %u SGE(s) of %u bytes is not "
                         "an RDMA WRITE kvbeam posts; nothing was posted",
                         first + i, x->opcode, x->send_flags, x->num_sge, x->length);
            return -1;
        }
        memset(w, 0, sizeof(*w));
        w->wr_id = x->wr_id;
        w->next = i + 1 < n ? &wrs[i + 1] : NULL;
        w->opcode = imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
        w->send_flags = x->send_flags;
        w->imm_data = imm ? x->imm_data : 0;
        w->wr.rdma.remote_addr = x->remote_addr;
        w->wr.rdma.rkey = x->rkey;
        w->num_sge = x->num_sge;
        w->sg_list = x->num_sge ? &sges[i] : NULL;
        sges[i].addr = x->addr;
        sges[i].length = x->length;
        sges[i].lkey = x->lkey;
    }
    return 0;
}

/* Parse (descs, a, b), check the slice and build its chain in a fresh allocation. */
static struct ibv_send_wr *chain_of(PyObject *descs, Py_ssize_t a, Py_ssize_t b) {
    Py_buffer view;
    Py_ssize_t count;
    struct ibv_send_wr *wrs;
    if (get_descs(descs, &view, &count) < 0)
        return NULL;
    if (a < 0 || b <= a || b > count || b - a > MAX_CHAIN) {
        PyErr_Format(PyExc_ValueError,
                     "WRs [%zd, %zd) of %zd descriptors: not a slice of 1 to %d WRs; nothing "
                     "was posted", a, b, count, MAX_CHAIN);
        PyBuffer_Release(&view);
        return NULL;
    }
    wrs = PyMem_Malloc((size_t)(b - a) * (sizeof(struct ibv_send_wr) + sizeof(struct ibv_sge)));
    if (wrs == NULL) {
        PyErr_NoMemory();
    } else if (build_chain((const struct kvbeam_wr_desc *)view.buf + a, b - a, a, wrs,
                           (struct ibv_sge *)(wrs + (b - a))) < 0) {
        PyMem_Free(wrs);
        wrs = NULL;
    }
    PyBuffer_Release(&view);
    return wrs;
}

PyDoc_STRVAR(post_doc,
"post(qp, descs, a, b) -> None\n\n"
"Build WRs ``a`` to ``b - 1`` of ``descs`` (a C-contiguous array of DESC_SIZE-byte\n"
"descriptors) as one ibv_send_wr chain and ibv_post_send it on ``qp``, a pyverbs.qp.QP\n"
"that qp_ready() accepted. The GIL is released around the post: the caller keeps the QP\n"
"open meanwhile. ValueError (nothing posted) for a bad slice or descriptor; OSError with\n"
"the provider's errno if ibv_post_send fails (the WRs before the failing one are posted).");

static PyObject *post(PyObject *self, PyObject *args) {
    PyObject *qp_obj, *descs;
    Py_ssize_t a, b, bad_index;
    struct pyverbs_qp *o;
    struct ibv_qp *qp;
    struct ibv_send_wr *wrs, *bad = NULL;
    int rc;
    if (!PyArg_ParseTuple(args, "OOnn:post", &qp_obj, &descs, &a, &b))
        return NULL;
    if ((o = as_pyverbs_qp(qp_obj)) == NULL)
        return NULL;
    if ((qp = o->qp) == NULL) {
        PyErr_SetString(PyExc_ValueError, "the pyverbs QP is closed; nothing was posted");
        return NULL;
    }
    if ((wrs = chain_of(descs, a, b)) == NULL)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = ibv_post_send(qp, wrs, &bad);
    Py_END_ALLOW_THREADS
    bad_index = bad != NULL ? (Py_ssize_t)(bad - wrs) : -1;
    PyMem_Free(wrs);
    if (rc != 0) {
        PyErr_Format(PyExc_OSError, "ibv_post_send of %zd WRs failed at WR %zd: %s (errno %d)",
                     b - a, bad_index, strerror(rc), rc);
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(chain_fields_doc,
"chain_fields(descs, a, b) -> list of tuples\n\n"
"The chain post() would build for WRs ``a`` to ``b - 1``, read back by following each WR's\n"
"next pointer: (wr_id, opcode, send_flags, imm_data, remote_addr, rkey, num_sge, sge addr,\n"
"sge length, sge lkey) per WR, the SGE fields 0 without an SGE. For tests; posts nothing.");

static PyObject *chain_fields(PyObject *self, PyObject *args) {
    PyObject *descs, *out, *row;
    Py_ssize_t a, b;
    struct ibv_send_wr *wrs;
    if (!PyArg_ParseTuple(args, "Onn:chain_fields", &descs, &a, &b))
        return NULL;
    if ((wrs = chain_of(descs, a, b)) == NULL)
        return NULL;
    if ((out = PyList_New(0)) == NULL) {
        PyMem_Free(wrs);
        return NULL;
    }
    for (struct ibv_send_wr *w = wrs; w != NULL; w = w->next) {
        const struct ibv_sge *s = w->sg_list;
        row = Py_BuildValue("(KIIIKIiKII)", (unsigned long long)w->wr_id, (unsigned)w->opcode,
                            w->send_flags, (unsigned)w->imm_data,
                            (unsigned long long)w->wr.rdma.remote_addr, w->wr.rdma.rkey,
                            w->num_sge, (unsigned long long)(s ? s->addr : 0),
                            s ? s->length : 0u, s ? s->lkey : 0u);
        if (row == NULL || PyList_Append(out, row) < 0) {
            Py_XDECREF(row);
            Py_DECREF(out);
            PyMem_Free(wrs);
            return NULL;
        }
        Py_DECREF(row);
    }
    PyMem_Free(wrs);
    return out;
}

static PyMethodDef methods[] = {
    {"qp_ready", qp_ready, METH_O, qp_ready_doc},
    {"post", post, METH_VARARGS, post_doc},
    {"chain_fields", chain_fields, METH_VARARGS, chain_fields_doc},
    {"pyverbs_release", pyverbs_release, METH_VARARGS, pyverbs_release_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_post",
    "ibv_post_send of kvbeam's prepared WR descriptors as one chain (see chain.py).", -1,
    methods,
};

#define OFFSET(field) offsetof(struct kvbeam_wr_desc, field)

PyMODINIT_FUNC PyInit__post(void) {
    PyObject *m = PyModule_Create(&module);
    PyObject *offsets;
    if (m == NULL)
        return NULL;
    offsets = Py_BuildValue(
        "{snsnsnsnsnsnsnsnsnsn}", "wr_id", (Py_ssize_t)OFFSET(wr_id), "remote_addr",
        (Py_ssize_t)OFFSET(remote_addr), "addr", (Py_ssize_t)OFFSET(addr), "length",
        (Py_ssize_t)OFFSET(length), "lkey", (Py_ssize_t)OFFSET(lkey), "rkey",
        (Py_ssize_t)OFFSET(rkey), "imm_data", (Py_ssize_t)OFFSET(imm_data), "opcode",
        (Py_ssize_t)OFFSET(opcode), "send_flags", (Py_ssize_t)OFFSET(send_flags), "num_sge",
        (Py_ssize_t)OFFSET(num_sge));
    if (offsets == NULL || PyModule_AddObjectRef(m, "DESC_OFFSETS", offsets) < 0
        || PyModule_AddIntConstant(m, "DESC_SIZE", (long)sizeof(struct kvbeam_wr_desc)) < 0
        || PyModule_AddIntConstant(m, "MAX_CHAIN", MAX_CHAIN) < 0
        || PyModule_AddIntConstant(m, "WR_RDMA_WRITE", IBV_WR_RDMA_WRITE) < 0
        || PyModule_AddIntConstant(m, "WR_RDMA_WRITE_WITH_IMM", IBV_WR_RDMA_WRITE_WITH_IMM) < 0
        || PyModule_AddIntConstant(m, "SEND_SIGNALED", IBV_SEND_SIGNALED) < 0
        || PyModule_AddStringConstant(m, "PYVERBS_LAYOUT_RELEASE", PYVERBS_LAYOUT_RELEASE) < 0) {
        Py_XDECREF(offsets);
        Py_DECREF(m);
        return NULL;
    }
    Py_DECREF(offsets);
    return m;
}
