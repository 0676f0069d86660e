/* The Python module around the n-gram lookups (ngram_lookup.c): spekula.drafters._ngram_lookup.
 *
 * These run once per slot per round, right after a forward has pushed the interpreter's code and
 * data out of the caches. Through ctypes a call cost 60-80 us in that state (argument conversion,
 * numpy's .ctypes attribute, the GIL hand-off), through this module about 10 us: arrays arrive via
 * the buffer protocol and drafts go back as lists, with no Python code in between.
 *
 * Token arrays must be C-contiguous int32 buffers; anything else is a TypeError, which the Python
 * side (drafters/draftless/ngram_lookup.py) answers by converting and calling again.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "int32_buffer.h"
#include <string.h>

int64_t ng_last_match(const int32_t *hist, const int32_t *pat, int32_t n, int64_t lo, int64_t hi, int32_t need);
int32_t ng_simple_draft(const int32_t *hist, int64_t len, int32_t last, int32_t n, int32_t m, int32_t min_hits,
                        int32_t *out);
int64_t ngm_add_range(int32_t *entries, uint64_t mask, const int32_t *hist, int64_t lo, int64_t hi, int32_t n,
                      int32_t empty);
int32_t ngm_walk(const int32_t *entries, uint64_t mask, const int32_t *window, int32_t n, int32_t n_min,
                 int32_t n_max, int32_t empty, int32_t *out);

enum { MAX_LEN = 1024 }; /* the longest n-gram and the longest draft any option allows */

static int tokens(PyObject *obj, Py_buffer *b, int writable) { return int32_view(obj, b, writable); }

static PyObject *as_list(const int32_t *v, int32_t n) {
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (int32_t i = 0; i < n; i++) {
        PyObject *t = PyLong_FromLong(v[i]);
        if (!t) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, t);
    }
    return out;
}

static int ints(PyObject *const *args, Py_ssize_t from, Py_ssize_t n, int64_t *out) {
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(args[from + i]);
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static int nargs_is(Py_ssize_t got, Py_ssize_t want, const char *name) {
    if (got == want) return 1;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, got);
    return 0;
}

/* last_match(hist, pattern, lo, hi, need) -> int: see ng_last_match. */
static PyObject *py_last_match(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[3];
    Py_buffer h, p;
    if (!nargs_is(nargs, 5, "last_match") || ints(args, 2, 3, v) < 0) return NULL;
    if (tokens(args[0], &h, 0) < 0) return NULL;
    if (tokens(args[1], &p, 0) < 0) {
        PyBuffer_Release(&h);
        return NULL;
    }
    int64_t n_h = h.len / 4, n_p = p.len / 4, r = -1;
    if (v[1] + n_p > n_h || n_p > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "search range runs past the history");
        r = -2;
    } else {
        r = ng_last_match(h.buf, p.buf, (int32_t)n_p, v[0], v[1], v[2] < 1 ? 1 : (int32_t)v[2]);
    }
    PyBuffer_Release(&h);
    PyBuffer_Release(&p);
    return r == -2 ? NULL : PyLong_FromLongLong(r);
}

/* simple_draft(hist, last, n, m, min_hits) -> list: ngram-simple's draft (ng_simple_draft). */
static PyObject *py_simple_draft(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[4];
    Py_buffer h;
    if (!nargs_is(nargs, 5, "simple_draft") || ints(args, 1, 4, v) < 0) return NULL;
    if (v[1] < 1 || v[1] > MAX_LEN || v[2] < 1 || v[2] > MAX_LEN) {
        PyErr_SetString(PyExc_ValueError, "ngram-simple sizes must be in [1, 1024]");
        return NULL;
    }
    if (tokens(args[0], &h, 0) < 0) return NULL;
    int32_t out[MAX_LEN];
    int32_t k = ng_simple_draft(h.buf, h.len / 4, (int32_t)v[0], (int32_t)v[1], (int32_t)v[2],
                                v[3] < 1 ? 1 : (int32_t)v[3], out);
    PyBuffer_Release(&h);
    return as_list(out, k);
}

/* The table's index mask, or 0 with ValueError set when its length is not a power of two. */
static uint64_t table_mask(const Py_buffer *e) {
    uint64_t n = (uint64_t)(e->len / 4);
    if (n == 0 || (n & (n - 1))) {
        PyErr_SetString(PyExc_ValueError, "the n-gram table must be a contiguous int32 array of power-of-two length");
        return 0;
    }
    return n - 1;
}

