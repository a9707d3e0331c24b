/* kvroute block-key chain in C: the same keys as core/blocks.py, ~10x faster.
 *
 *   key_i = XXH3_64(le64(key_{i-1}) || le32(t_{iB}) .. le32(t_{iB+B-1})),  key_{-1} = seed
 *
 * chain_keys(tokens, block_size, seed) -> list[int]
 *   tokens: any sequence of ints in [0, 2**32) (a list, a protobuf repeated field), or a
 *   buffer of native uint32 (array('I'), as core/wire.py decodes a request's
 *   token_ids), which is read in place without a Python int per token. Only full blocks
 *   are keyed. Raises OverflowError / TypeError like the pure-Python path. The xxHash header is vendored from xxHash 0.8 (BSD-2-Clause, see
 *   LICENSE.xxhash).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

static void put_le64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static void put_le32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* A buffer of native uint32 token ids (array('I'), numpy uint32), else 0 with view unset. */
static int get_u32_buffer(PyObject *obj, Py_buffer *view) {
    if (!PyObject_CheckBuffer(obj)) return 0;
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear(); /* not contiguous: read it as a sequence instead */
        return 0;
    }
    const char *f = view->format ? view->format : "B";
    int little = 1;
    little = *(const unsigned char *)&little;
    int native_u32 = view->itemsize == 4 &&
        (!strcmp(f, "I") || !strcmp(f, "=I") || !strcmp(f, "@I") ||
         (little && !strcmp(f, "<I")) || (!little && !strcmp(f, ">I")));
    if (!native_u32) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

static PyObject *chain_keys(PyObject *self, PyObject *args) {
    PyObject *tokens;
    Py_ssize_t block_size;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OnK", &tokens, &block_size, &seed)) return NULL;
    if (block_size <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be > 0, got %zd", block_size);
        return NULL;
    }
    Py_buffer view;
    int buffered = get_u32_buffer(tokens, &view);
    PyObject *seq = NULL;
    PyObject **items = NULL;
    const uint32_t *ids = NULL;
    Py_ssize_t n;
    if (buffered) {
        ids = (const uint32_t *)view.buf;
        n = view.len / 4;
    } else {
        seq = PySequence_Fast(tokens, "tokens must be a sequence of ints");
        if (seq == NULL) return NULL;
        items = PySequence_Fast_ITEMS(seq);
        n = PySequence_Fast_GET_SIZE(seq);
    }
    Py_ssize_t blocks = n / block_size;
    PyObject *out = PyList_New(blocks);
    unsigned char *buf = PyMem_Malloc(8 + 4 * (size_t)block_size);
    if (out == NULL || buf == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    uint64_t prev = (uint64_t)seed;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        put_le64(buf, prev);
        for (Py_ssize_t j = 0; j < block_size; j++) {
            uint32_t t;
            if (ids != NULL) {
                t = ids[b * block_size + j];
            } else {
                unsigned long v = PyLong_AsUnsignedLong(items[b * block_size + j]);
                if (v == (unsigned long)-1 && PyErr_Occurred()) goto fail;
                if (v > 0xFFFFFFFFUL) {
                    PyErr_SetString(PyExc_OverflowError, "token id does not fit in uint32");
                    goto fail;
                }
                t = (uint32_t)v;
            }
            put_le32(buf + 8 + 4 * j, t);
        }
        prev = XXH3_64bits(buf, 8 + 4 * (size_t)block_size);
        PyObject *key = PyLong_FromUnsignedLongLong(prev);
        if (key == NULL) goto fail;
        PyList_SET_ITEM(out, b, key);
    }
    PyMem_Free(buf);
    if (buffered) PyBuffer_Release(&view);
    Py_XDECREF(seq);
    return out;
fail:
    PyMem_Free(buf);
    if (buffered) PyBuffer_Release(&view);
    Py_XDECREF(seq);
    Py_XDECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"chain_keys", chain_keys, METH_VARARGS,
     "chain_keys(tokens, block_size, seed) -> list of the chained keys of every full block"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvroute.core._chainhash",
    "Block-key chain hashing in C (see core/blocks.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__chainhash(void) { return PyModule_Create(&module); }
