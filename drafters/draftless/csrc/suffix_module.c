/* The Python module around the suffix tree (suffix_tree.c): spekula.drafters._suffix_tree.Tree.
 *
 * The suffix drafter appends a round's accepted tokens and looks its context up every round, right
 * after a forward, when the interpreter's code and data are out of the caches; through ctypes that
 * cost 130-160 us a round, most of it argument conversion and the arrays built to pass. Here the
 * arrays arrive by the buffer protocol, the context can be the tail of a sequence the tree already
 * holds, and a speculation comes back as one tuple.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "int32_buffer.h"

typedef struct st_tree st_tree;
st_tree *st_new(int32_t max_depth);
void st_free(st_tree *t);
int64_t st_nodes(const st_tree *t);
int32_t st_seq_new(st_tree *t);
int st_seq_append(st_tree *t, int32_t h, const int32_t *toks, int64_t n);
void st_seq_remove(st_tree *t, int32_t h);
int64_t st_seq_len(const st_tree *t, int32_t h);
const int32_t *st_seq_tokens(const st_tree *t, int32_t h, int64_t *n);
int32_t st_speculate(const st_tree *t, const int32_t *ctx, int32_t n_ctx, int32_t max_spec, float factor,
                     float min_prob, int32_t min_match, int32_t self_count, int32_t *out_tokens, float *out_probs,
                     float *out_score, int32_t *out_match);
int64_t st_count(const st_tree *t, const int32_t *tokens, int32_t n);

enum { MAX_DEPTH = 1024 };

typedef struct {
    PyObject_HEAD
    st_tree *tree;
    int32_t max_depth;
} Tree;

static PyTypeObject TreeType;

static int tokens(PyObject *obj, Py_buffer *b) { return int32_view(obj, b, 0); }

static int open_tree(Tree *self) {
    if (self->tree) return 1;
    PyErr_SetString(PyExc_ValueError, "the suffix tree is closed");
    return 0;
}

/* A live sequence's handle, or 0 with ValueError set. */
static int live_seq(Tree *self, int32_t h) {
    if (st_seq_len(self->tree, h) >= 0) return 1;
    PyErr_Format(PyExc_ValueError, "no such sequence: %d", (int)h);
    return 0;
}

static int nargs_is(Py_ssize_t got, Py_ssize_t want, const char *name) {
    if (got == want) return 1;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, got);
    return 0;
}

static int as_i32(PyObject *o, int32_t *out) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < INT32_MIN || v > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "value out of int32 range");
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

