/* kvroute holder map in C: the Python type HolderMap and its module (see holders.h for the
 * map's layout and invariants, holder_table.c and holder_walk.c for the rest). */
#include "holders.h"

/* -- Python arguments ----------------------------------------------------------------- */

int keys_open(KeyIter *ki, PyObject *obj) {
    memset(ki, 0, sizeof(*ki));
    ki->it = PyObject_GetIter(obj);
    return ki->it ? 0 : -1;
}

void keys_close(KeyIter *ki) {
    Py_XDECREF(ki->seq);
    Py_XDECREF(ki->it);
}

static int as_key(PyObject *obj, uint64_t *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "block keys are ints, got %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    /* Range-checked by sign and bit count, then read by the masking conversion: the
     * checked one copies through a byte array: a sixth of a walk over cached entries. */
    size_t bits = _PyLong_NumBits(obj);
    if (_PyLong_Sign(obj) < 0 || bits > 64) {
        if (bits == (size_t)-1) PyErr_Clear();
        PyErr_SetString(PyExc_OverflowError, "block keys are ints in [0, 2**64)");
        return -1;
    }
    *out = (uint64_t)PyLong_AsUnsignedLongLongMask(obj);
    return 0;
}

/* 1: *out set; 0: no more keys; -1: error. */
int keys_next(KeyIter *ki, uint64_t *out) {
    PyObject *obj = PyIter_Next(ki->it);
    if (obj == NULL) return PyErr_Occurred() ? -1 : 0;
    int rc = as_key(obj, out);
    Py_DECREF(obj);
    return rc < 0 ? -1 : 1;
}

/* The first `limit` (all if < 0) keys of an iterable, converted up front, so a bad key
 * raises before any change. Free with PyMem_Free. */
uint64_t *keys_all(PyObject *obj, Py_ssize_t *n, Py_ssize_t limit) {
    PyObject *seq = PySequence_Fast(obj, "keys must be an iterable of ints");
    if (seq == NULL) return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    if (limit >= 0 && limit < *n) *n = limit;
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
    if (slot < 0 || slot >= MAX_SLOT) {
        PyErr_Format(PyExc_ValueError, "slot must be in [0, 2**20), got %zd", slot);
        return -1;
    }
    return 0;
}

/* (keys, slot) arguments: every key converted first. NULL on error. */
static uint64_t *key_slot_args(PyObject *args, Py_ssize_t *n, uint32_t *slot) {
    PyObject *keys;
    Py_ssize_t s;
    if (!PyArg_ParseTuple(args, "On", &keys, &s) || check_slot(s) < 0) return NULL;
    *slot = (uint32_t)s;
    return keys_all(keys, n, -1);
}

/* -- methods -------------------------------------------------------------------------- */

