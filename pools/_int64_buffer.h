/*
 * What pools/_xxh3.c, pools/_plan.c and pools/_owners.c check of an index list they are
 * handed: a buffer of native int64 (numpy's int64 exports format "l" or "q" on LP64,
 * with or without a native or little-endian byte-order prefix). Include after <Python.h>.
 */
#ifndef KVBEAM_INT64_BUFFER_H
#define KVBEAM_INT64_BUFFER_H

static inline int is_int64(const Py_buffer *view) {
    const char *fmt = view->format;
    if (view->itemsize != 8 || fmt == NULL)
        return 0;
    if (*fmt == '@' || *fmt == '=' || *fmt == '<')
        fmt++;
    return (fmt[0] == 'l' || fmt[0] == 'q') && fmt[1] == '\0';
}

#endif
