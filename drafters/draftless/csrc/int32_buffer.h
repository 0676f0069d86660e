/* The drafters' extension modules take token arrays through the buffer protocol: a C-contiguous
 * int32 view, or a TypeError that their Python side answers by converting the array and calling
 * again. Include after Python.h. */
#ifndef SPEKULA_INT32_BUFFER_H
#define SPEKULA_INT32_BUFFER_H

static inline int is_i32(const Py_buffer *b) {
    const char *f = b->format ? b->format : "B";
    if (*f == '@' || *f == '=' || *f == '<') f++;
    return b->itemsize == 4 && (f[0] == 'i' || (f[0] == 'l' && sizeof(long) == 4)) && f[1] == '\0';
}

/* A C-contiguous int32 view of `obj` (writable when asked), or -1 with TypeError set. */
static inline int int32_view(PyObject *obj, Py_buffer *b, int writable) {
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "expected a C-contiguous int32 array");
        return -1;
    }
    if (!is_i32(b)) {
        PyBuffer_Release(b);
        PyErr_SetString(PyExc_TypeError, "expected a C-contiguous int32 array");
        return -1;
    }
    return 0;
}

#endif