static PyObject *Tree_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    int max_depth;
    static char *names[] = {"max_depth", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i", names, &max_depth)) return NULL;
    if (max_depth < 1 || max_depth > MAX_DEPTH) {
        PyErr_Format(PyExc_ValueError, "suffix tree depth must be in [1, %d], got %d", MAX_DEPTH, max_depth);
        return NULL;
    }
    Tree *self = (Tree *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->max_depth = max_depth;
    self->tree = st_new(max_depth);
    if (!self->tree) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void Tree_dealloc(Tree *self) {
    if (self->tree) st_free(self->tree);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Tree_close(Tree *self, PyObject *unused) {
    (void)unused;
    if (self->tree) st_free(self->tree);
    self->tree = NULL;
    Py_RETURN_NONE;
}

static PyObject *Tree_nodes(Tree *self, PyObject *unused) {
    (void)unused;
    if (!open_tree(self)) return NULL;
    return PyLong_FromLongLong(st_nodes(self->tree));
}

static PyObject *Tree_seq_new(Tree *self, PyObject *unused) {
    (void)unused;
    if (!open_tree(self)) return NULL;
    int32_t h = st_seq_new(self->tree);
    if (h < 0) return PyErr_NoMemory();
    return PyLong_FromLong(h);
}

/* append(handle, tokens): tokens is an int32 array (or anything else, which is a TypeError). */
static PyObject *Tree_append(Tree *self, PyObject *const *args, Py_ssize_t nargs) {
    int32_t h;
    Py_buffer b;
    if (!nargs_is(nargs, 2, "append") || !open_tree(self) || as_i32(args[0], &h) < 0 || !live_seq(self, h))
        return NULL;
    if (tokens(args[1], &b) < 0) return NULL;
    int rc = b.len ? st_seq_append(self->tree, h, b.buf, b.len / 4) : 0;
    PyBuffer_Release(&b);
    if (rc != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* push(handle, token): one token. */
static PyObject *Tree_push(Tree *self, PyObject *const *args, Py_ssize_t nargs) {
    int32_t h, tok;
    if (!nargs_is(nargs, 2, "push") || !open_tree(self) || as_i32(args[0], &h) < 0 || as_i32(args[1], &tok) < 0 ||
        !live_seq(self, h))
        return NULL;
    if (st_seq_append(self->tree, h, &tok, 1) != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *Tree_remove(Tree *self, PyObject *arg) {
    int32_t h;
    if (!open_tree(self) || as_i32(arg, &h) < 0) return NULL;
    st_seq_remove(self->tree, h);
    Py_RETURN_NONE;
}

static PyObject *Tree_length(Tree *self, PyObject *arg) {
    int32_t h;
    if (!open_tree(self) || as_i32(arg, &h) < 0) return NULL;
    return PyLong_FromLongLong(st_seq_len(self->tree, h));
}

static PyObject *Tree_count(Tree *self, PyObject *arg) {
    Py_buffer b;
    if (!open_tree(self) || tokens(arg, &b) < 0) return NULL;
    int64_t n = b.len / 4, c = n > INT32_MAX ? 0 : st_count(self->tree, b.buf, (int32_t)n);
    PyBuffer_Release(&b);
    return PyLong_FromLongLong(c);
}

/* The speculation after ctx[0..n): (tokens, cumulative probabilities, score, match length), or None. */
static PyObject *speculate(Tree *self, const int32_t *ctx, int64_t n, PyObject *const *opts) {
    int32_t max_spec, min_match, self_count;
    double factor = PyFloat_AsDouble(opts[1]), min_prob = PyFloat_AsDouble(opts[2]);
    if (as_i32(opts[0], &max_spec) < 0 || (factor == -1.0 && PyErr_Occurred()) ||
        (min_prob == -1.0 && PyErr_Occurred()) || as_i32(opts[3], &min_match) < 0 || as_i32(opts[4], &self_count) < 0)
        return NULL;
    if (n > self->max_depth - 1) {
        ctx += n - (self->max_depth - 1);
        n = self->max_depth - 1;
    }
    if (max_spec <= 0 || n <= 0) Py_RETURN_NONE;
    int32_t *toks = PyMem_Malloc(sizeof(int32_t) * (size_t)max_spec);
    float *probs = PyMem_Malloc(sizeof(float) * (size_t)max_spec);
    PyObject *out = NULL, *lt = NULL, *lp = NULL;
    if (!toks || !probs) {
        PyErr_NoMemory();
        goto done;
    }
    float score = 0.0f;
    int32_t match = 0;
    int32_t k = st_speculate(self->tree, ctx, (int32_t)n, max_spec, (float)factor, (float)min_prob, min_match,
                             self_count, toks, probs, &score, &match);
    if (k <= 0) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    lt = PyList_New(k);
    lp = PyList_New(k);
    if (!lt || !lp) goto done;
    for (int32_t i = 0; i < k; i++) {
        PyObject *t = PyLong_FromLong(toks[i]), *p = PyFloat_FromDouble(probs[i]);
        if (!t || !p) {
            Py_XDECREF(t);
            Py_XDECREF(p);
            goto done;
        }
        PyList_SET_ITEM(lt, i, t);
        PyList_SET_ITEM(lp, i, p);
    }
    out = Py_BuildValue("(OOdi)", lt, lp, (double)score, match);
done:
    Py_XDECREF(lt);
    Py_XDECREF(lp);
    PyMem_Free(toks);
    PyMem_Free(probs);
    return out;
}

/* speculate(context, max_spec, factor, min_prob, min_match, self_count) */
static PyObject *Tree_speculate(Tree *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer b;
    if (!nargs_is(nargs, 6, "speculate") || !open_tree(self) || tokens(args[0], &b) < 0) return NULL;
    PyObject *out = speculate(self, b.buf, b.len / 4, args + 1);
    PyBuffer_Release(&b);
    return out;
}

/* speculate_after(source, handle, max_spec, factor, min_prob, min_match, self_count): the context is the
 * tail of sequence `handle` of the tree `source` (this tree or another). */
static PyObject *Tree_speculate_after(Tree *self, PyObject *const *args, Py_ssize_t nargs) {
    int32_t h;
    if (!nargs_is(nargs, 7, "speculate_after") || !open_tree(self)) return NULL;
    if (!PyObject_TypeCheck(args[0], &TreeType)) {
        PyErr_SetString(PyExc_TypeError, "speculate_after: the source must be a Tree");
        return NULL;
    }
    Tree *src = (Tree *)args[0];
    if (!open_tree(src) || as_i32(args[1], &h) < 0) return NULL;
    int64_t n = 0;
    const int32_t *toks = st_seq_tokens(src->tree, h, &n);
    if (!toks) {
        PyErr_SetString(PyExc_ValueError, "speculate_after: no such sequence");
        return NULL;
    }
    return speculate(self, toks, n, args + 2);
}

static PyMethodDef Tree_methods[] = {
    {"close", (PyCFunction)Tree_close, METH_NOARGS, "Free the tree now (later calls raise ValueError)."},
    {"nodes", (PyCFunction)Tree_nodes, METH_NOARGS, "Live nodes."},
    {"seq_new", (PyCFunction)Tree_seq_new, METH_NOARGS, "A new empty sequence's handle."},
    {"append", (PyCFunction)(void (*)(void))Tree_append, METH_FASTCALL, "append(handle, int32 tokens)"},
    {"push", (PyCFunction)(void (*)(void))Tree_push, METH_FASTCALL, "push(handle, token)"},
    {"remove", (PyCFunction)Tree_remove, METH_O, "remove(handle): take a sequence's counts out."},
    {"length", (PyCFunction)Tree_length, METH_O, "length(handle): tokens in a sequence (-1: none)."},
    {"count", (PyCFunction)Tree_count, METH_O, "count(int32 tokens): occurrences of the substring."},
    {"speculate", (PyCFunction)(void (*)(void))Tree_speculate, METH_FASTCALL,
     "speculate(context, max_spec, factor, min_prob, min_match, self_count) -> (tokens, probs, score, match) | None"},
    {"speculate_after", (PyCFunction)(void (*)(void))Tree_speculate_after, METH_FASTCALL,
     "speculate_after(source_tree, handle, max_spec, factor, min_prob, min_match, self_count)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TreeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spekula.drafters._suffix_tree.Tree",
    .tp_basicsize = sizeof(Tree),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Tree(max_depth): a depth-bounded suffix tree with occurrence counts.",
    .tp_new = Tree_new,
    .tp_dealloc = (destructor)Tree_dealloc,
    .tp_methods = Tree_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_suffix_tree", NULL, -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__suffix_tree(void) {
    if (PyType_Ready(&TreeType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Tree", (PyObject *)&TreeType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
