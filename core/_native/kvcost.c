/* kvroute's default policy (KvrouteCost.rank, kvroute/core/policies/kvroute_cost.py) in C:
 * the same ranking, bit for bit, without a Python loop over the workers.
 *
 * rank(params, loads, matched, prompt_tokens, block_size, affinity, family, prefix_rate,
 *      tail_work) -> (workers best first, their costs)
 *
 *   params:  (miss_weight, stickiness, decode_weight, kv_weight, kv_decay, affinity_weight,
 *             attn, hold, hold_min, batch_weight, batch_tokens, transfer_cost,
 *             arrival_weight, prefill_s_per_token, demand_horizon_s, kv_fill_from,
 *             kv_fill_full, tail_hold, churn_s, churn_full_s, chunked_prefill,
 *             chunk_caps, join_hold), floats
 *   loads:   dict worker -> WorkerLoad; each load's ``packed`` is read: its fields as
 *            bytes (load.py's PACKED_FORMAT), copied, or as a tuple, converted (see
 *            kvroute/core/load.py for its fields)
 *   matched: dict worker -> matched blocks
 *
 * The formula and its reasons are documented on the Python class, which is the reference:
 * tests/core/test_kvcost_native.py checks both paths give the same workers and the same
 * costs on random clusters. To stay bit-identical, every expression keeps the Python
 * path's order of operations and int->double conversions (setup.py builds this file with
 * -ffp-contract=off, so no fused multiply-add changes a rounding), and ties go the way
 * Python's stable sorts and min() send them: cheapest first, then the rendezvous hash of
 * the request's affinity, then the order of ``loads``.
 *
 * Why C: under load the Python path's loops over 128 workers took ~240 us per decision,
 * most of the routing decision (bench/routing_decision.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

enum { P_MISS, P_STICK, P_DECODE, P_KV, P_KV_DECAY, P_AFFINITY, P_ATTN, P_HOLD, P_HOLD_MIN,
       P_BATCH, P_BATCH_TOKENS, P_TRANSFER, P_ARRIVAL, P_PREFILL_S, P_HORIZON, P_FILL_FROM,
       P_FILL_FULL, P_TAIL_HOLD, P_CHURN, P_CHURN_FULL, P_CHUNKED, P_CHUNK_CAPS, P_JOIN_HOLD,
       N_PARAMS };

/* WorkerLoad.packed, in this order: N_LOAD ints, then cache_fill, arrival_rate and
 * prefill_rate. L_MODE is PrefillMode.code: 0 unknown, 1 whole, 2 chunked; L_CHUNK is
 * max_prefill_chunk; L_WAITING is WorkerLoad.waiting. */
enum { L_PENDING, L_BUSY, L_USED, L_QUEUED, L_BUDGET, L_MAX_RUNNING, L_OCCUPIED, L_CONTEXT,
       L_MODE, L_CHUNK, L_WAITING, N_LOAD };
enum { MODE_UNKNOWN, MODE_WHOLE, MODE_CHUNKED };
#define N_PACKED (N_LOAD + 3)

typedef struct {
    PyObject *name;      /* borrowed from loads */
    long long f[N_LOAD];
    double fill;         /* cache_fill */
    double rate;         /* arrival_rate */
    double prefills;     /* prefill_rate */
    long long cached;    /* tokens of the prompt cached there */
    double cost;
} Worker;  /* ws[i] is the i-th worker of loads: its position is the last tie-break */

/* work(n, c) = n * (1 + attn * (c + n / 2)), as kvroute_cost.work computes it */
static double work(long long n, long long c, double attn) {
    return (double)n * (1.0 + attn * ((double)c + (double)n / 2.0));
}

/* Whether w's engine chunks long prefills: its prefill_mode, else the policy's
 * chunked_prefill (KvrouteCost._chunks). */
static inline int chunks(const Worker *w, const double *prm) {
    return w->f[L_MODE] == MODE_UNKNOWN ? prm[P_CHUNKED] != 0.0 : w->f[L_MODE] == MODE_CHUNKED;
}

/* The cap on one prefill's chunk the policy counts on w (KvrouteCost._cap; 0: none). */
static inline long long chunk_cap(const Worker *w, const double *prm) {
    return prm[P_CHUNK_CAPS] != 0.0 ? w->f[L_CHUNK] : 0;
}

