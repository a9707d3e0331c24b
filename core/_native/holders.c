/* kvroute holder map in C: block key -> the worker slots holding it, real or predicted.
 *
 * The same map as core/holders.py's DictHolders. Its memory is proportional to
 * (key, holder) pairs, not to keys x workers: one open-addressing table (linear probing,
 * backward-shift deletion, load <= 3/4) of 32-byte entries: the 64-bit key, its holder
 * count, and up to INLINE holders inline. A key with more holders points to a heap list of
 * up to LIST_MAX; past that, to two bitmasks as wide as the map's slots (every holder, then
 * the predicted ones): there a mask costs less than a list (<= 4 B a holder at 1,000
 * workers, <= 40 B at 10,000) and the routing walk ANDs its running set with it word by
 * word (the walk reads only the first mask). A holder in a list is a uint32: the slot, and
 * the PRED bit for a predicted (not really stored) one. Per-slot counts of real holders
 * are kept, so count/entries are O(1). Per slot, a log of the keys it was made a real
 * holder of (appended to on add, not on remove) lets keys_of and clear_slot visit only
 * those keys instead of scanning the table: a worker's clear (a new epoch, a snapshot
 * reload, its removal) costs its own keys, not the whole map's.
 *
 * Invariants:
 *   - an entry is empty iff n == 0 (a key with no holder is deleted), so every 64-bit key,
 *     0 included, can be stored and no sentinel key is needed;
 *   - cap is 0 or a power of two, and used * 4 <= cap * 3;
 *   - for every stored key, the entries from its home slot up to its own are all occupied
 *     (linear probing; deletion shifts later entries back to keep this true);
 *   - holders live inline iff n <= INLINE; on the heap, as a list (kind: its capacity,
 *     <= LIST_MAX) or as masks (kind: MASK | words per mask), and n counts them; a mask's
 *     predicted bits are a subset of its every-holder bits;
 *   - a slot holds a key at most once, either real or predicted (PRED), never both;
 *   - counts[s] is the number of keys slot s really (not PRED) holds; entries their sum;
 *   - every key slot s really holds is in logs[s] (maybe more than once, and beside keys it
 *     no longer holds); a log longer than 3 * counts[s] / 2 + LOG_SLACK after a call is
 *     compacted to the keys held, once each (if memory allows; else at a later call);
 *   - width covers every slot ever given (slot < 64 * width), so a walk's running set fits.
 *
 * Keys are ints in [0, 2**64) (OverflowError/TypeError otherwise, before any change for
 * a bad key). Every method runs with the GIL held and calls no Python code mid-update.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define INLINE 4
#define LIST_MIN 8
#define LIST_MAX 64
#define PRED 0x80000000u
#define MASK 0x80000000u
#define MAX_SLOT (1 << 20)
#define MIN_CAP 64
#define LOG_SLACK 64

typedef struct {
    uint64_t key;
    uint32_t n;    /* holders (real and predicted); 0: the entry is empty */
    uint32_t kind; /* heap only: a list's capacity, or MASK | words per mask */
    union {
        uint32_t inl[INLINE];
        uint32_t *list;
        uint64_t *mask; /* words of every holder, then words of the predicted ones */
    } u;
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *tab;
    size_t cap, used;
    int shift; /* 64 - log2(cap): the home slot is the top bits of a multiplicative hash */
    size_t width;   /* words covering every slot given */
    size_t *counts; /* ncounts slots' real holder counts */
    uint64_t **logs; /* ncounts slots' key logs, log_len[s] keys of log_cap[s] */
    size_t *log_len, *log_cap;
    size_t ncounts, entries;
    size_t heap_bytes; /* lists and masks */
} HolderMap;

enum { NONE = 0, REAL = 1, PREDICTED = 2 };

static inline size_t home(const HolderMap *m, uint64_t key) {
    /* Fibonacci hashing: block keys are already uniform, but tests and callers may use
     * small sequential ints, which must not pile into one run. */
    return (size_t)((key * 0x9E3779B97F4A7C15ULL) >> m->shift);
}

static inline int on_heap(const Entry *e) { return e->n > INLINE; }
static inline int is_mask(const Entry *e) { return on_heap(e) && (e->kind & MASK); }
static inline uint32_t *holder_list(Entry *e) { return on_heap(e) ? e->u.list : e->u.inl; }

/* The entry holding key, or NULL. */
static Entry *find(const HolderMap *m, uint64_t key) {
    if (m->cap == 0) return NULL;
    size_t mask = m->cap - 1;
    for (size_t i = home(m, key);; i = (i + 1) & mask) {
        Entry *e = &m->tab[i];
        if (e->n == 0) return NULL;
        if (e->key == key) return e;
    }
}