static PyObject *HolderMap_add(HolderMap *m, PyObject *args) {
    Py_ssize_t n;
    uint32_t slot;
    uint64_t *ks = key_slot_args(args, &n, &slot);
    if (ks == NULL) return NULL;
    int rc = add_keys(m, ks, n, slot);
    PyMem_Free(ks);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* The keys of one bytes object of whole 8-byte big-endian keys (a snapshot read as one
 * blob), or NULL with ValueError before any change. */
static uint64_t *blob_keys(PyObject *blob, Py_ssize_t *n) {
    Py_ssize_t len = PyBytes_GET_SIZE(blob);
    if (len % 8) {
        PyErr_Format(PyExc_ValueError, "snapshot blob of %zd bytes is not whole 8-byte keys",
                     len);
        return NULL;
    }
    *n = len / 8;
    uint64_t *ks = PyMem_Malloc((size_t)(*n ? *n : 1) * sizeof(uint64_t));
    if (ks == NULL) return (uint64_t *)PyErr_NoMemory();
    const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(blob);
    for (Py_ssize_t i = 0; i < *n; i++, b += 8) {
        uint64_t k = 0;
        for (int j = 0; j < 8; j++) k = k << 8 | b[j];
        ks[i] = k;
    }
    return ks;
}

static PyObject *add_keys_of(HolderMap *m, uint64_t *ks, Py_ssize_t n, uint32_t s,
                             int replace) {
    int rc = replace ? clear_slot(m, s) : 0;
    rc = rc < 0 ? rc : add_keys(m, ks, n, s);
    PyMem_Free(ks);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* add_packed(members, slot[, replace]): add of keys each packed as 8 bytes, big-endian (a
 * snapshot's members as read from Redis: a sequence of 8-byte members, or one bytes object
 * of them end to end), decoded here rather than into int objects first. */
static PyObject *HolderMap_add_packed(HolderMap *m, PyObject *args) {
    PyObject *members;
    Py_ssize_t s;
    int replace = 0;
    if (!PyArg_ParseTuple(args, "On|p", &members, &s, &replace) || check_slot(s) < 0)
        return NULL;
    if (PyBytes_Check(members)) {
        Py_ssize_t n;
        uint64_t *ks = blob_keys(members, &n);
        return ks == NULL ? NULL : add_keys_of(m, ks, n, (uint32_t)s, replace);
    }
    PyObject *seq = PySequence_Fast(members, "members must be an iterable of bytes");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint64_t *ks = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    if (ks == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* every member checked before any change */
        if (!PyBytes_Check(items[i]) || PyBytes_GET_SIZE(items[i]) != 8) {
            if (PyBytes_Check(items[i]))
                PyErr_Format(PyExc_ValueError, "snapshot member of %zd bytes is not one "
                             "8-byte key", PyBytes_GET_SIZE(items[i]));
            else
                PyErr_Format(PyExc_TypeError, "snapshot members are bytes, got %.100s",
                             Py_TYPE(items[i])->tp_name);
            PyMem_Free(ks);
            Py_DECREF(seq);
            return NULL;
        }
        const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(items[i]);
        uint64_t k = 0;
        for (int j = 0; j < 8; j++) k = k << 8 | b[j];
        ks[i] = k;
    }
    Py_DECREF(seq);
    return add_keys_of(m, ks, n, (uint32_t)s, replace);
}

static PyObject *drop_method(HolderMap *m, PyObject *args, int want) {
    Py_ssize_t n;
    uint32_t slot;
    uint64_t *ks = key_slot_args(args, &n, &slot);
    if (ks == NULL) return NULL;
    if (slot < m->ncounts) drop_keys(m, ks, n, slot, want);
    PyMem_Free(ks);
    Py_RETURN_NONE;
}

static PyObject *HolderMap_remove(HolderMap *m, PyObject *args) {
    return drop_method(m, args, REAL);
}

static PyObject *HolderMap_unpredict(HolderMap *m, PyObject *args) {
    return drop_method(m, args, PREDICTED);
}

static PyObject *HolderMap_predict(HolderMap *m, PyObject *args) {
    Py_ssize_t n;
    uint32_t slot;
    PyObject *keys;
    Py_ssize_t s;
    if (!PyArg_ParseTuple(args, "On", &keys, &s) || check_slot(s) < 0) return NULL;
    slot = (uint32_t)s;
    PyObject *seq = PySequence_Fast(keys, "keys must be an iterable of ints");
    if (seq == NULL) return NULL;
    uint64_t *ks = keys_all(seq, &n, -1);
    PyObject *out = NULL, *tmp = NULL;
    if (ks == NULL || give_slot(m, slot) < 0) goto done;
    tmp = PyList_New(0);
    if (tmp == NULL) goto done;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        Entry *e = find_or_insert(m, ks[i]);
        if (e == NULL) goto done;
        uint32_t at = 0;
        int st = e->n ? state_of(e, slot, &at) : NONE;
        if (st == REAL) continue;
        if (st == NONE && add_holder(m, e, slot, 1) < 0) {
            if (e->n == 0) erase(m, e);
            goto done;
        }
        if (PyList_Append(tmp, items[i]) < 0) goto done;
    }
    out = PyList_AsTuple(tmp);
done:
    Py_XDECREF(tmp);
    PyMem_Free(ks);
    Py_DECREF(seq);
    return out;
}

static PyObject *HolderMap_holds(HolderMap *m, PyObject *args) {
    PyObject *key;
    Py_ssize_t s;
    uint64_t k;
    if (!PyArg_ParseTuple(args, "On", &key, &s) || check_slot(s) < 0 || as_key(key, &k) < 0)
        return NULL;
    Entry *e = find(m, k);
    uint32_t at;
    return PyBool_FromLong(e != NULL && state_of(e, (uint32_t)s, &at) == REAL);
}

/* The number of leading keys of keys[:limit] whose state on the slot is (real == want_real):
 * leading() counts those it really holds, first_held() those it does not. */
static PyObject *leading_run(HolderMap *m, PyObject *args, int want_real) {
    PyObject *keys;
    Py_ssize_t limit, s, n;
    if (!PyArg_ParseTuple(args, "Onn", &keys, &limit, &s) || check_slot(s) < 0) return NULL;
    if (limit < 0) { /* as keys[:limit] */
        Py_ssize_t len = PyObject_Length(keys);
        if (len < 0) return NULL;
        limit = len + limit > 0 ? len + limit : 0;
    }
    uint64_t *ks = keys_all(keys, &n, limit);
    if (ks == NULL) return NULL;
    Py_ssize_t run = 0;
    for (; run < n; run++) {
        Entry *e = find(m, ks[run]);
        uint32_t at;
        int real = e != NULL && state_of(e, (uint32_t)s, &at) == REAL;
        if (real != want_real) break;
    }
    PyMem_Free(ks);
    return PyLong_FromSsize_t(run);
}

static PyObject *HolderMap_leading(HolderMap *m, PyObject *args) {
    return leading_run(m, args, 1);
}

static PyObject *HolderMap_first_held(HolderMap *m, PyObject *args) {
    return leading_run(m, args, 0);
}

static PyObject *HolderMap_count(HolderMap *m, PyObject *arg) {
    Py_ssize_t s = PyLong_AsSsize_t(arg);
    if (s == -1 && PyErr_Occurred()) return NULL;
    if (check_slot(s) < 0) return NULL;
    return PyLong_FromSize_t((size_t)s < m->ncounts ? m->counts[s] : 0);
}

static PyObject *HolderMap_entries(HolderMap *m, PyObject *unused) {
    (void)unused;
    return PyLong_FromSize_t(m->entries);
}

static PyObject *HolderMap_keys_of(HolderMap *m, PyObject *arg) {
    Py_ssize_t s = PyLong_AsSsize_t(arg);
    if ((s == -1 && PyErr_Occurred()) || check_slot(s) < 0) return NULL;
    size_t n;
    uint64_t *ks = real_keys(m, (uint32_t)s, &n);
    if (ks == NULL) return NULL;
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out != NULL && i < n; i++) {
        PyObject *k = PyLong_FromUnsignedLongLong(ks[i]);
        if (k == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, (Py_ssize_t)i, k);
    }
    PyMem_Free(ks);
    return out;
}

