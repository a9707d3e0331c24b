/* The holder map's table (see holders.h): entries, each key's holders (inline, a list or
 * masks), each slot's real-holder count and key log. No Python objects: the callers in
 * holders.c and holder_walk.c convert their arguments first. */
#include "holders.h"
#include <sys/mman.h>

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

void table_free(Entry *tab, size_t cap) {
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
Entry *find_or_insert(HolderMap *m, uint64_t key) {
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
void erase(HolderMap *m, Entry *e) {
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
int state_of(Entry *e, uint32_t slot, uint32_t *at) {
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
int add_holder(HolderMap *m, Entry *e, uint32_t slot, int pred) {
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
int give_slot(HolderMap *m, uint32_t slot) {
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

static int log_compact(HolderMap *m, uint32_t s);

/* Drop slot's holder of each key if it is in state `want`; returns how many, or -1. */
Py_ssize_t drop_keys(HolderMap *m, const uint64_t *ks, Py_ssize_t n, uint32_t slot,
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
uint64_t *real_keys(HolderMap *m, uint32_t s, size_t *n) {
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
Py_ssize_t clear_slot(HolderMap *m, uint32_t s) {
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
int add_keys(HolderMap *m, const uint64_t *ks, Py_ssize_t n, uint32_t slot) {
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