/* A table of HUGE_MIN bytes or more is mapped on its own and offered transparent huge
 * pages: a walk probes random entries of a table of up to hundreds of MB, and with 4 KiB
 * pages nearly every probe also misses the TLB (on a VM, a two-dimensional page walk of
 * its own memory reads). Zeroed either way. */
#define HUGE_MIN ((size_t)2 << 20)

static Entry *table_alloc(size_t cap) {
    size_t bytes = cap * sizeof(Entry);
    if (bytes < HUGE_MIN) return PyMem_RawCalloc(cap, sizeof(Entry));
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    (void)madvise(p, bytes, MADV_HUGEPAGE); /* advice only: 4 KiB pages if refused */
#endif
    return p;
}

static void table_free(Entry *tab, size_t cap) {
    if (tab == NULL) return;
    if (cap * sizeof(Entry) < HUGE_MIN) PyMem_RawFree(tab);
    else munmap(tab, cap * sizeof(Entry));
}

static int grow(HolderMap *m) {
    size_t new_cap = m->cap ? m->cap * 2 : MIN_CAP;
    Entry *fresh = table_alloc(new_cap);
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int new_shift = 64;
    for (size_t c = new_cap; c > 1; c >>= 1) new_shift--;
    Entry *old = m->tab;
    size_t old_cap = m->cap;
    m->tab = fresh;
    m->cap = new_cap;
    m->shift = new_shift;
    for (size_t i = 0; i < old_cap; i++) {
        if (old[i].n == 0) continue;
        size_t j = home(m, old[i].key);
        while (fresh[j].n) j = (j + 1) & (new_cap - 1);
        fresh[j] = old[i]; /* heap pointers move with their entry */
    }
    table_free(old, old_cap);
    return 0;
}

/* The entry for key, inserted with n == 0 (still "empty") if absent: the caller gives it a
 * holder at once, before any other call. */
static Entry *find_or_insert(HolderMap *m, uint64_t key) {
    if ((m->used + 1) * 4 > m->cap * 3 && grow(m) < 0) return NULL;
    size_t mask = m->cap - 1;
    for (size_t i = home(m, key);; i = (i + 1) & mask) {
        Entry *e = &m->tab[i];
        if (e->n == 0) {
            e->key = key;
            m->used++;
            return e;
        }
        if (e->key == key) return e;
    }
}

/* Delete the (now holderless, inline) entry e, shifting later entries of its run back. */
static void erase(HolderMap *m, Entry *e) {
    size_t mask = m->cap - 1;
    size_t i = (size_t)(e - m->tab), j = i;
    for (;;) {
        j = (j + 1) & mask;
        Entry *ej = &m->tab[j];
        if (ej->n == 0) break;
        size_t h = home(m, ej->key);
        /* ej may fill the hole at i iff i lies on its probe path: h .. j (cyclically). */
        if (((j - h) & mask) >= ((j - i) & mask)) {
            m->tab[i] = *ej;
            i = j;
        }
    }
    memset(&m->tab[i], 0, sizeof(Entry));
    m->used--;
}

/* -- one key's holders ---------------------------------------------------------------- */

static inline int mask_bit(const uint64_t *w, size_t words, uint32_t slot) {
    return slot / 64 < words && (w[slot / 64] >> (slot % 64) & 1);
}

/* NONE, REAL or PREDICTED; *at: the holder's index in a list (lists only). */
static int state_of(Entry *e, uint32_t slot, uint32_t *at) {
    if (is_mask(e)) {
        size_t words = e->kind & ~MASK;
        if (!mask_bit(e->u.mask, words, slot)) return NONE;
        return mask_bit(e->u.mask + words, words, slot) ? PREDICTED : REAL;
    }
    uint32_t *h = holder_list(e);
    for (uint32_t i = 0; i < e->n; i++) {
        if ((h[i] & ~PRED) == slot) {
            *at = i;
            return h[i] & PRED ? PREDICTED : REAL;
        }
    }
    return NONE;
}

/* The masks (every holder, then the predicted ones) of `words` words each for holders h
 * (inline or a list); NULL on no memory. */
static uint64_t *to_masks(const uint32_t *h, uint32_t n, size_t words) {
    uint64_t *w = PyMem_RawCalloc(2 * words, sizeof(uint64_t));
    if (w == NULL) return NULL;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t s = h[i] & ~PRED;
        w[s / 64] |= 1ULL << (s % 64);
        if (h[i] & PRED) w[words + s / 64] |= 1ULL << (s % 64);
    }
    return w;
}

