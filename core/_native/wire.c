/* Protobuf wire decoding for the router's hot path: a packed repeated uint32 field's payload
 * (a run of varints) -> native uint32 bytes, without a Python int per value.
 *
 * unpack_uint32(payload) -> (bytes, max)
 *   payload: any bytes-like object holding the field's packed varints. Each varint is read
 *   as protobuf reads a uint32 (up to 10 bytes, truncated to its low 32 bits). Returns the
 *   values as native-endian uint32 bytes (array('I').frombytes takes them) and the largest
 *   value (0 when empty). Raises ValueError on a truncated or over-long varint.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *unpack_uint32(PyObject *self, PyObject *arg) {
    Py_buffer in;
    if (PyObject_GetBuffer(arg, &in, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *p = in.buf, *end = p + in.len;
    /* each varint takes at least one byte, so len values at most */
    PyObject *out = PyBytes_FromStringAndSize(NULL, in.len * 4);
    if (out == NULL) {
        PyBuffer_Release(&in);
        return NULL;
    }
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(out);
    Py_ssize_t n = 0;
    uint32_t top = 0;
    while (p < end) {
        uint64_t v = 0;
        int shift = 0;
        for (;;) {
            if (p >= end) {
                PyErr_Format(PyExc_ValueError, "truncated varint at value %zd", n);
                goto fail;
            }
            if (shift >= 70) {
                PyErr_Format(PyExc_ValueError, "varint longer than 10 bytes at value %zd", n);
                goto fail;
            }
            unsigned char b = *p++;
            v |= (uint64_t)(b & 0x7F) << shift;
            shift += 7;
            if (!(b & 0x80)) break;
        }
        uint32_t x = (uint32_t)v;
        if (x > top) top = x;
        memcpy(o + 4 * n, &x, 4);
        n++;
    }
    PyBuffer_Release(&in);
    if (_PyBytes_Resize(&out, n * 4) < 0) return NULL;
    return Py_BuildValue("(NI)", out, (unsigned int)top);
fail:
    PyBuffer_Release(&in);
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"unpack_uint32", unpack_uint32, METH_O,
     "unpack_uint32(payload) -> (native uint32 bytes, max): decode packed uint32 varints"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvroute.core._wire",
    "Protobuf packed-varint decoding in C (see core/wire.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__wire(void) { return PyModule_Create(&module); }