/* Whether a request sent to w joins its next iteration (KvrouteCost._joins): its engine
 * caps each prefill's chunk and the chunks ahead leave room in the iteration. */
static int joins(const Worker *w, const double *prm) {
    const long long cap = chunk_cap(w, prm);
    if (!cap || !chunks(w, prm)) return 0;
    const double budget = w->f[L_BUDGET] ? (double)w->f[L_BUDGET] : prm[P_BATCH_TOKENS];
    return (double)((w->f[L_WAITING] + 1) * cap) < budget;
}

/* backlog_w of the hold rule (KvrouteCost._backlog): the queued prefill in work units, or,
 * where the request joins the next iteration, the share of it the chunks ahead take. */
static double backlog(const Worker *w, const double *prm) {
    const long long pending = w->f[L_PENDING];
    double b = (double)pending + prm[P_ATTN] * (double)w->f[L_CONTEXT];
    if (pending && joins(w, prm)) {
        const long long ahead = (w->f[L_WAITING] + 1) * chunk_cap(w, prm);
        if (ahead < pending) b *= (double)ahead / (double)pending;
    }
    return b;
}

/* What the sorts order: a worker's cost or rendezvous hash and its position in ``loads``,
 * 16 bytes together, so that a sort of 1,000 workers moves through one compact array
 * instead of chasing pointers into their 150-byte records (that was half of the ranking's
 * own time at 1,000 workers). */
typedef struct {
    double cost;
    Py_ssize_t idx;
} CostKey;

typedef struct {
    uint64_t tie;
    Py_ssize_t idx;
} TieKey;

/* The orders the ranking needs, each total (positions are unique): by cost then position,
 * by rendezvous hash then position. Written without branches (| and & of comparisons):
 * ``cost < y or (cost == y and idx < y's)``, as "if they differ, whether less, else the
 * positions", NaN included (unequal to all, less than none). */
static inline int cost_before(const CostKey *x, const CostKey *y) {
    return (x->cost < y->cost) | ((x->cost == y->cost) & (x->idx < y->idx));
}

static inline int tie_before(const TieKey *x, const TieKey *y) {
    return (x->tie < y->tie) | ((x->tie == y->tie) & (x->idx < y->idx));
}

/* A bottom-up merge sort with the comparison inlined: glibc's qsort, calling its
 * comparator through a pointer, was a third of the ranking's time at 128 workers. The
 * merge steps without a branch on the comparison (which costs order nearly at random,
 * mispredicted half the time at 1,000 workers); the same comparisons in the same order as
 * a branching merge, so the same result. ``tmp`` holds n keys. */
#define DEFINE_SORT(NAME, KEY, BEFORE)                                                    \
    static void NAME(KEY *a, KEY *tmp, Py_ssize_t n) {                                    \
        for (Py_ssize_t w = 1; w < n; w *= 2) {                                           \
            for (Py_ssize_t lo = 0; lo < n - w; lo += 2 * w) {                            \
                Py_ssize_t mid = lo + w, hi = lo + 2 * w < n ? lo + 2 * w : n;            \
                Py_ssize_t i = lo, j = mid, k = 0;                                        \
                if (!BEFORE(&a[mid], &a[mid - 1])) continue; /* already in order */       \
                while (i < mid && j < hi) {                                               \
                    const Py_ssize_t right = BEFORE(&a[j], &a[i]);                        \
                    tmp[k++] = a[i + ((j - i) & -right)]; /* a[j] if right, else a[i] */  \
                    j += right;                                                           \
                    i += 1 - right;                                                       \
                }                                                                         \
                while (i < mid) tmp[k++] = a[i++];                                        \
                memcpy(a + lo, tmp, (size_t)k * sizeof(KEY));                             \
            }                                                                             \
        }                                                                                 \
    }

DEFINE_SORT(sort_by_cost, CostKey, cost_before)
DEFINE_SORT(sort_by_tie, TieKey, tie_before)

/* From this many workers on, the sorts by a 64-bit key are radix sorts: a merge sort of
 * 1,000 keys is a chain of ~10,000 dependent steps (~40 us); 8 passes of one byte each
 * are not. Below it the merge sort is as fast. */
