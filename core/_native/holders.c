/* kvroute holder map in C: block key -> bitmask of the worker slots holding it.
 *
 * The same map as kvroute/core/holders.py's DictHolders, laid out for the routing walk:
 * one open-addressing table (linear probing, backward-shift deletion, load <= 1/2) whose
 * entries are the 64-bit key followed by the mask's 64-bit words, inline. A lookup reads
 * one entry, usually one cache line; a Python dict lookup reads the hash index, the entry,
 * the stored key object and the mask int object, each a cache miss on a 1M-key index.
 *
 * Invariants:
 *   - an entry is empty iff its mask words are all 0 (a key with no holder is deleted), so
 *     every 64-bit key, 0 included, can be stored and no sentinel key is needed;
 *   - cap is 0 or a power of two, and used * 2 <= cap;
 *   - for every stored key, the entries from its home slot up to its own are all occupied
 *     (linear probing; deletion shifts later entries back to keep this true);
 *   - width (mask words per entry) only grows, when a slot >= 64 * width is set.
 *
 * Keys are ints in [0, 2**64) (OverflowError/TypeError otherwise, before any change for
 * a bad key). Every method runs with the GIL held and calls no Python code mid-update.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    uint64_t *tab; /* cap entries of (1 + width) words: key, then mask words (low first) */
    size_t cap;
    size_t used;
    size_t width;
    int shift; /* 64 - log2(cap): the home slot is the top bits of a multiplicative hash */
} HolderMap;

#define MIN_CAP 64

static inline size_t stride(const HolderMap *m) { return 1 + m->width; }

static inline uint64_t *entry(const HolderMap *m, size_t i) {
    return m->tab + i * stride(m);
}

static inline int is_empty(const uint64_t *e, size_t width) {
    for (size_t w = 1; w <= width; w++)
        if (e[w]) return 0;
    return 1;
}

static inline size_t home(const HolderMap *m, uint64_t key) {
    /* Fibonacci hashing: block keys are already uniform, but tests and callers may use
     * small sequential ints, which must not pile into one run. */
    return (size_t)((key * 0x9E3779B97F4A7C15ULL) >> m->shift);
}

/* The entry holding key, or NULL. */
static uint64_t *find(const HolderMap *m, uint64_t key) {
    if (m->cap == 0) return NULL;
    size_t mask = m->cap - 1;
    for (size_t i = home(m, key);; i = (i + 1) & mask) {
        uint64_t *e = entry(m, i);
        if (is_empty(e, m->width)) return NULL;
        if (e[0] == key) return e;
    }
}

/* Re-lay the table at new_cap entries of new_width mask words. */
static int relayout(HolderMap *m, size_t new_cap, size_t new_width) {
    size_t new_stride = 1 + new_width;
    uint64_t *fresh = PyMem_RawCalloc(new_cap, new_stride * sizeof(uint64_t));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int new_shift = 64;
    for (size_t c = new_cap; c > 1; c >>= 1) new_shift--;
    HolderMap next = *m;
    next.tab = fresh;
    next.cap = new_cap;
    next.width = new_width;
    next.shift = new_shift;
    size_t nmask = new_cap - 1;
    for (size_t i = 0; i < m->cap; i++) {
        uint64_t *e = entry(m, i);
        if (is_empty(e, m->width)) continue;
        size_t j = home(&next, e[0]);
        while (!is_empty(entry(&next, j), new_width)) j = (j + 1) & nmask;
        memcpy(entry(&next, j), e, (1 + m->width) * sizeof(uint64_t));
    }
    PyMem_RawFree(m->tab);
    m->tab = fresh;
    m->cap = new_cap;
    m->width = new_width;
    m->shift = new_shift;
    return 0;
}

/* The entry for key, inserted (mask 0, so still "empty" until a bit is set) if absent.
 * The caller sets a bit at once, before any other call. */
static uint64_t *find_or_insert(HolderMap *m, uint64_t key, int *inserted) {
    if ((m->used + 1) * 2 > m->cap) {
        if (relayout(m, m->cap ? m->cap * 2 : MIN_CAP, m->width ? m->width : 1) < 0)
            return NULL;
    }
    size_t mask = m->cap - 1;
    for (size_t i = home(m, key);; i = (i + 1) & mask) {
        uint64_t *e = entry(m, i);
        if (is_empty(e, m->width)) {
            e[0] = key;
            *inserted = 1;
            return e;
        }
        if (e[0] == key) {
            *inserted = 0;
            return e;
        }
    }
}

