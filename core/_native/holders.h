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
#ifndef KVROUTE_HOLDERS_H
#define KVROUTE_HOLDERS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The extension's parts: this header (the map's layout, its invariants above, and the
 * inline lookups every part uses), holder_table.c (the table, each key's holders, each
 * slot's count and key log), holder_walk.c (the routing walk) and holders.c (the Python
 * type: arguments, methods, module). Built with hidden visibility: only PyInit__holders
 * is exported. */

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
static inline Entry *find(const HolderMap *m, uint64_t key) {
    if (m->cap == 0) return NULL;
    size_t mask = m->cap - 1;
    for (size_t i = home(m, key);; i = (i + 1) & mask) {
        Entry *e = &m->tab[i];
        if (e->n == 0) return NULL;
        if (e->key == key) return e;
    }
}

/* keep = active & holders(e), word by word over `width` words (keep zeroed first). */
static inline void intersect(const Entry *e, const uint64_t *active, uint64_t *keep, size_t width) {
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

/* Loops over keys held in an array (add, predict, remove) request the entries PREFETCH
 * keys ahead, so that the table's cache misses overlap. The walk works in chunks of
 * WALK_CHUNK keys instead (see HolderMap_walk): prefetching 8, 16 or 32 keys ahead, it
 * still waited on most entries, a chunk's misses all at once took a tenth more off a
 * 1,000-worker decision (chunks of 32 to 128 alike). */
#define PREFETCH 8

static inline void prefetch_key(const HolderMap *m, uint64_t key) {
    if (m->cap) __builtin_prefetch(&m->tab[home(m, key)]);
}


/* Keys from a list/tuple (read in place) or any iterable (consumed lazily). */
typedef struct {
    PyObject *seq, *it;
    PyObject **items;
    Py_ssize_t i, n;
} KeyIter;

/* holder_table.c */
void table_free(Entry *tab, size_t cap);
Entry *find_or_insert(HolderMap *m, uint64_t key);
void erase(HolderMap *m, Entry *e);
int state_of(Entry *e, uint32_t slot, uint32_t *at);
int add_holder(HolderMap *m, Entry *e, uint32_t slot, int pred);
int give_slot(HolderMap *m, uint32_t slot);
Py_ssize_t drop_keys(HolderMap *m, const uint64_t *ks, Py_ssize_t n, uint32_t slot, int want);
uint64_t *real_keys(HolderMap *m, uint32_t s, size_t *n);
Py_ssize_t clear_slot(HolderMap *m, uint32_t s);
int add_keys(HolderMap *m, const uint64_t *ks, Py_ssize_t n, uint32_t slot);

/* holders.c: keys from Python arguments */
int keys_open(KeyIter *ki, PyObject *obj);
void keys_close(KeyIter *ki);
int keys_next(KeyIter *ki, uint64_t *out);
uint64_t *keys_all(PyObject *obj, Py_ssize_t *n, Py_ssize_t limit);

/* holder_walk.c */
PyObject *HolderMap_walk(HolderMap *m, PyObject *args);

#endif