static PyObject *HolderMap_clear_slot(HolderMap *m, PyObject *arg) {
    Py_ssize_t s = PyLong_AsSsize_t(arg);
    if ((s == -1 && PyErr_Occurred()) || check_slot(s) < 0) return NULL;
    Py_ssize_t dropped = clear_slot(m, (uint32_t)s);
    return dropped < 0 ? NULL : PyLong_FromSsize_t(dropped);
}


static PyObject *HolderMap_get(HolderMap *m, PyObject *key) {
    uint64_t k;
    if (as_key(key, &k) < 0) return NULL;
    Entry *e = find(m, k);
    if (e == NULL) return PyLong_FromLong(0);
    size_t width = m->width;
    uint64_t *ones = PyMem_Malloc(2 * width * sizeof(uint64_t));
    if (ones == NULL) return PyErr_NoMemory();
    memset(ones, 0xff, width * sizeof(uint64_t));
    intersect(e, ones, ones + width, width);
    /* Little-endian words -> an int; on a big-endian host, swap each word's bytes. */
    unsigned char *bytes = (unsigned char *)(ones + width);
#if PY_BIG_ENDIAN
    for (size_t i = 0; i < width; i++) ones[width + i] = __builtin_bswap64(ones[width + i]);
#endif
    PyObject *out = _PyLong_FromByteArray(bytes, width * 8, 1, 0);
    PyMem_Free(ones);
    return out;
}

static Py_ssize_t HolderMap_len(HolderMap *m) { return (Py_ssize_t)m->used; }

