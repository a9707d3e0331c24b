/* The kvroute policy's per-worker sums over the router's load columns, in one pass each:
 * the same operations, in the same order, as the numpy expressions of
 * kvroute.core.policies.columns (the fallback, and the reference this is tested against
 * bit for bit; built with -ffp-contract=off so that no multiply-add is fused).
 *
 * queued(pending, budget, context, attn, out)
 *   out[i] = queued_wait of worker i: pending + attn * context, less half an iteration.
 * costs(queued, budget, busy, capacity, cached, c, out, p, bs, attn, decode, k, wait_avg,
 *       reuse, top)
 *   out[i] = score_w of worker i but for the lower tier's load term (docs/policy.md).
 *
 * cached(matched, rows, out, block_size, prompt_tokens)
 *   out[rows[w]] = min(blocks * block_size, prompt_tokens) for each (w, blocks) of the dict
 *   matched whose w is a key of the dict rows (the others: not candidates, left out).
 * kth(values, k) -> the k-th smallest of values (0-based, k < HEAD_MAX), as
 *   numpy.partition(values, k)[k] gives it for values with no NaN.
 *
 * Every array: float64, contiguous, one value per worker, all of the same length.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define MAX_ARRAYS 8

typedef struct {
    Py_buffer b[MAX_ARRAYS];
    int held;
} Buffers;

static void release(Buffers *bs) {
    for (int i = 0; i < bs->held; i++) PyBuffer_Release(&bs->b[i]);
    bs->held = 0;
}

/* Take arrays[0..n) as float64 buffers of one length (the last `writable` of them written);
 * their length in values, or -1 with an exception set. */
static Py_ssize_t take(Buffers *bs, PyObject **arrays, int n, int writable) {
    Py_ssize_t len = -1;
    for (int i = 0; i < n; i++) {
        int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (i >= n - writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(arrays[i], &bs->b[i], flags) < 0) {
            release(bs);
            return -1;
        }
        bs->held = i + 1;
        Py_buffer *b = &bs->b[i];
        if (b->itemsize != 8 || b->format == NULL || strcmp(b->format, "d") != 0) {
            PyErr_SetString(PyExc_TypeError, "arrays must be float64");
            release(bs);
            return -1;
        }
        Py_ssize_t m = b->len / 8;
        if (len >= 0 && m != len) {
            PyErr_SetString(PyExc_ValueError, "arrays must have one length");
            release(bs);
            return -1;
        }
        len = m;
    }
    return len;
}

static PyObject *queued(PyObject *self, PyObject *args) {
    PyObject *a[4];
    double attn;
    if (!PyArg_ParseTuple(args, "OOOdO", &a[0], &a[1], &a[2], &attn, &a[3])) return NULL;
    Buffers bs = {.held = 0};
    Py_ssize_t n = take(&bs, a, 4, 1);
    if (n < 0) return NULL;
    const double *pending = bs.b[0].buf, *budget = bs.b[1].buf, *context = bs.b[2].buf;
    double *out = bs.b[3].buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        double pd = pending[i], bu = budget[i];
        double q = pd + attn * context[i];
        if (pd > 0) {
            /* elapsed: half the first iteration, a budget's worth of a longer queue */
            double part = (bu > 0 && bu < pd) ? bu / pd : 1.0;
            q = q - 0.5 * q * part;
        }
        out[i] = q;
    }
    release(&bs);
    Py_RETURN_NONE;
}