/* Delete the (now all-zero) entry at e, shifting later entries of its run back. */
static void erase(HolderMap *m, uint64_t *e) {
    size_t mask = m->cap - 1, s = stride(m);
    size_t i = (size_t)(e - m->tab) / s;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        uint64_t *ej = entry(m, j);
        if (is_empty(ej, m->width)) break;
        size_t h = home(m, ej[0]);
        /* ej may fill the hole at i iff i lies on its probe path: h .. j (cyclically). */
        if (((j - h) & mask) >= ((j - i) & mask)) {
            memcpy(entry(m, i), ej, s * sizeof(uint64_t));
            i = j;
        }
    }
    memset(entry(m, i), 0, s * sizeof(uint64_t));
    m->used--;
}

/* Keys from a list/tuple (read in place) or any iterable (consumed lazily). */
typedef struct {
    PyObject *seq, *it;
    PyObject **items;
    Py_ssize_t i, n;
} KeyIter;

static int keys_open(KeyIter *ki, PyObject *obj) {
    memset(ki, 0, sizeof(*ki));
    if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) {
        ki->seq = PySequence_Fast(obj, "keys");
        if (ki->seq == NULL) return -1;
        ki->items = PySequence_Fast_ITEMS(ki->seq);
        ki->n = PySequence_Fast_GET_SIZE(ki->seq);
        return 0;
    }
    ki->it = PyObject_GetIter(obj);
    return ki->it ? 0 : -1;
}

static void keys_close(KeyIter *ki) {
    Py_XDECREF(ki->seq);
    Py_XDECREF(ki->it);
}