#define RADIX_FROM 256

/* ``a`` (n keys, scratch ``tmp`` as many) sorted by ``tie`` then position, for ``a`` in
 * the order of the positions: a stable LSD radix sort on the key's 8 bytes (a byte all
 * keys share is skipped), so the same order as sort_by_tie, which is total. */
static void radix_by_tie(TieKey *a, TieKey *tmp, Py_ssize_t n) {
    Py_ssize_t count[8][256];
    memset(count, 0, sizeof count);
    for (Py_ssize_t i = 0; i < n; i++)
        for (int b = 0; b < 8; b++) count[b][(a[i].tie >> (8 * b)) & 0xff]++;
    TieKey *src = a, *dst = tmp;
    for (int b = 0; b < 8; b++) {
        Py_ssize_t *c = count[b];
        if (c[(src[0].tie >> (8 * b)) & 0xff] == n) continue;  /* one value: no change */
        for (Py_ssize_t d = 0, at = 0; d < 256; d++) {  /* counts -> first slots */
            const Py_ssize_t k = c[d];
            c[d] = at;
            at += k;
        }
        for (Py_ssize_t i = 0; i < n; i++) dst[c[(src[i].tie >> (8 * b)) & 0xff]++] = src[i];
        TieKey *t = src;
        src = dst;
        dst = t;
    }
    if (src != a) memcpy(a, src, (size_t)n * sizeof(TieKey));
}

/* ``a`` (n keys in the order of their positions; scratch ``tmp``) sorted as sort_by_tie
 * sorts it: by radix from RADIX_FROM keys on (the same total order), else merging. */
static void sort_ties(TieKey *a, TieKey *tmp, Py_ssize_t n) {
    if (n >= RADIX_FROM)
        radix_by_tie(a, tmp, n);
    else
        sort_by_tie(a, tmp, n);
}

/* A cost as an unsigned key in the same order: for costs that are not NaN, x < y exactly
 * when key(x) < key(y), and x == y exactly when the keys are equal (-0.0 is keyed as
 * 0.0, which it equals). */
static inline uint64_t cost_key(double cost) {
    if (cost == 0.0) cost = 0.0;
    uint64_t b;
    memcpy(&b, &cost, sizeof b);
    return b >> 63 ? ~b : b | (1ULL << 63);
}

/* tie_break(seed, worker) of kvroute/core/policies/base.py: XXH3_64(utf8(worker), seed) */
static int tie_of(const Worker *w, uint64_t seed, uint64_t *tie) {
    Py_ssize_t len;
    const char *s = PyUnicode_AsUTF8AndSize(w->name, &len);
    if (s == NULL) return -1;
    *tie = XXH3_64bits_withSeed(s, (size_t)len, seed);
    return 0;
}

/* ``ts`` (n keys, scratch ``tmp`` as many) as the workers ``ws`` in the rendezvous order of
 * ``seed`` (stable: equal hashes by position). */
static int rendezvous(const Worker *ws, TieKey *ts, TieKey *tmp, Py_ssize_t n,
                      uint64_t seed) {
    for (Py_ssize_t i = 0; i < n; i++) {
        ts[i].idx = i;
        if (tie_of(&ws[i], seed, &ts[i].tie) < 0) return -1;
    }
    sort_ties(ts, tmp, n);
    return 0;
}

/* ``by`` (n keys, scratch ``tmp`` as many; ``ties`` and ``tie_tmp`` as many) as the workers
 * ``ws`` sorted by cost, equal costs by the rendezvous hash of ``seed`` (then by position):
 * hashes are computed for tied workers alone, as rank_by_cost does, since costs rarely
 * tie. The sort starts from ``start``'s order when given (the affinity term's), else from
 * the positions', as the ranking always has: only NaN costs could tell the difference. */