static PyObject *costs(PyObject *self, PyObject *args) {
    PyObject *a[7];
    double p, bs_, attn, decode, k, wait_avg, reuse, top;
    if (!PyArg_ParseTuple(args, "OOOOOOOdddddddd", &a[0], &a[1], &a[2], &a[3], &a[4], &a[5],
                          &a[6], &p, &bs_, &attn, &decode, &k, &wait_avg, &reuse, &top))
        return NULL;
    Buffers bs = {.held = 0};
    Py_ssize_t n = take(&bs, a, 7, 1);
    if (n < 0) return NULL;
    const double *queued = bs.b[0].buf, *budget = bs.b[1].buf, *busy = bs.b[2].buf,
                 *capacity = bs.b[3].buf, *cached = bs.b[4].buf, *c = bs.b[5].buf;
    double *out = bs.b[6].buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        double ci = c[i], bu = budget[i], cap = capacity[i];
        double m = p - ci;
        double own = m * (1.0 + attn * (ci + m / 2.0));
        double first = queued[i] + own;
        double iterations = bu != 0 ? 1.0 + first / bu : 1.0;
        double cost = busy[i] > 0 ? first + decode * busy[i] * iterations : first;
        cost = cost + (own * k * wait_avg + own * k * (own / 2.0));
        double room = (cap - cached[i]) * bs_;
        double evicted = m - (room > 0.0 ? room : 0.0);
        if (ci < top && cap > 0 && evicted > 0) {
            double dup = top - ci;
            cost = cost + reuse * (dup < evicted ? dup : evicted);
        }
        out[i] = cost;
    }
    release(&bs);
    Py_RETURN_NONE;
}

static PyObject *cached(PyObject *self, PyObject *args) {
    PyObject *matched, *rows, *a[1];
    double bs_, p;
    if (!PyArg_ParseTuple(args, "O!O!Odd", &PyDict_Type, &matched, &PyDict_Type, &rows, &a[0],
                          &bs_, &p))
        return NULL;
    Buffers bs = {.held = 0};
    Py_ssize_t n = take(&bs, a, 1, 1);
    if (n < 0) return NULL;
    double *out = bs.b[0].buf;
    Py_ssize_t pos = 0;
    PyObject *w, *blocks;
    while (PyDict_Next(matched, &pos, &w, &blocks)) {
        PyObject *row = PyDict_GetItemWithError(rows, w);
        if (row == NULL) {
            if (PyErr_Occurred()) goto fail;
            continue; /* no row: not a candidate */
        }
        Py_ssize_t i = PyLong_AsSsize_t(row);
        double b = PyFloat_AsDouble(blocks);
        if ((i == -1 || b == -1.0) && PyErr_Occurred()) goto fail;
        if (i < 0 || i >= n) {
            PyErr_Format(PyExc_IndexError, "row %zd of %zd", i, n);
            goto fail;
        }
        double v = b * bs_;
        out[i] = p < v ? p : v; /* numpy.minimum(v, p) for values with no NaN */
    }
    release(&bs);
    Py_RETURN_NONE;
fail:
    release(&bs);
    return NULL;
}

#define HEAD_MAX 64

static PyObject *kth(PyObject *self, PyObject *args) {
    PyObject *a[1];
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "On", &a[0], &k)) return NULL;
    Buffers bs = {.held = 0};
    Py_ssize_t n = take(&bs, a, 1, 0);
    if (n < 0) return NULL;
    if (k < 0 || k >= n || k >= HEAD_MAX) {
        release(&bs);
        PyErr_Format(PyExc_ValueError, "k=%zd out of range for %zd values (at most %d)", k, n,
                     HEAD_MAX - 1);
        return NULL;
    }
    /* the k + 1 smallest so far, ascending: one pass, an insertion only for a value below
     * the largest kept (over 1,000 workers, a few dozen) */
    const double *v = bs.b[0].buf;
    double low[HEAD_MAX];
    Py_ssize_t kept = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double x = v[i];
        if (kept == k + 1 && !(x < low[k])) continue;
        Py_ssize_t j = kept == k + 1 ? k : kept++;
        while (j > 0 && low[j - 1] > x) {
            low[j] = low[j - 1];
            j--;
        }
        low[j] = x;
    }
    release(&bs);
    return PyFloat_FromDouble(low[k]);
}

static PyMethodDef methods[] = {
    {"queued", queued, METH_VARARGS, "queued(pending, budget, context, attn, out)"},
    {"costs", costs, METH_VARARGS,
     "costs(queued, budget, busy, capacity, cached, c, out, p, bs, attn, decode, k, "
     "wait_avg, reuse, top)"},
    {"cached", cached, METH_VARARGS, "cached(matched, rows, out, block_size, prompt_tokens)"},
    {"kth", kth, METH_VARARGS, "kth(values, k) -> the k-th smallest (0-based)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvroute.core._costs",
    "The kvroute policy's per-worker sums over load columns (see costs.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__costs(void) { return PyModule_Create(&module); }