static int as_key(PyObject *obj, uint64_t *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "block keys are ints, got %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_SetString(PyExc_OverflowError, "block keys are ints in [0, 2**64)");
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

/* 1: *out set; 0: no more keys; -1: error. */
static int keys_next(KeyIter *ki, uint64_t *out) {
    if (ki->items != NULL || ki->seq != NULL) {
        if (ki->i >= ki->n) return 0;
        return as_key(ki->items[ki->i++], out) < 0 ? -1 : 1;
    }
    PyObject *obj = PyIter_Next(ki->it);
    if (obj == NULL) return PyErr_Occurred() ? -1 : 0;
    int rc = as_key(obj, out);
    Py_DECREF(obj);
    return rc < 0 ? -1 : 1;
}

/* The keys of a list/tuple converted up front, so a bad key raises before any change. */
static uint64_t *keys_all(PyObject *obj, Py_ssize_t *n) {
    PyObject *seq = PySequence_Fast(obj, "keys must be an iterable of ints");
    if (seq == NULL) return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    uint64_t *out = PyMem_Malloc((size_t)(*n ? *n : 1) * sizeof(uint64_t));
    if (out == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < *n; i++) {
        if (as_key(items[i], &out[i]) < 0) {
            PyMem_Free(out);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    return out;
}

static int check_slot(Py_ssize_t slot) {
    if (slot < 0 || slot >= (1 << 20)) {
        PyErr_Format(PyExc_ValueError, "slot must be in [0, 2**20), got %zd", slot);
        return -1;
    }
    return 0;
}

/* The (keys, slot) arguments of set_bit and clear_bit: every key converted (so a bad one
 * raises before any change), and the slot's mask word and bit. Returns the keys (free them
 * with PyMem_Free) or NULL on error. */
static uint64_t *bit_args(PyObject *args, Py_ssize_t *n, size_t *word, uint64_t *bit) {
    PyObject *keys;
    Py_ssize_t slot;
    if (!PyArg_ParseTuple(args, "On", &keys, &slot) || check_slot(slot) < 0) return NULL;
    *word = (size_t)slot / 64;
    *bit = 1ULL << (slot % 64);
    return keys_all(keys, n);
}

static PyObject *HolderMap_set_bit(HolderMap *m, PyObject *args) {
    Py_ssize_t n;
    size_t word;
    uint64_t bit;
    uint64_t *ks = bit_args(args, &n, &word, &bit);
    if (ks == NULL) return NULL;
    if (word >= m->width && relayout(m, m->cap ? m->cap : MIN_CAP, word + 1) < 0) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        int inserted;
        uint64_t *e = find_or_insert(m, ks[i], &inserted);
        if (e == NULL) goto fail;
        e[1 + word] |= bit;
        m->used += (size_t)inserted;
    }
    PyMem_Free(ks);
    Py_RETURN_NONE;
fail:
    PyMem_Free(ks);
    return NULL;
}

static PyObject *HolderMap_clear_bit(HolderMap *m, PyObject *args) {
    Py_ssize_t n;
    size_t word;
    uint64_t bit;
    uint64_t *ks = bit_args(args, &n, &word, &bit);
    if (ks == NULL) return NULL;
    for (Py_ssize_t i = 0; word < m->width && i < n; i++) {
        uint64_t *e = find(m, ks[i]);
        if (e == NULL) continue;
        e[1 + word] &= ~bit;
        if (is_empty(e, m->width)) erase(m, e);
    }
    PyMem_Free(ks);
    Py_RETURN_NONE;
}

/* out[slot] = depth for every set bit of words (width of them). */
static int record(PyObject *out, const uint64_t *words, size_t width, Py_ssize_t depth) {
    PyObject *d = PyLong_FromSsize_t(depth);
    if (d == NULL) return -1;
    for (size_t w = 0; w < width; w++) {
        uint64_t x = words[w];
        while (x) {
            int b = __builtin_ctzll(x);
            x &= x - 1;
            PyObject *s = PyLong_FromSize_t(w * 64 + (size_t)b);
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

/* The walk over keys[0..n) held in an array: the same steps as over an iterator, with the
 * entries PREFETCH keys ahead requested early, so that the table's cache misses (most of a
 * cold walk's time) overlap instead of following one another. */
#define PREFETCH 8

static inline void prefetch_key(const HolderMap *m, uint64_t key) {
    __builtin_prefetch(entry(m, home(m, key)));
}

/* One step of the walk: active &= holders(key); the bits dropped are recorded at depth.
 * Returns 1 if some slot still holds every key so far, 0 if none, -1 on error. */
static int step(const HolderMap *m, uint64_t key, uint64_t *active, uint64_t *dropped,
                size_t width, Py_ssize_t depth, PyObject *out) {
    const uint64_t *e = find(m, key);
    uint64_t any_left = 0, any_dropped = 0;
    for (size_t w = 0; w < width; w++) {
        uint64_t keep = e ? active[w] & e[1 + w] : 0;
        dropped[w] = active[w] & ~keep;
        any_dropped |= dropped[w];
        any_left |= keep;
        active[w] = keep;
    }
    if (any_dropped && record(out, dropped, width, depth) < 0) return -1;
    return any_left != 0;
}

static PyObject *HolderMap_walk(HolderMap *m, PyObject *keys) {
    KeyIter ki;
    uint64_t *arr = NULL;
    Py_ssize_t n = 0;
    int listed = PyList_CheckExact(keys) || PyTuple_CheckExact(keys);
    memset(&ki, 0, sizeof(ki));
    if (listed ? (arr = keys_all(keys, &n)) == NULL : keys_open(&ki, keys) < 0) return NULL;
    PyObject *out = PyDict_New();
    size_t width = m->width;
    uint64_t stack[8];
    uint64_t *buf = width <= 4 ? stack : PyMem_Malloc(2 * width * sizeof(uint64_t));
    if (out == NULL || buf == NULL) goto fail;
    uint64_t *active = buf, *dropped = buf + width;
    uint64_t k;
    int rc = listed ? n > 0 : keys_next(&ki, &k);
    if (rc < 0) goto fail;
    if (rc == 0) goto done;
    if (listed) {
        k = arr[0];
        for (Py_ssize_t i = 1; i < n && i <= PREFETCH; i++) prefetch_key(m, arr[i]);
    }
    const uint64_t *e = find(m, k);
    if (e == NULL) goto done;
    memcpy(active, e + 1, width * sizeof(uint64_t));
    Py_ssize_t depth = 1;
    if (listed) {
        for (Py_ssize_t i = 1; i < n; i++) {
            if (i + PREFETCH < n) prefetch_key(m, arr[i + PREFETCH]);
            rc = step(m, arr[i], active, dropped, width, depth, out);
            if (rc <= 0) goto done_or_fail;
            depth++;
        }
    } else {
        while ((rc = keys_next(&ki, &k)) == 1) {
            rc = step(m, k, active, dropped, width, depth, out);
            if (rc <= 0) goto done_or_fail;
            depth++;
        }
        if (rc < 0) goto fail;
    }
    if (record(out, active, width, depth) < 0) goto fail;
    goto done;
done_or_fail:
    if (rc < 0) goto fail;
done:
    if (buf != stack) PyMem_Free(buf);
    PyMem_Free(arr);
    keys_close(&ki);
    return out;
fail:
    if (buf != stack) PyMem_Free(buf);
    PyMem_Free(arr);
    keys_close(&ki);
    Py_XDECREF(out);
    return NULL;
}

static PyObject *HolderMap_get(HolderMap *m, PyObject *key) {
    uint64_t k;
    if (as_key(key, &k) < 0) return NULL;
    const uint64_t *e = find(m, k);
    PyObject *acc = PyLong_FromLong(0);
    if (e == NULL || acc == NULL) return acc;
    PyObject *sixty_four = PyLong_FromLong(64);
    if (sixty_four == NULL) goto fail;
    for (size_t w = m->width; w-- > 0;) {
        PyObject *shifted = PyNumber_Lshift(acc, sixty_four);
        Py_DECREF(acc);
        acc = shifted;
        if (acc == NULL) break;
        PyObject *word = PyLong_FromUnsignedLongLong(e[1 + w]);
        PyObject *merged = word ? PyNumber_Or(acc, word) : NULL;
        Py_XDECREF(word);
        Py_DECREF(acc);
        acc = merged;
        if (acc == NULL) break;
    }
    Py_DECREF(sixty_four);
    return acc;
fail:
    Py_DECREF(acc);
    return NULL;
}

static Py_ssize_t HolderMap_len(HolderMap *m) { return (Py_ssize_t)m->used; }

static PyObject *HolderMap_nbytes(HolderMap *m, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(m->cap * stride(m) * sizeof(uint64_t));
}

static PyObject *HolderMap_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "HolderMap() takes no arguments");
        return NULL;
    }
    HolderMap *m = (HolderMap *)type->tp_alloc(type, 0);
    return (PyObject *)m; /* tab NULL, cap 0, used 0, width 0 */
}

static void HolderMap_dealloc(HolderMap *m) {
    PyMem_RawFree(m->tab);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyMethodDef HolderMap_methods[] = {
    {"set_bit", (PyCFunction)HolderMap_set_bit, METH_VARARGS,
     "set_bit(keys, slot): mark slot as a holder of every key"},
    {"clear_bit", (PyCFunction)HolderMap_clear_bit, METH_VARARGS,
     "clear_bit(keys, slot): unmark slot on every key; a key left with no holder is deleted"},
    {"walk", (PyCFunction)HolderMap_walk, METH_O,
     "walk(keys) -> {slot: depth}: the longest run of leading keys each slot holds, for "
     "slots holding the first key; stops consuming keys at the first no such slot holds"},
    {"get", (PyCFunction)HolderMap_get, METH_O, "get(key) -> int: the holder bitmask (0: none)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef HolderMap_getset[] = {
    {"nbytes", (getter)HolderMap_nbytes, NULL, "bytes of the table", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods HolderMap_as_sequence = {
    .sq_length = (lenfunc)HolderMap_len,
};

static PyTypeObject HolderMapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvroute.core._holders.HolderMap",
    .tp_doc = "Block key -> bitmask of holder slots, in one open-addressing table.",
    .tp_basicsize = sizeof(HolderMap),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = HolderMap_new,
    .tp_dealloc = (destructor)HolderMap_dealloc,
    .tp_methods = HolderMap_methods,
    .tp_getset = HolderMap_getset,
    .tp_as_sequence = &HolderMap_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_holders",
    "C holder map for kvroute.core.index (see kvroute/core/holders.py).", -1, NULL,
};

PyMODINIT_FUNC PyInit__holders(void) {
    if (PyType_Ready(&HolderMapType) < 0) return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL) return NULL;
    Py_INCREF(&HolderMapType);
    if (PyModule_AddObject(mod, "HolderMap", (PyObject *)&HolderMapType) < 0) {
        Py_DECREF(&HolderMapType);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