static int sort_ranking(const Worker *ws, const TieKey *start, CostKey *by, CostKey *tmp,
                        TieKey *ties, TieKey *tie_tmp, Py_ssize_t n, uint64_t seed) {
    int nan = 0;
    for (Py_ssize_t i = 0; i < n && !nan; i++) nan = isnan(ws[i].cost);
    if (n >= RADIX_FROM && !nan) {
        /* Costs in a total order: keyed, sorted by radix (``start``, which may be ``ties``,
         * is not read: any start gives this order). */
        for (Py_ssize_t i = 0; i < n; i++) {
            ties[i].tie = cost_key(ws[i].cost);
            ties[i].idx = i;
        }
        radix_by_tie(ties, tie_tmp, n);
        for (Py_ssize_t i = 0; i < n; i++) {
            by[i].idx = ties[i].idx;
            by[i].cost = ws[by[i].idx].cost;
        }
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            by[i].idx = start ? start[i].idx : i;
            by[i].cost = ws[by[i].idx].cost;
        }
        sort_by_cost(by, tmp, n);
    }
    for (Py_ssize_t i = 0, j; i < n; i = j) {
        for (j = i + 1; j < n && by[j].cost == by[i].cost; j++) {}
        if (j - i > 1) {
            for (Py_ssize_t k = i; k < j; k++) {
                ties[k - i].idx = by[k].idx;
                if (tie_of(&ws[by[k].idx], seed, &ties[k - i].tie) < 0) return -1;
            }
            /* (sort_ties wants the positions' order, which equal costs keep when not NaN;
             * an idle cluster's unmatched workers are one run of hundreds) */
            if (nan)
                sort_by_tie(ties, tie_tmp, j - i);
            else
                sort_ties(ties, tie_tmp, j - i);
            for (Py_ssize_t k = i; k < j; k++) by[k].idx = ties[k - i].idx;
        }
    }
    return 0;
}

static PyObject *packed_name;  /* "packed", interned once */

/* WorkerLoad.packed as bytes (load.py's PACKED_FORMAT "=11q3d"): N_LOAD int64, then the
 * three doubles, native order, no padding. */
#define PACKED_BYTES (N_LOAD * sizeof(long long) + 3 * sizeof(double))
_Static_assert(sizeof(long long) == 8 && sizeof(double) == 8, "PACKED_FORMAT is 8-byte fields");

static int read_load(PyObject *load, Worker *w) {
    PyObject *packed = PyObject_GetAttr(load, packed_name);
    if (packed == NULL) return -1;
    if (PyBytes_CheckExact(packed) && PyBytes_GET_SIZE(packed) == (Py_ssize_t)PACKED_BYTES) {
        /* The common form: copied, not converted (14 conversions a worker were a fifth of
         * the ranking at 1,000 workers). */
        const char *b = PyBytes_AS_STRING(packed);
        memcpy(w->f, b, sizeof w->f);
        memcpy(&w->fill, b + sizeof w->f, sizeof(double));
        memcpy(&w->rate, b + sizeof w->f + sizeof(double), sizeof(double));
        memcpy(&w->prefills, b + sizeof w->f + 2 * sizeof(double), sizeof(double));
        Py_DECREF(packed);
        return 0;
    }
    if (!PyTuple_Check(packed) || PyTuple_GET_SIZE(packed) != N_PACKED) {
        PyErr_SetString(PyExc_TypeError,
                        "WorkerLoad.packed must be 11 ints and 3 floats (bytes or a tuple)");
        Py_DECREF(packed);
        return -1;
    }
    for (int k = 0; k < N_LOAD; k++) {
        w->f[k] = PyLong_AsLongLong(PyTuple_GET_ITEM(packed, k));
        if (w->f[k] == -1 && PyErr_Occurred()) {
            Py_DECREF(packed);
            return -1;
        }
    }
    w->fill = PyFloat_AsDouble(PyTuple_GET_ITEM(packed, N_LOAD));
    w->rate = PyFloat_AsDouble(PyTuple_GET_ITEM(packed, N_LOAD + 1));
    w->prefills = PyFloat_AsDouble(PyTuple_GET_ITEM(packed, N_LOAD + 2));
    Py_DECREF(packed);
    if ((w->fill == -1.0 || w->rate == -1.0 || w->prefills == -1.0) && PyErr_Occurred())
        return -1;
    return 0;
}