/* Add slot (absent) as a holder of e, real or predicted. 0, or -1 on no memory. */
static int add_holder(HolderMap *m, Entry *e, uint32_t slot, int pred) {
    uint32_t h = slot | (pred ? PRED : 0);
    if (e->n < INLINE) {
        e->u.inl[e->n++] = h;
        return 0;
    }
    if (e->n == INLINE) { /* inline -> list */
        uint32_t *l = PyMem_RawMalloc(LIST_MIN * sizeof(uint32_t));
        if (l == NULL) goto nomem;
        memcpy(l, e->u.inl, INLINE * sizeof(uint32_t));
        l[e->n++] = h;
        e->u.list = l;
        e->kind = LIST_MIN;
        m->heap_bytes += LIST_MIN * sizeof(uint32_t);
        return 0;
    }
    if (!(e->kind & MASK) && e->n < e->kind) {
        e->u.list[e->n++] = h;
        return 0;
    }
    if (!(e->kind & MASK) && e->kind < LIST_MAX) { /* a longer list */
        uint32_t *l = PyMem_RawRealloc(e->u.list, 2 * e->kind * sizeof(uint32_t));
        if (l == NULL) goto nomem;
        m->heap_bytes += e->kind * sizeof(uint32_t);
        e->u.list = l;
        e->kind *= 2;
        l[e->n++] = h;
        return 0;
    }
    if (!(e->kind & MASK)) { /* a full list of LIST_MAX -> masks as wide as the map */
        uint64_t *w = to_masks(e->u.list, e->n, m->width);
        if (w == NULL) goto nomem;
        m->heap_bytes += 2 * m->width * sizeof(uint64_t) - e->kind * sizeof(uint32_t);
        PyMem_RawFree(e->u.list);
        e->u.mask = w;
        e->kind = MASK | (uint32_t)m->width;
    }
    size_t words = e->kind & ~MASK;
    if (slot / 64 >= words) { /* widen both masks to the map's width */
        size_t nw = m->width;
        uint64_t *w = PyMem_RawCalloc(2 * nw, sizeof(uint64_t));
        if (w == NULL) goto nomem;
        memcpy(w, e->u.mask, words * sizeof(uint64_t));
        memcpy(w + nw, e->u.mask + words, words * sizeof(uint64_t));
        PyMem_RawFree(e->u.mask);
        m->heap_bytes += 2 * (nw - words) * sizeof(uint64_t);
        e->u.mask = w;
        e->kind = MASK | (uint32_t)nw;
        words = nw;
    }
    e->u.mask[slot / 64] |= 1ULL << (slot % 64);
    if (pred) e->u.mask[words + slot / 64] |= 1ULL << (slot % 64);
    e->n++;
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

/* Remove slot (a holder, in state st, at index `at` if a list) from e; a key left with at
 * most INLINE holders moves them back inline. */
static void drop_holder(HolderMap *m, Entry *e, uint32_t slot, int st, uint32_t at) {
    if (is_mask(e)) {
        size_t words = e->kind & ~MASK;
        (void)st;
        e->u.mask[slot / 64] &= ~(1ULL << (slot % 64));
        e->u.mask[words + slot / 64] &= ~(1ULL << (slot % 64));
        if (--e->n > INLINE) return;
        uint64_t *w = e->u.mask; /* back inline, in slot order */
        uint32_t k = 0;
        for (size_t i = 0; i < words; i++)
            for (uint64_t x = w[i]; x; x &= x - 1) {
                int b = __builtin_ctzll(x);
                e->u.inl[k++] = (uint32_t)(i * 64 + b) | (w[words + i] >> b & 1 ? PRED : 0);
            }
        m->heap_bytes -= 2 * words * sizeof(uint64_t);
        PyMem_RawFree(w);
        return;
    }
    uint32_t *h = holder_list(e);
    h[at] = h[--e->n];
    if (e->n == INLINE) {
        uint32_t *l = e->u.list;
        m->heap_bytes -= e->kind * sizeof(uint32_t);
        memcpy(e->u.inl, l, INLINE * sizeof(uint32_t));
        PyMem_RawFree(l);
    }
}

/* keep = active & holders(e), word by word over `width` words (keep zeroed first). */
static void intersect(const Entry *e, const uint64_t *active, uint64_t *keep, size_t width) {
    memset(keep, 0, width * sizeof(uint64_t));
    if (is_mask(e)) {
        size_t words = e->kind & ~MASK, top = words < width ? words : width;
        const uint64_t *w = e->u.mask;
        for (size_t i = 0; i < top; i++) keep[i] = active[i] & w[i]; /* every holder */
        return;
    }
    const uint32_t *h = on_heap(e) ? e->u.list : e->u.inl;
    for (uint32_t i = 0; i < e->n; i++) {
        uint32_t s = h[i] & ~PRED;
        uint64_t bit = 1ULL << (s % 64);
        keep[s / 64] |= active[s / 64] & bit;
    }
}

/* -- Python arguments ----------------------------------------------------------------- */

/* Keys from a list/tuple (read in place) or any iterable (consumed lazily). */
typedef struct {
    PyObject *seq, *it;
    PyObject **items;
    Py_ssize_t i, n;
} KeyIter;

static int keys_open(KeyIter *ki, PyObject *obj) {
    memset(ki, 0, sizeof(*ki));
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
static int keys_next(KeyIter *ki, uint64_t *out) {
    PyObject *obj = PyIter_Next(ki->it);
    if (obj == NULL) return PyErr_Occurred() ? -1 : 0;
    int rc = as_key(obj, out);
    Py_DECREF(obj);
    return rc < 0 ? -1 : 1;
}

/* The first `limit` (all if < 0) keys of an iterable, converted up front, so a bad key
 * raises before any change. Free with PyMem_Free. */
static uint64_t *keys_all(PyObject *obj, Py_ssize_t *n, Py_ssize_t limit) {
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

/* p, an array of `old` elements of `size` bytes, grown to n, the new ones zeroed; NULL on
 * no memory (p then unchanged, still the caller's). */
static void *grow_zeroed(void *p, size_t old, size_t n, size_t size) {
    char *q = PyMem_RawRealloc(p, n * size);
    if (q == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    memset(q + old * size, 0, (n - old) * size);
    return q;
}

/* Make room for slot: its count, its key log, and the walk's width. */
static int give_slot(HolderMap *m, uint32_t slot) {
    if (slot >= m->ncounts) {
        size_t n = m->ncounts ? m->ncounts : 64;
        while (n <= slot) n *= 2;
        size_t *c = grow_zeroed(m->counts, m->ncounts, n, sizeof(size_t));
        if (c == NULL) return -1;
        m->counts = c;
        uint64_t **lg = grow_zeroed(m->logs, m->ncounts, n, sizeof(uint64_t *));
        if (lg == NULL) return -1;
        m->logs = lg;
        size_t *ll = grow_zeroed(m->log_len, m->ncounts, n, sizeof(size_t));
        if (ll == NULL) return -1;
        m->log_len = ll;
        size_t *lc = grow_zeroed(m->log_cap, m->ncounts, n, sizeof(size_t));
        if (lc == NULL) return -1;
        m->log_cap = lc;
        m->ncounts = n;
    }
    if (slot / 64 >= m->width) m->width = slot / 64 + 1;
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

/* Loops over keys held in an array (add, predict, remove) request the entries PREFETCH
 * keys ahead, so that the table's cache misses overlap. The walk works in chunks of
 * WALK_CHUNK keys instead (see HolderMap_walk): prefetching 8, 16 or 32 keys ahead, it
 * still waited on most entries, a chunk's misses all at once took a tenth more off a
 * 1,000-worker decision (chunks of 32 to 128 alike). */
#define PREFETCH 8
#define WALK_CHUNK 64

static inline void prefetch_key(const HolderMap *m, uint64_t key) {
    if (m->cap) __builtin_prefetch(&m->tab[home(m, key)]);
}


static int log_compact(HolderMap *m, uint32_t s);

/* Drop slot's holder of each key if it is in state `want`; returns how many, or -1. */
static Py_ssize_t drop_keys(HolderMap *m, const uint64_t *ks, Py_ssize_t n, uint32_t slot,
                            int want) {
    Py_ssize_t dropped = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH < n) prefetch_key(m, ks[i + PREFETCH]);
        Entry *e = find(m, ks[i]);
        uint32_t at = 0;
        if (e == NULL || state_of(e, slot, &at) != want) continue;
        drop_holder(m, e, slot, want, at);
        if (e->n == 0) erase(m, e);
        dropped++;
    }
    if (want == REAL) {
        m->counts[slot] -= (size_t)dropped;
        m->entries -= (size_t)dropped;
        if (log_compact(m, slot) < 0) PyErr_Clear(); /* a superset still: compact later */
    }
    return dropped;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* The keys slot s really holds, each once, in an array of counts[s] (free with
 * PyMem_Free): its log's keys still held, sorted, duplicates dropped. */
static uint64_t *real_keys(HolderMap *m, uint32_t s, size_t *n) {
    size_t len = s < m->ncounts ? m->log_len[s] : 0;
    uint64_t *out = PyMem_Malloc((len ? len : 1) * sizeof(uint64_t));
    if (out == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    size_t k = 0;
    for (size_t i = 0; i < len; i++) {
        uint64_t key = m->logs[s][i];
        if (i + PREFETCH < len) prefetch_key(m, m->logs[s][i + PREFETCH]);
        Entry *e = find(m, key);
        uint32_t at;
        if (e != NULL && state_of(e, s, &at) == REAL) out[k++] = key;
    }
    qsort(out, k, sizeof(uint64_t), cmp_u64);
    size_t u = 0;
    for (size_t i = 0; i < k; i++)
        if (u == 0 || out[u - 1] != out[i]) out[u++] = out[i];
    *n = u; /* == counts[s], by the log's invariant */
    return out;
}

/* Room in slot s's log for `extra` more keys. 0, or -1 on no memory. */
static int log_reserve(HolderMap *m, uint32_t s, size_t extra) {
    size_t need = m->log_len[s] + extra;
    if (need <= m->log_cap[s]) return 0;
    size_t cap = m->log_cap[s] + m->log_cap[s] / 2;
    if (cap < need) cap = need;
    uint64_t *l = PyMem_RawRealloc(m->logs[s], cap * sizeof(uint64_t));
    if (l == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    m->heap_bytes += (cap - m->log_cap[s]) * sizeof(uint64_t);
    m->logs[s] = l;
    m->log_cap[s] = cap;
    return 0;
}

/* Rewrite slot s's log as the keys it holds, once each, when it has grown past the bound
 * of the invariant (keys removed since stay in a log until then). 0, or -1 on no memory
 * (the log is then left as it was: still a superset). */
static int log_compact(HolderMap *m, uint32_t s) {
    if (m->log_len[s] <= 3 * m->counts[s] / 2 + LOG_SLACK) return 0;
    size_t n;
    uint64_t *ks = real_keys(m, s, &n);
    if (ks == NULL) return -1;
    memcpy(m->logs[s], ks, n * sizeof(uint64_t));
    m->log_len[s] = n;
    PyMem_Free(ks);
    return 0;
}

/* Drop every key slot s really holds; how many, or -1 on no memory. */
static Py_ssize_t clear_slot(HolderMap *m, uint32_t s) {
    if (s >= m->ncounts || m->counts[s] == 0) {
        if (s < m->ncounts) m->log_len[s] = 0; /* only keys no longer held */
        return 0;
    }
    size_t n;
    uint64_t *ks = real_keys(m, s, &n);
    if (ks == NULL) return -1;
    m->log_len[s] = 0; /* it will hold none (and drop_keys has no log to compact) */
    Py_ssize_t dropped = drop_keys(m, ks, (Py_ssize_t)n, s, REAL);
    PyMem_Free(ks);
    return dropped;
}

/* Make slot a real holder of ks[0..n). 0, or -1 on no memory (keys before stay added). */
static int add_keys(HolderMap *m, const uint64_t *ks, Py_ssize_t n, uint32_t slot) {
    if (give_slot(m, slot) < 0 || log_reserve(m, slot, (size_t)n) < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH < n) prefetch_key(m, ks[i + PREFETCH]);
        Entry *e = find_or_insert(m, ks[i]);
        if (e == NULL) return -1;
        uint32_t at = 0;
        int st = e->n ? state_of(e, slot, &at) : NONE;
        if (st == REAL) continue;
        if (st == PREDICTED) { /* confirmed: the same holder, now real */
            if (is_mask(e)) {
                size_t words = e->kind & ~MASK;
                e->u.mask[words + slot / 64] &= ~(1ULL << (slot % 64));
            } else {
                holder_list(e)[at] &= ~PRED;
            }
        } else if (add_holder(m, e, slot, 0) < 0) {
            if (e->n == 0) erase(m, e);
            return -1;
        }
        m->counts[slot]++;
        m->entries++;
        m->logs[slot][m->log_len[slot]++] = ks[i]; /* room reserved above */
    }
    if (log_compact(m, slot) < 0) PyErr_Clear(); /* a batch naming keys twice may pass the
                                                    * bound; on no memory, compact later */
    return 0;
}

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

static PyObject *HolderMap_walk(HolderMap *m, PyObject *args) {
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