/* mod_add_range(entries, hist, lo, hi, n, empty) -> int: see ngm_add_range. */
static PyObject *py_mod_add_range(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[4];
    Py_buffer e, h;
    if (!nargs_is(nargs, 6, "mod_add_range") || ints(args, 2, 4, v) < 0) return NULL;
    if (tokens(args[0], &e, 1) < 0) return NULL;
    if (tokens(args[1], &h, 0) < 0) {
        PyBuffer_Release(&e);
        return NULL;
    }
    int64_t r = -1;
    uint64_t mask = table_mask(&e);
    if (mask && (v[0] < 0 || v[2] < 1 || v[2] > MAX_LEN || v[1] + v[2] > h.len / 4)) {
        PyErr_SetString(PyExc_ValueError, "window range runs past the history");
    } else if (mask) {
        r = ngm_add_range(e.buf, mask, h.buf, v[0], v[1], (int32_t)v[2], (int32_t)v[3]);
    }
    PyBuffer_Release(&e);
    PyBuffer_Release(&h);
    return r < 0 ? NULL : PyLong_FromLongLong(r);
}

/* The walk from `window` (n tokens) or, with tail = 1, from the last n - 1 tokens of `window`
 * followed by `last`. */
static PyObject *walk(PyObject *entries, PyObject *source, int tail, int64_t last, int64_t n, int64_t n_min,
                      int64_t n_max, int64_t empty) {
    Py_buffer e, s;
    if (tokens(entries, &e, 0) < 0) return NULL;
    if (tokens(source, &s, 0) < 0) {
        PyBuffer_Release(&e);
        return NULL;
    }
    PyObject *out = NULL;
    uint64_t mask = table_mask(&e);
    int64_t n_s = s.len / 4;
    if (!mask) {
        /* error set */
    } else if (n < 1 || n > MAX_LEN || n_max > MAX_LEN || (tail ? n_s < n - 1 : n_s != n)) {
        PyErr_SetString(PyExc_ValueError, "the n-gram window and the walk must be 1..1024 tokens");
    } else {
        int32_t window[MAX_LEN], drafted[MAX_LEN];
        const int32_t *src = s.buf;
        if (tail) {
            memcpy(window, src + n_s - (n - 1), sizeof(int32_t) * (size_t)(n - 1));
            window[n - 1] = (int32_t)last;
        } else {
            memcpy(window, src, sizeof(int32_t) * (size_t)n);
        }
        int32_t k = n_max > 0 ? ngm_walk(e.buf, mask, window, (int32_t)n, (int32_t)n_min, (int32_t)n_max,
                                         (int32_t)empty, drafted) : 0;
        out = as_list(drafted, k);
    }
    PyBuffer_Release(&e);
    PyBuffer_Release(&s);
    return out;
}

/* mod_walk(entries, window, n_min, n_max, empty) -> list: see ngm_walk. */
static PyObject *py_mod_walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[3];
    if (!nargs_is(nargs, 5, "mod_walk") || ints(args, 2, 3, v) < 0) return NULL;
    Py_buffer w;
    if (tokens(args[1], &w, 0) < 0) return NULL;
    int64_t n = w.len / 4;
    PyBuffer_Release(&w);
    return walk(args[0], args[1], 0, 0, n, v[0], v[1], v[2]);
}

/* mod_walk_after(entries, hist, last, n, n_min, n_max, empty) -> list: the walk from the n-gram made of
 * the last n - 1 tokens of hist and `last`, without building that window in Python. */
static PyObject *py_mod_walk_after(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[5];
    if (!nargs_is(nargs, 7, "mod_walk_after") || ints(args, 2, 5, v) < 0) return NULL;
    return walk(args[0], args[1], 1, v[0], v[1], v[2], v[3], v[4]);
}

static PyMethodDef methods[] = {
    {"last_match", (PyCFunction)(void (*)(void))py_last_match, METH_FASTCALL, NULL},
    {"simple_draft", (PyCFunction)(void (*)(void))py_simple_draft, METH_FASTCALL, NULL},
    {"mod_add_range", (PyCFunction)(void (*)(void))py_mod_add_range, METH_FASTCALL, NULL},
    {"mod_walk", (PyCFunction)(void (*)(void))py_mod_walk, METH_FASTCALL, NULL},
    {"mod_walk_after", (PyCFunction)(void (*)(void))py_mod_walk_after, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ngram_lookup", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__ngram_lookup(void) { return PyModule_Create(&module); }