static PyObject *rank(PyObject *self, PyObject *args) {
    PyObject *params, *loads, *matched;
    long long p, bs;
    unsigned long long affinity, family;
    double prefix_rate, tail_work;
    if (!PyArg_ParseTuple(args, "O!O!O!LLKKdd", &PyTuple_Type, &params, &PyDict_Type, &loads,
                          &PyDict_Type, &matched, &p, &bs, &affinity, &family, &prefix_rate,
                          &tail_work))
        return NULL;
    if (PyTuple_GET_SIZE(params) != N_PARAMS) {
        PyErr_Format(PyExc_ValueError, "params must hold %d values", N_PARAMS);
        return NULL;
    }
    double prm[N_PARAMS];
    for (int k = 0; k < N_PARAMS; k++) {
        prm[k] = PyFloat_AsDouble(PyTuple_GET_ITEM(params, k));
        if (prm[k] == -1.0 && PyErr_Occurred()) return NULL;
    }
    Py_ssize_t n = PyDict_GET_SIZE(loads);
    Worker *ws = PyMem_Calloc(n ? n : 1, sizeof(Worker));
    /* the ranking being built and its merge sort's scratch; the rendezvous orders' */
    CostKey *by = PyMem_Calloc(n ? 2 * n : 1, sizeof(CostKey));
    TieKey *ties = PyMem_Calloc(n ? 2 * n : 1, sizeof(TieKey));
    if (ws == NULL || by == NULL || ties == NULL) {
        PyMem_Free(ws);
        PyMem_Free(by);
        PyMem_Free(ties);
        return PyErr_NoMemory();
    }
    CostKey *tmp = by + n;
    TieKey *tie_tmp = ties + n;
    const TieKey *start = NULL;  /* the order the final sort starts from (NULL: positions) */
    PyObject *result = NULL, *order = NULL, *costs = NULL;
    const double attn = prm[P_ATTN];

    /* Read the loads and each worker's cached prefix; sum the queues. */
    long long sum_queued = 0, top = 0;
    double sum_fill = 0.0;
    Py_ssize_t pos = 0, i = 0;
    PyObject *key, *value;
    while (PyDict_Next(loads, &pos, &key, &value)) {
        Worker *w = &ws[i];
        w->name = key;
        i++;
        if (!PyUnicode_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "worker names must be str");
            goto done;
        }
        if (read_load(value, w) < 0) goto done;
        sum_queued += w->f[L_QUEUED];
        sum_fill += w->fill;
        PyObject *m = PyDict_GetItemWithError(matched, key);
        if (m == NULL) {
            if (PyErr_Occurred()) goto done;
            continue;
        }
        long long blocks = PyLong_AsLongLong(m);
        if (blocks == -1 && PyErr_Occurred()) goto done;
        if (blocks < 0) {
            PyErr_SetString(PyExc_ValueError, "matched block counts must be >= 0");
            goto done;
        }
        long long c = blocks * bs;
        w->cached = c < p ? c : p;  /* min(m * bs, p) */
        if (w->cached > top) top = w->cached;
    }
    if (i != n) {
        PyErr_SetString(PyExc_RuntimeError, "loads changed size during the ranking");
        goto done;
    }

    const double mean_queued = (double)sum_queued / (double)n;
    const double beta = prm[P_MISS] * (1.0 + prm[P_STICK] * mean_queued);
    /* The caches' mean fill: the KV term grows in with it, the arrival term fades out. */
    const double fill = sum_fill / (double)n;
    double ramp = 1.0;
    if (fill < prm[P_FILL_FULL])
        ramp = fill <= prm[P_FILL_FROM] ? 0.0
               : (fill - prm[P_FILL_FROM]) / (prm[P_FILL_FULL] - prm[P_FILL_FROM]);
    const double kw = prm[P_KV] / (1.0 + prm[P_KV_DECAY] * mean_queued) * ramp;
    const double dw = prm[P_DECODE];
    const double full_miss = beta * work(p, 0, attn);
    for (i = 0; i < n; i++) {
        Worker *w = &ws[i];
        w->cost = full_miss + (double)w->f[L_PENDING] + dw * (double)w->f[L_BUSY]
                  + kw * (double)w->f[L_USED] * (double)bs;
        if (w->cached)
            w->cost += beta * work(p - w->cached, w->cached, attn) - full_miss;
    }

    const double tc = prm[P_TRANSFER];
    if (top && tc < 1) {  /* a worker may fetch the longest cached prefix */
        const double fetched = beta * work(p - top, top, attn);
        for (i = 0; i < n; i++) {
            Worker *w = &ws[i];
            if (w->cached < top) {
                double own = beta * work(p - w->cached, w->cached, attn);
                double gain = own - fetched - beta * tc * (double)(top - w->cached);
                w->cost -= gain > 0.0 ? gain : 0.0;
            }
        }
    }

    if (prm[P_BATCH] > 0 && mean_queued > 0) {  /* the batch term */
        const double bw = prm[P_BATCH];
        for (i = 0; i < n; i++) {
            Worker *w = &ws[i];
            if (!w->f[L_QUEUED]) continue;
            long long new_tokens = p - w->cached;
            double budget = w->f[L_BUDGET] ? (double)w->f[L_BUDGET] : prm[P_BATCH_TOKENS];
            double room = budget - (double)w->f[L_PENDING];
            if (chunks(w, prm)) {
                /* its first chunk joins the queue's iteration (at most the engine's cap) */
                if (room > 0) {
                    long long first = (double)new_tokens <= room ? new_tokens : (long long)room;
                    const long long cap = chunk_cap(w, prm);
                    if (cap && cap < first) first = cap;
                    w->cost += bw * (double)w->f[L_QUEUED] * work(first, w->cached, attn);
                }
            } else if ((double)new_tokens <= room) {
                w->cost += bw * (double)w->f[L_QUEUED] * work(new_tokens, w->cached, attn);
            }
        }
    }

    if (top && prm[P_HOLD] > 0 && !((double)top < prm[P_HOLD_MIN] * (double)p)) {
        /* The hold rule. Nothing to keep when the cheapest worker holds ``top`` too. */
        Worker *cheapest = &ws[0];
        for (i = 1; i < n; i++)
            if (ws[i].cost < cheapest->cost) cheapest = &ws[i];
        const long long c0 = cheapest->cached;
        /* The holder: the cheapest worker caching ``top``; on equal costs the first of them
         * in ``matched``'s order (Python's min over it), looked up only then: one pass
         * over the workers, not one per match. */
        Worker *holder = NULL;
        int tied = 0;
        for (i = 0; c0 < top && i < n; i++) {
            if (ws[i].cached != top) continue;
            if (holder == NULL || ws[i].cost < holder->cost) {
                holder = &ws[i];
                tied = 0;
            } else if (ws[i].cost == holder->cost) {
                tied = 1;
            }
        }
        if (tied) {
            /* The tied holders' names in a set, then the first of ``matched`` in it: one
             * pass over each. A scan of every worker for each match in turn until one was
             * tied cost up to (matches x workers): 0.7 ms a decision where 250 idle holders
             * of 1,000 tied and ``matched`` listed the tied ones last. */
            const double least = holder->cost;
            PyObject *names = PySet_New(NULL), *first = NULL;
            if (names == NULL) goto done;
            for (i = 0; i < n; i++) {
                if (ws[i].cached == top && ws[i].cost == least
                        && PySet_Add(names, ws[i].name) < 0) {
                    Py_DECREF(names);
                    goto done;
                }
            }
            pos = 0;
            while (first == NULL && PyDict_Next(matched, &pos, &key, &value)) {
                int in = PySet_Contains(names, key);
                if (in < 0) {
                    Py_DECREF(names);
                    goto done;
                }
                if (in) first = key; /* borrowed from ``matched``, which outlives this */
            }
            Py_DECREF(names);
            for (i = 0; first != NULL && i < n; i++) {
                if (ws[i].cached != top || ws[i].cost != least) continue;
                int same = ws[i].name == first ? 1 : PyObject_RichCompareBool(
                    ws[i].name, first, Py_EQ);
                if (same < 0) goto done;
                if (same) {
                    holder = &ws[i];
                    break;
                }
            }
        }
        /* (a holder exists when c0 < top: ``top`` came from a worker ``matched`` names) */
        int full = holder == NULL || (holder->f[L_MAX_RUNNING]
                                      && holder->f[L_OCCUPIED] >= holder->f[L_MAX_RUNNING]);
        if (c0 < top && !full && prm[P_JOIN_HOLD] != 0.0 && joins(holder, prm)) {
            /* it joins the holder's next iteration: no move saves more than the chunks ahead */
            holder->cost = nextafter(cheapest->cost, -INFINITY);
        } else if (c0 < top && !full) {
            double redo = beta * (work(p - c0, c0, attn) - work(p - top, top, attn));
            double fetch = beta * tc * (double)(top - c0);
            if (fetch < redo) redo = fetch;
            /* a queue on a hot prefix's holder delays every request for it meanwhile */
            double demand = 1.0 + prm[P_HORIZON] * prefix_rate;
            /* the backlog in work units, its attention included, as the redo */
            const double queued_h = backlog(holder, prm);
            const double queued_m = backlog(cheapest, prm);
            const double gap = queued_h - queued_m;
            int keep = gap * demand < prm[P_HOLD] * redo;
            if (keep && prm[P_TAIL_HOLD] != 0.0 && tail_work < INFINITY) {
                /* held, its first token would come in the tail, and on m it would not */
                double first_h = queued_h + work(p - top, top, attn);
                double first_m = queued_m + work(p - c0, c0, attn);
                double tail = prm[P_TAIL_HOLD] * tail_work;
                if (first_m <= tail && tail < first_h) keep = 0;
            }
            if (keep) holder->cost = nextafter(cheapest->cost, -INFINITY);
        }
    }

    /* The affinity term: rank in the family's rendezvous order x step. */
    const double spread = prm[P_AFFINITY] * (mean_queued - 1.0) * (double)(p - top);
    if (spread > 0 && n > 1) {
        const double step = spread / (double)(n - 1);
        if (rendezvous(ws, ties, tie_tmp, n, (uint64_t)family) < 0) goto done;
        for (i = 0; i < n; i++) ws[ties[i].idx].cost += (double)i * step;
        start = ties;  /* the final sort starts from this order (read before any reuse) */
    }

    /* The arrival term: the requests this prefill delays, while caches have room. */
    const double room = 1.0 - fill;
    if (prm[P_ARRIVAL] > 0 && room > 0) {
        const double k = prm[P_ARRIVAL] * room * prm[P_PREFILL_S] / 2.0;
        for (i = 0; i < n; i++) {
            Worker *w = &ws[i];
            if (w->rate > 0) {
                double wk = work(p - w->cached, w->cached, attn);
                w->cost += k * w->rate * wk * wk;
            }
        }
    }

    /* The churn term: a prompt no worker caches most of goes where the least was
     * prefilled lately (what comes back there waits behind it; once full, it is evicted). */
    if ((double)top < prm[P_HOLD_MIN] * (double)p) {
        const double k = prm[P_CHURN] + (prm[P_CHURN_FULL] - prm[P_CHURN]) * ramp;
        if (k > 0)
            for (i = 0; i < n; i++) ws[i].cost += k * ws[i].prefills;
    }

    if (sort_ranking(ws, start, by, tmp, ties, tie_tmp, n, (uint64_t)affinity) < 0) goto done;
    order = PyList_New(n);
    costs = PyList_New(n);
    if (order == NULL || costs == NULL) goto done;
    for (i = 0; i < n; i++) {
        PyObject *c = PyFloat_FromDouble(by[i].cost);
        if (c == NULL) goto done;
        PyList_SET_ITEM(costs, i, c);
        PyObject *name = ws[by[i].idx].name;
        Py_INCREF(name);
        PyList_SET_ITEM(order, i, name);
    }
    result = PyTuple_Pack(2, order, costs);
done:
    Py_XDECREF(order);
    Py_XDECREF(costs);
    PyMem_Free(ws);
    PyMem_Free(by);
    PyMem_Free(ties);
    return result;
}

static PyMethodDef methods[] = {
    {"rank", rank, METH_VARARGS,
     "rank(params, loads, matched, prompt_tokens, block_size, affinity, family, prefix_rate) "
     "-> "
     "(workers best first, costs): KvrouteCost.rank in C"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvroute.core._kvcost",
    "kvroute's default policy in C (see kvroute/core/policies/kvroute_cost.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__kvcost(void) {
    packed_name = PyUnicode_InternFromString("packed");
    if (packed_name == NULL) return NULL;
    return PyModule_Create(&module);
}
