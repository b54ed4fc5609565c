/*
 * Which pyverbs object layout the verbs helpers (_post.c, _dmabuf.c) may read.
 *
 * pyverbs exposes no pointer to a QP's or PD's verbs object; the helpers read it from the
 * pyverbs object at the offset pyverbs' .pxd declarations give it, which is exact for one
 * pyverbs release only. pyverbs is built and shipped with its rdma-core release and carries
 * no version of its own, so the release is read from the libibverbs this process loaded
 * (pyverbs loads it): its file is libibverbs.so.1.<ABI>.<rdma-core release>, e.g.
 * libibverbs.so.1.14.44.0. pyverbs_release_check() passes for PYVERBS_LAYOUT_RELEASE only;
 * the helpers call it before they read anything of a pyverbs object, and refuse with a
 * TypeError naming both releases otherwise (the poster then falls back to pyverbs' own
 * objects; a dma-buf registration is refused).
 *
 * Nothing is dereferenced here: dlopen(RTLD_NOLOAD) of the library already loaded, dladdr of
 * one of its symbols for its path, realpath for the versioned file the symlink names.
 */
#ifndef KVBEAM_PYVERBS_LAYOUT_H
#define KVBEAM_PYVERBS_LAYOUT_H

#include <Python.h>

#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

/* The rdma-core release whose pyverbs declarations the helpers' structs mirror. */
#define PYVERBS_LAYOUT_RELEASE "44.0"

/* The rdma-core release in a libibverbs file's path (".../libibverbs.so.1.<ABI>.<release>")
 * into `out`; "" when the name is not of that form. */
static void release_of_path(const char *path, char *out, size_t size) {
    static const char stem[] = "libibverbs.so.1.";
    const char *base = strrchr(path, '/'), *release;
    base = base != NULL ? base + 1 : path;
    out[0] = '\0';
    if (strncmp(base, stem, sizeof stem - 1) == 0
        && (release = strchr(base + sizeof stem - 1, '.')) != NULL && release[1] != '\0') {
        strncpy(out, release + 1, size - 1);
        out[size - 1] = '\0';
    }
}

/* The rdma-core release of the loaded libibverbs into `out` ("" when it cannot be told);
 * 0, or -1 with RuntimeError when no libibverbs is loaded (pyverbs is not imported). */
static int loaded_rdma_core_release(char *out, size_t size) {
    Dl_info info;
    char real[PATH_MAX];
    void *lib = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_NOLOAD);
    void *sym;
    out[0] = '\0';
    if (lib == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "libibverbs is not loaded (import pyverbs first)");
        return -1;
    }
    sym = dlsym(lib, "ibv_get_device_list");
    if (sym != NULL && dladdr(sym, &info) != 0 && info.dli_fname != NULL
        && realpath(info.dli_fname, real) != NULL)
        release_of_path(real, out, size);
    dlclose(lib);
    return 0;
}

/* -1 with TypeError unless `release` is PYVERBS_LAYOUT_RELEASE. */
static int release_is_the_layouts(const char *release) {
    if (strcmp(release, PYVERBS_LAYOUT_RELEASE) == 0)
        return 0;
    PyErr_Format(PyExc_TypeError,
                 "pyverbs of rdma-core %s is loaded (read from its libibverbs' file name); "
                 "this helper reads pyverbs objects as rdma-core " PYVERBS_LAYOUT_RELEASE
                 " lays them out, and no other",
                 release[0] != '\0' ? release : "(unknown release)");
    return -1;
}

PyDoc_STRVAR(pyverbs_release_doc,
"pyverbs_release(path=None) -> str\n\n"
"The rdma-core release of the loaded libibverbs (pyverbs'), or of the libibverbs file\n"
"``path`` names; \"\" when it cannot be told. RuntimeError when none is loaded.");

/* The module function above (tests and diagnostics). */
static PyObject *pyverbs_release(PyObject *self, PyObject *args) {
    const char *path = NULL;
    char release[64];
    if (!PyArg_ParseTuple(args, "|z:pyverbs_release", &path))
        return NULL;
    if (path != NULL)
        release_of_path(path, release, sizeof release);
    else if (loaded_rdma_core_release(release, sizeof release) < 0)
        return NULL;
    return PyUnicode_FromString(release);
}

/* 0 when the loaded pyverbs is PYVERBS_LAYOUT_RELEASE's, else -1 with TypeError (or
 * RuntimeError: no libibverbs loaded) saying which release was found. */
static int pyverbs_release_check(void) {
    static int checked; /* 1: passed (the loaded library does not change) */
    char release[64];
    if (checked)
        return 0;
    if (loaded_rdma_core_release(release, sizeof release) < 0
        || release_is_the_layouts(release) < 0)
        return -1;
    checked = 1;
    return 0;
}

#endif
