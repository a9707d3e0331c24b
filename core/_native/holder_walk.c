/* The routing walk (see holders.h): each slot's leading run of keys held, really or by
 * prediction, over a prompt's block keys. */
#include "holders.h"

/* Keys a walk reads at a time: their entries requested at once, then found, then stepped. */
#define WALK_CHUNK 64

/* out[slot] = depth (out[names[slot]] with names) for every set bit of words (width of
 * them). */
static int record(PyObject *out, const uint64_t *words, size_t width, Py_ssize_t depth,
                  PyObject *names) {
    PyObject *d = PyLong_FromSsize_t(depth);
    if (d == NULL) return -1;
    for (size_t w = 0; w < width; w++) {
        uint64_t x = words[w];
        while (x) {
            size_t slot = w * 64 + (size_t)__builtin_ctzll(x);
            x &= x - 1;
            PyObject *s;
            if (names != NULL) {
                if ((Py_ssize_t)slot >= PyList_GET_SIZE(names)) {
                    PyErr_Format(PyExc_IndexError, "no name for slot %zu", slot);
                    s = NULL;
                } else {
                    s = PyList_GET_ITEM(names, (Py_ssize_t)slot);
                    Py_INCREF(s);
                }
            } else {
                s = PyLong_FromSize_t(slot);
            }
            if (s == NULL || PyDict_SetItem(out, s, d) < 0) {
                Py_XDECREF(s);
                Py_DECREF(d);
                return -1;
            }
            Py_DECREF(s);
        }
    }
    Py_DECREF(d);
    return 0;
}

/* Request e's heap holders (its list, or the mask of every holder the walk reads). */
static inline void prefetch_holders(const Entry *e) {
    if (e == NULL || !on_heap(e)) return;
    const char *p = (const char *)e->u.list;
    size_t bytes = is_mask(e) ? (e->kind & ~MASK) * sizeof(uint64_t) : e->n * sizeof(uint32_t);
    for (size_t off = 0; off < bytes && off < 1024; off += 64) __builtin_prefetch(p + off);
}

/* One step: keep = active & holders(e) (none if e is NULL: a key nobody holds); the
 * slots dropped are recorded at depth; then active = keep (by swapping the buffers).
 * 1: some slot still holds every key so far, 0: none, -1: error. */
static int step(const Entry *e, uint64_t **active, uint64_t **keep, size_t width,
                Py_ssize_t depth, PyObject *out, PyObject *names) {
    uint64_t *a = *active, *k = *keep, any_left = 0, any_dropped = 0;
    if (e == NULL) memset(k, 0, width * sizeof(uint64_t));
    else intersect(e, a, k, width);
    for (size_t w = 0; w < width; w++) {
        any_left |= k[w];
        any_dropped |= a[w] & ~k[w];
        a[w] &= ~k[w]; /* a: the dropped slots now */
    }
    if (any_dropped && record(out, a, width, depth, names) < 0) return -1;
    *active = k;
    *keep = a;
    return any_left != 0;
}

PyObject *HolderMap_walk(HolderMap *m, PyObject *args) {
    PyObject *keys, *names = Py_None;
    if (!PyArg_ParseTuple(args, "O|O", &keys, &names)) return NULL;
    if (names == Py_None) {
        names = NULL;
    } else if (!PyList_Check(names)) {
        PyErr_SetString(PyExc_TypeError, "names must be a list (slot -> name)");
        return NULL;
    }
    KeyIter ki;
    uint64_t *arr = NULL;
    Py_ssize_t n = 0;
    int listed = PyList_CheckExact(keys) || PyTuple_CheckExact(keys);
    memset(&ki, 0, sizeof(ki));
    if (listed ? (arr = keys_all(keys, &n, -1)) == NULL : keys_open(&ki, keys) < 0)
        return NULL;
    PyObject *out = PyDict_New();
    size_t width = m->width ? m->width : 1;
    uint64_t stack[2 * 32];
    uint64_t *buf = width <= 32 ? stack : PyMem_Malloc(2 * width * sizeof(uint64_t));
    if (out == NULL || buf == NULL) goto fail;
    uint64_t *active = buf, *keep = buf + width;
    uint64_t k;
    int rc = listed ? n > 0 : keys_next(&ki, &k);
    if (rc < 0) goto fail;
    if (rc == 0) goto done;
    if (listed) k = arr[0];
    const Entry *e = find(m, k);
    if (e == NULL) goto done;
    memset(active, 0xff, width * sizeof(uint64_t));
    memcpy(keep, active, width * sizeof(uint64_t));
    intersect(e, keep, active, width); /* active = every holder of the first key */
    Py_ssize_t depth = 1;
    if (listed) {
        /* A chunk of keys at a time: their entries requested at once, then found (the
         * first waits, the others arrive meanwhile) with their holders requested, then
         * stepped. Each miss overlaps the chunk's others, and a walk that stops early
         * has requested less than a chunk past its end. */
        const Entry *ents[WALK_CHUNK];
        for (Py_ssize_t base = 1; base < n; base += WALK_CHUNK) {
            Py_ssize_t end = n - base > WALK_CHUNK ? base + WALK_CHUNK : n;
            for (Py_ssize_t i = base; i < end; i++) prefetch_key(m, arr[i]);
            for (Py_ssize_t i = base; i < end; i++)
                prefetch_holders(ents[i - base] = find(m, arr[i]));
            for (Py_ssize_t i = base; i < end; i++) {
                rc = step(ents[i - base], &active, &keep, width, depth, out, names);
                if (rc <= 0) goto done_or_fail;
                depth++;
            }
        }
    } else {
        while ((rc = keys_next(&ki, &k)) == 1) {
            rc = step(find(m, k), &active, &keep, width, depth, out, names);
            if (rc <= 0) goto done_or_fail;
            depth++;
        }
        if (rc < 0) goto fail;
    }
    if (record(out, active, width, depth, names) < 0) goto fail;
    goto done;
done_or_fail:
    if (rc < 0) goto fail;
done:
    if (buf != stack) PyMem_Free(buf);
    PyMem_Free(arr);
    keys_close(&ki);
    return out;
fail:
    if (buf != stack && buf != NULL) PyMem_Free(buf);
    PyMem_Free(arr);
    keys_close(&ki);
    Py_XDECREF(out);
    return NULL;
}