static PyObject *HolderMap_nbytes(HolderMap *m, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(m->cap * sizeof(Entry) + m->heap_bytes +
                             m->ncounts * (3 * sizeof(size_t) + sizeof(uint64_t *)));
}

static PyObject *HolderMap_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "HolderMap() takes no arguments");
        return NULL;
    }
    return type->tp_alloc(type, 0); /* empty: tab NULL, cap 0, no slots */
}

static void HolderMap_dealloc(HolderMap *m) {
    for (size_t i = 0; i < m->cap; i++)
        if (on_heap(&m->tab[i])) PyMem_RawFree(m->tab[i].u.list);
    table_free(m->tab, m->cap);
    for (size_t i = 0; i < m->ncounts; i++) PyMem_RawFree(m->logs[i]);
    PyMem_RawFree(m->logs);
    PyMem_RawFree(m->log_len);
    PyMem_RawFree(m->log_cap);
    PyMem_RawFree(m->counts);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyMethodDef HolderMap_methods[] = {
    {"add", (PyCFunction)HolderMap_add, METH_VARARGS,
     "add(keys, slot): slot really holds every key (a prediction of it is confirmed)"},
    {"add_packed", (PyCFunction)HolderMap_add_packed, METH_VARARGS,
     "add_packed(members, slot, replace=False): add of keys packed as 8 big-endian bytes "
     "each (ValueError, before any change, for a member of another size); with replace, "
     "slot's real keys are cleared first (predictions stay)"},
    {"remove", (PyCFunction)HolderMap_remove, METH_VARARGS,
     "remove(keys, slot): slot no longer really holds the keys (predictions stay)"},
    {"predict", (PyCFunction)HolderMap_predict, METH_VARARGS,
     "predict(keys, slot) -> tuple: mark slot a predicted holder of the keys it does not "
     "really hold; returns those keys, in order"},
    {"unpredict", (PyCFunction)HolderMap_unpredict, METH_VARARGS,
     "unpredict(keys, slot): drop slot's predictions of the keys (real holders stay)"},
    {"holds", (PyCFunction)HolderMap_holds, METH_VARARGS,
     "holds(key, slot) -> bool: slot really holds key"},
    {"leading", (PyCFunction)HolderMap_leading, METH_VARARGS,
     "leading(keys, limit, slot) -> int: how many of keys[:limit] slot really holds, "
     "leading ones only"},
    {"first_held", (PyCFunction)HolderMap_first_held, METH_VARARGS,
     "first_held(keys, limit, slot) -> int: the position of the first of keys[:limit] slot "
     "really holds (their number if none)"},
    {"count", (PyCFunction)HolderMap_count, METH_O, "count(slot) -> keys slot really holds"},
    {"keys_of", (PyCFunction)HolderMap_keys_of, METH_O,
     "keys_of(slot) -> list: the keys slot really holds, sorted (from its key log)"},
    {"clear_slot", (PyCFunction)HolderMap_clear_slot, METH_O,
     "clear_slot(slot) -> int: drop every key slot really holds (from its key log); how many"},
    {"entries", (PyCFunction)HolderMap_entries, METH_NOARGS,
     "entries() -> (key, slot) pairs really held"},
    {"walk", (PyCFunction)HolderMap_walk, METH_VARARGS,
     "walk(keys, names=None) -> {slot: depth} ({names[slot]: depth} with a list of names): "
     "the longest run of leading keys each slot holds (really "
     "or predicted), for slots holding the first key; stops consuming keys at the first no "
     "such slot holds"},
    {"get", (PyCFunction)HolderMap_get, METH_O,
     "get(key) -> int: the bitmask of its holders, real or predicted (0: none)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef HolderMap_getset[] = {
    {"nbytes", (getter)HolderMap_nbytes, NULL, "bytes of the table, lists, masks, counts",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods HolderMap_as_sequence = {
    .sq_length = (lenfunc)HolderMap_len,
};

static PyTypeObject HolderMapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvroute.core._holders.HolderMap",
    .tp_doc = "Block key -> its holder slots (real or predicted), in one open-addressing "
              "table of (key, holders) entries.",
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
    "C holder map for kvroute.core.index (see core/holders.py).", -1, NULL,
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
