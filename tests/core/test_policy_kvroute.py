"""kvroute's policy: each term's behaviour, and the inlined ranking against the
term-by-term formula on random loads."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvroute.core.index import PrefixIndex
from kvroute.core.load import PrefillMode, WorkerLoad
from kvroute.core.load_table import LoadTable
from kvroute.core.policies import REGISTRY, Kvroute, RouteQuery, make_policy
from kvroute.core.policies.cost_model import CostModel
from kvroute.core.policies.kvroute import (
    COLUMNS_FROM,
    HEAD,
    cache_pressure,
    decode_delay,
    elapsed,
    extension_delay,
    later_arrivals,
    longest_cached,
    own_prefill,
    queued_prefill,
    queued_wait,
    utilisation,
)
from kvroute.router.decide import rank_request

BS = 16


def q(matched: dict[str, int], loads: dict[str, WorkerLoad], prompt: int = 1024,
      affinity: int = 1, lower: dict[str, int] | None = None) -> RouteQuery:
    return RouteQuery(prompt, BS, matched, loads, affinity, lower_blocks=lower or {})


def best(pol: Kvroute, query: RouteQuery) -> str:
    return pol.rank(query)[0].worker


def waits(loads: dict[str, WorkerLoad]) -> list[float]:
    return [queued_wait(ld, Kvroute().attn) for ld in loads.values()]


def test_defaults_come_from_the_cost_model() -> None:
    m, pol = CostModel(), Kvroute()
    assert pol.attn == pytest.approx(m.attn_s_per_token_pair / m.linear_s_per_token)
    assert pol.decode == pytest.approx(m.decode_per_seq_s / m.linear_s_per_token)
    assert pol.unit_s == m.linear_s_per_token
    assert REGISTRY["kvroute"] is Kvroute


def test_parameters_are_range_checked_with_their_meaning() -> None:
    with pytest.raises(ValueError, match=r"reuse must be a finite number in \[0, 1\].*evicted"):
        Kvroute(reuse=1.5)
    with pytest.raises(ValueError, match="most_busy"):
        make_policy("kvroute:most_busy=1")
    assert make_policy("kvroute:delay=2").delay == 2.0  # type: ignore[attr-defined]


def test_wait_prefers_the_idle_worker_when_prefixes_tie() -> None:
    loads = {"a": WorkerLoad(pending_prefill_tokens=3000, queued=1), "b": WorkerLoad()}
    assert best(Kvroute(), q({"a": 20, "b": 20}, loads)) == "b"
    assert best(Kvroute(), q({}, loads)) == "b"


def test_wait_counts_the_attention_of_the_queued_prefill() -> None:
    """Two queues of as many tokens: the one whose prefill attends to a long context takes
    longer, so the request goes to the other."""
    long_ctx = WorkerLoad(pending_prefill_tokens=4000, pending_prefill_context=10**9)
    short_ctx = WorkerLoad(pending_prefill_tokens=4000, pending_prefill_context=0)
    assert queued_wait(long_ctx, Kvroute().attn) > queued_wait(short_ctx, Kvroute().attn)
    assert best(Kvroute(), q({}, {"a": long_ctx, "b": short_ctx})) == "b"


def test_attention_term_grows_with_context() -> None:
    attn = Kvroute().attn
    # The same 1000 new tokens cost more after a longer cached context ...
    assert own_prefill(1000, 30_000, attn) > own_prefill(1000, 1000, attn) > \
        own_prefill(1000, 0, attn) == pytest.approx(1000 * (1 + attn * 500))
    # ... and superlinearly in their own count.
    assert own_prefill(20_000, 0, attn) > 2 * own_prefill(10_000, 0, attn)
    assert own_prefill(1000, 30_000, 0.0) == 1000


def test_lookahead_counts_a_queued_request_sharing_the_prefix() -> None:
    """A request queued on ``a`` will have stored the shared prefix by the time this one
    starts there: the router predicts its blocks on ``a`` (``PrefixIndex.predict``, as it
    does for every request it sends), the match includes them, and ``a`` wins despite its
    queue, where without them the idle ``b`` would."""
    keys = list(range(1000, 1512))  # 512 blocks: 8192 tokens
    loads = {"a": WorkerLoad(pending_prefill_tokens=7680, queued=1, inflight=1),
             "b": WorkerLoad()}
    index = PrefixIndex()
    assert rank_request(Kvroute(), index, keys, 8192, BS, loads, 1).best == "b"
    index.predict("a", keys[:480], deadline=1e9)  # the queued sibling's prompt
    d = rank_request(Kvroute(), index, keys, 8192, BS, loads, 1)
    assert d.query.matched_blocks == {"a": 480}
    assert d.best == "a"


def test_decode_term_prefers_the_smaller_batch_and_counts_iterations() -> None:
    pol = Kvroute()
    small, big = WorkerLoad(running=2), WorkerLoad(running=40)
    assert best(pol, q({}, {"a": big, "b": small})) == "b"
    budgeted = WorkerLoad(running=10, max_batched_tokens=1000)
    one = decode_delay(budgeted, 0, pol.decode)
    assert one == pytest.approx(10 * pol.decode)
    assert decode_delay(budgeted, 3000, pol.decode) == pytest.approx(4 * one)  # 3 more
    assert decode_delay(WorkerLoad(running=10), 3000, pol.decode) == pytest.approx(one)


def test_a_running_prefill_is_counted_half_done() -> None:
    """The router counts a prefill whole until its first token; a request arriving while the
    worker runs it finds half of its first iteration done on average."""
    attn = Kvroute().attn
    one = WorkerLoad(pending_prefill_tokens=6000, max_batched_tokens=16384)
    assert queued_prefill(one, attn) == 6000
    assert elapsed(one, 6000) == 3000 and queued_wait(one, attn) == 3000
    # longer than one iteration: half of the budget's worth is done, the rest all ahead
    long = WorkerLoad(pending_prefill_tokens=40_000, max_batched_tokens=8192)
    assert queued_wait(long, 0.0) == pytest.approx(40_000 - 4096)
    assert queued_wait(WorkerLoad(pending_prefill_tokens=8000), 0.0) == 4000  # no budget
    assert queued_wait(WorkerLoad(), attn) == 0.0


def test_later_arrivals_grow_with_the_cluster_queue_and_make_misses_dearer() -> None:
    """With no queue a holder with a short backlog loses to an idle worker (its own first
    token comes sooner there); once the cluster queues, the miss's redo delays the later
    arrivals too, and the request stays on its prefix."""
    pol = Kvroute()
    calm = {"a": WorkerLoad(pending_prefill_tokens=12_000), "b": WorkerLoad()}
    assert best(pol, q({"a": 20}, calm)) == "b"  # 320 of 1024 tokens cached on a
    crowd = {f"x{i}": WorkerLoad(pending_prefill_tokens=400_000, arrival_rate=2.0,
                                 prefill_rate=5000.0) for i in range(6)}
    busy = {**calm, **crowd}
    k_busy, wait_busy = later_arrivals(busy, waits(busy), pol.unit_s, pol.most_busy)
    k_calm, _ = later_arrivals(calm, waits(calm), pol.unit_s, pol.most_busy)
    assert k_busy * wait_busy > 0.0 == k_calm  # nobody arrives at the calm cluster
    assert best(pol, q({"a": 20}, busy)) == "a"
    assert best(Kvroute(delay=0), q({"a": 20}, busy)) == "b"  # the term removed


def test_utilisation_reads_a_burst_from_the_queue_before_the_rates() -> None:
    """Rates lag a burst; requests waiting show it at once (M/M/1: L = rho / (1 - rho))."""
    pol = Kvroute()
    assert utilisation(0.2, 0.0, 0.9) == 0.2  # no queue: the rates' estimate
    assert utilisation(0.2, 3.0, 0.99) == pytest.approx(0.75)  # L = 3
    assert utilisation(0.2, 3.0, 0.5) == 0.5  # capped
    # in later_arrivals: the same rates, with and without a queue
    quiet = {w: WorkerLoad(prefill_rate=1000.0, arrival_rate=4.0) for w in "ab"}
    burst = {w: WorkerLoad(prefill_rate=1000.0, arrival_rate=4.0, queued=3) for w in "ab"}
    k_quiet, _ = later_arrivals(quiet, waits(quiet), pol.unit_s, 0.99)
    k_burst, _ = later_arrivals(burst, waits(burst), pol.unit_s, 0.99)
    assert k_quiet == pytest.approx(4.0 * pol.unit_s / (1 - 1000.0 * pol.unit_s))
    assert k_burst == pytest.approx(4.0 * pol.unit_s / (1 - 0.75))


def test_later_arrivals_busy_period_is_capped() -> None:
    """A saturated cluster (utilisation >= 1) reads the capped busy period, not a negative
    or infinite one."""
    sat = {"a": WorkerLoad(pending_prefill_tokens=1000, arrival_rate=1.0,
                           prefill_rate=1e6)}
    pol = Kvroute()
    k, wait = later_arrivals(sat, waits(sat), pol.unit_s, pol.most_busy)
    assert k == pytest.approx(1.0 * pol.unit_s / (1 - pol.most_busy))
    assert wait == queued_wait(sat["a"], pol.attn)


def test_the_requests_arriving_meanwhile_make_a_long_redo_dear() -> None:
    """The requests arriving while a prefill runs wait half of it (quadratic in its length),
    and those arriving before the queue ahead drains all of it: with arrivals, a long redo
    loses to a wait on the holder that it would beat without them."""
    k = 2.0 * Kvroute().unit_s  # 2 requests a second, idle
    assert extension_delay(2000, k) == pytest.approx(2000 * k * 1000)
    assert extension_delay(8000, k) == pytest.approx(16 * extension_delay(2000, k))
    loads = {"h": WorkerLoad(pending_prefill_tokens=60_000, arrival_rate=8.0),
             "m": WorkerLoad(arrival_rate=8.0)}
    # 16k tokens, 15k of them cached on h: the redo on m (16k) costs more than h's wait
    assert best(Kvroute(), q({"h": 940}, loads, 16_000)) == "h"
    # without arrivals the redo is only its own prefill, and m's first token comes sooner
    still = {w: WorkerLoad(pending_prefill_tokens=ld.pending_prefill_tokens)
             for w, ld in loads.items()}
    assert best(Kvroute(), q({"h": 940}, still, 16_000)) == "m"


def test_a_hot_prefix_is_copied_when_its_demand_pays_for_it() -> None:
    pol = Kvroute()
    loads = {"h": WorkerLoad(pending_prefill_tokens=20_000), "m": WorkerLoad(),
             "n": WorkerLoad(pending_prefill_tokens=5000)}
    hot = RouteQuery(3000, BS, {"h": 180}, loads, 1, prefix_rate=5.0)
    assert pol.replica(hot, "h") == ("m", 2880)  # the idle worker gets the 180 blocks
    # no demand, or a request that goes elsewhere (it brings the prefix there itself)
    assert pol.replica(RouteQuery(3000, BS, {"h": 180}, loads, 1), "h") is None
    assert pol.replica(hot, "m") is None
    # a trickle of demand does not pay for a copy
    cold = RouteQuery(3000, BS, {"h": 180}, loads, 1, prefix_rate=0.01)
    assert pol.replica(cold, "h") is None
    # every worker holds it, or the others are busier than the holder
    assert pol.replica(RouteQuery(3000, BS, dict.fromkeys(loads, 180), loads, 1,
                                  prefix_rate=5.0), "h") is None
    idle_h = {**loads, "h": WorkerLoad()}
    assert pol.replica(RouteQuery(3000, BS, {"h": 180}, idle_h, 1, prefix_rate=5.0),
                       "h") is None


def test_cache_pressure_charges_copies_that_evict() -> None:
    full = WorkerLoad(capacity_blocks=100, cached_blocks=100)
    roomy = WorkerLoad(capacity_blocks=100, cached_blocks=0)
    assert cache_pressure(800, 500, full, BS, 0.5) == 250.0  # the 500 copied tokens
    assert cache_pressure(800, 1000, full, BS, 0.5) == 400.0  # at most what it evicts
    assert cache_pressure(800, 500, roomy, BS, 0.5) == 0.0  # 1600 tokens free: no eviction
    assert cache_pressure(800, 0, full, BS, 0.5) == 0.0  # nothing copied: new content
    assert cache_pressure(800, 500, WorkerLoad(), BS, 0.5) == 0.0  # capacity unknown
    # Between two equally busy workers without the prefix, the one with room takes it.
    loads = {"h": WorkerLoad(pending_prefill_tokens=50_000, capacity_blocks=1000,
                             cached_blocks=1000),
             "f": full_copy(), "r": roomy_copy()}
    query = q({"h": 60}, loads, 1024)
    assert longest_cached(query) == 960
    costs = Kvroute().costs_by_terms(query)
    assert costs["f"] > costs["r"]


def full_copy() -> WorkerLoad:
    return WorkerLoad(capacity_blocks=1000, cached_blocks=1000)


def roomy_copy() -> WorkerLoad:
    return WorkerLoad(capacity_blocks=1000, cached_blocks=0)


def test_a_prefix_in_a_lower_tier_costs_its_load_not_its_prefill() -> None:
    """A worker holding the prompt's prefix only in CPU memory loads it back (tokens x the
    tier's seconds per token / unit_s): dearer than the same prefix in GPU memory, far
    cheaper than recomputing it; the worker's own report of its tier beats the default."""
    pol = Kvroute()
    idle = WorkerLoad()
    loads = {"gpu": idle, "cpu": idle, "cold": idle}
    query = q({"gpu": 256, "cpu": 256}, loads, prompt=4096, lower={"cpu": 256})
    costs = pol.costs_by_terms(query)
    assert costs["gpu"] < costs["cpu"] < costs["cold"]
    load = pol.terms(query, "cpu", pol.later(query), longest_cached(query))["load"]
    assert load == pytest.approx(4096 * CostModel().lower_tier_s_per_token / pol.unit_s)
    assert load == pytest.approx(4096 * 0.061, rel=0.01)  # 6% of a prefill per token
    assert costs["cpu"] - costs["gpu"] == pytest.approx(load)
    # Only the blocks after the GPU ones load: 100 of 256 below, 1,600 tokens.
    part = q({"cpu": 256}, {"cpu": idle}, prompt=4096, lower={"cpu": 100})
    assert pol.load(part, "cpu") == pytest.approx(1600 * 0.061, rel=0.01)
    # A slow tier (a disk at 0.5 GB/s: 2.6e-4 s a token, 3x the prefill) is worse than a miss.
    slow = {"cpu": WorkerLoad(lower_tier_s_per_token=131072 / 0.5e9), "cold": idle}
    assert best(pol, q({"cpu": 256}, slow, prompt=4096, lower={"cpu": 256})) == "cold"


def test_ranks_every_worker_and_empty_loads() -> None:
    loads = {f"w{i}": WorkerLoad(queued=i % 3, pending_prefill_tokens=100 * i)
             for i in range(9)}
    assert sorted(s.worker for s in Kvroute().rank(q({"w3": 5}, loads))) == sorted(loads)
    assert list(Kvroute().rank(q({}, {}))) == []


loads_st = st.builds(
    WorkerLoad,
    inflight=st.integers(0, 40), running=st.integers(0, 40), queued=st.integers(0, 10),
    free_blocks=st.integers(0, 3000), capacity_blocks=st.sampled_from([0, 1000, 3000]),
    pending_prefill_tokens=st.integers(0, 100_000), cached_blocks=st.integers(0, 3500),
    max_running=st.sampled_from([0, 64]), max_batched_tokens=st.sampled_from([0, 8192, 16384]),
    arrival_rate=st.floats(0, 20), pending_prefill_context=st.integers(0, 10**10),
    prefill_rate=st.floats(0, 50_000),
    prefill_mode=st.sampled_from(list(PrefillMode)),
    lower_tier_s_per_token=st.sampled_from([0.0, 5e-6, 1e-4]))


def some_lower(matched: dict[str, int], lowers: list[int]) -> dict[str, int]:
    """Of each match, the last ``lowers[i]`` blocks held only in a lower tier."""
    return {w: min(m, low) for (w, m), low in zip(matched.items(), lowers, strict=False)
            if low}


@settings(max_examples=300, deadline=None)
@given(loads=st.lists(loads_st, min_size=1, max_size=12),
       matches=st.lists(st.integers(0, 700), min_size=12, max_size=12),
       prompt=st.integers(1, 12_000), delay=st.sampled_from([0.0, 1.0, 3.0]),
       reuse=st.sampled_from([0.0, 0.5, 1.0]),
       lowers=st.lists(st.integers(0, 700), max_size=12))
def test_inlined_ranking_equals_the_term_by_term_oracle(
        loads: list[WorkerLoad], matches: list[int], prompt: int, delay: float,
        reuse: float, lowers: list[int]) -> None:
    named = {f"w{i}": ld for i, ld in enumerate(loads)}
    matched = {w: m for w, m in zip(named, matches, strict=False) if m}
    query = q(matched, named, prompt, affinity=prompt, lower=some_lower(matched, lowers))
    pol = Kvroute(delay=delay, reuse=reuse)
    oracle = pol.costs_by_terms(query)
    ranked = pol.rank(query)
    assert {s.worker: s.cost for s in ranked} == oracle  # the very same floats
    costs = [s.cost for s in ranked]
    assert costs == sorted(costs)


@settings(max_examples=200, deadline=None)
@given(loads=st.lists(loads_st, min_size=1, max_size=80),
       matches=st.lists(st.integers(0, 700), min_size=80, max_size=80),
       prompt=st.integers(1, 12_000), delay=st.sampled_from([0.0, 1.0, 3.0]),
       reuse=st.sampled_from([0.0, 0.5, 1.0]), removed=st.integers(0, 79),
       lowers=st.lists(st.integers(0, 700), max_size=80))
def test_the_columns_rank_as_the_loop(loads: list[WorkerLoad], matches: list[int], prompt: int,
                                      delay: float, reuse: float, removed: int,
                                      lowers: list[int]) -> None:
    """Over a LoadTable (the router's loads, kept in columns) the ranking is the loop's: the
    same workers in the same order, the same costs but for the averages' last bits; rows
    stay in step with the dict as workers come, change and go."""
    table = LoadTable()
    for i, ld in enumerate(loads):
        table[f"w{i}"] = ld
    table.pop(f"w{removed}", None)  # a worker gone: the rows after it move up
    table.pop("w0", None)
    if loads:
        table["w0"] = loads[-1]  # back, last
    if not table:
        return
    matched = {w: m for w, m in zip(table, matches, strict=False) if m}
    lower = some_lower(matched, lowers)
    query = q(matched, table, prompt, affinity=prompt, lower=lower)
    pol = Kvroute(delay=delay, reuse=reuse)
    columns = pol.rank_columns(query, table)
    loop = pol.rank(q(matched, dict(table), prompt, affinity=prompt, lower=lower))
    assert [s.worker for s in columns] == [s.worker for s in loop]
    assert [s.cost for s in columns] == pytest.approx([s.cost for s in loop], rel=1e-12)


def test_the_columns_break_long_runs_of_ties_as_the_loop() -> None:
    """A quiet cluster: its workers differ only in their running sequences, so most of the
    ranking is runs of equal costs, each in the request's rendezvous order."""
    table = LoadTable()
    for i in range(3 * COLUMNS_FROM):
        table[f"w{i:03d}"] = WorkerLoad(running=i % 4)
    matched = {"w007": 10, "w100": 10, "w150": 20}
    for affinity in range(6):
        query = q(matched, table, 4096, affinity=affinity)
        loop = Kvroute().rank(q(matched, dict(table), 4096, affinity=affinity))
        columns = Kvroute().rank_columns(query, table)
        assert columns[5].worker == loop[5].worker  # read alone first: its run only
        assert [s.worker for s in columns] == [s.worker for s in loop]


def test_the_routers_rankings_over_many_workers_take_the_columns() -> None:
    many = LoadTable()
    for i in range(COLUMNS_FROM):
        many[f"w{i}"] = WorkerLoad(pending_prefill_tokens=10 * i)
    assert Kvroute().rank(q({}, many))[0].worker == "w0"
    assert [s.worker for s in Kvroute().rank(q({}, many))] == \
        [s.worker for s in Kvroute().rank_columns(q({}, many), many)]


@settings(max_examples=200, deadline=None)
@given(loads=st.lists(loads_st, min_size=COLUMNS_FROM, max_size=COLUMNS_FROM + 20),
       matches=st.lists(st.integers(0, 400), min_size=COLUMNS_FROM + 20,
                        max_size=COLUMNS_FROM + 20),
       prompt=st.integers(1, 8_000), rate=st.sampled_from([0.5, 5.0, 50.0]),
       delay=st.sampled_from([0.0, 1.0]), holder=st.integers(0, COLUMNS_FROM - 1),
       idle=st.integers(0, COLUMNS_FROM + 19))
def test_the_columns_place_a_replica_as_the_loop(loads: list[WorkerLoad], matches: list[int],
                                                 prompt: int, rate: float, delay: float,
                                                 holder: int, idle: int) -> None:
    """Over many workers, ``replica`` reads the load columns: the same copy as the loop's
    (an idle twin of the shortest wait makes ties by name matter)."""
    table = LoadTable()
    for i, ld in enumerate(loads):
        table[f"w{i:03d}"] = ld
    if idle < len(loads):
        table[f"w{idle:03d}"] = table["w000"] = WorkerLoad()
    matched = {w: m for w, m in zip(table, matches, strict=False) if m}
    matched[f"w{holder:03d}"] = max(matches) or 1
    pol = Kvroute(delay=delay)
    columns = pol.replica(RouteQuery(prompt, BS, matched, table, 1, prefix_rate=rate),
                          f"w{holder:03d}")
    loop = pol.replica(RouteQuery(prompt, BS, matched, dict(table), 1, prefix_rate=rate),
                       f"w{holder:03d}")
    event("copy" if loop else "none")
    assert columns == loop


@settings(max_examples=200, deadline=None)
@given(costs=st.lists(st.integers(0, 6), min_size=4 * HEAD + 1, max_size=120),
       reads=st.lists(st.integers(-120, 119) | st.slices(130), max_size=6),
       affinity=st.integers(0, 2**64 - 1))
def test_a_ranking_read_in_any_order_is_the_whole_sort(costs: list[int],
                                                       reads: list[int | slice],
                                                       affinity: int) -> None:
    """Over the load columns only the cheapest workers are sorted at once (every one costing
    no more than the HEAD-th, so a run of ties is never cut): read in any order, by index or
    slice, past the head or back from the end, the ranking is the one of the whole sort."""
    table = LoadTable()
    for i, pending in enumerate(costs):
        table[f"w{i:03d}"] = WorkerLoad(pending_prefill_tokens=1000 * pending)
    query = q({}, table, 512, affinity=affinity)
    whole = list(Kvroute().rank(q({}, dict(table), 512, affinity=affinity)))
    ranking = Kvroute().rank_columns(query, table)
    assert len(ranking) == len(costs)
    for i in reads:
        if isinstance(i, slice) or -len(costs) <= i < len(costs):
            assert ranking[i] == whole[i]
    assert list(ranking) == whole


def test_a_ranking_refuses_an_index_past_either_end() -> None:
    table = LoadTable()
    for i in range(4 * HEAD + 8):
        table[f"w{i:03d}"] = WorkerLoad(pending_prefill_tokens=10 * i)
    ranking = Kvroute().rank_columns(q({}, table, 512), table)
    assert ranking[-len(table)].worker == "w000"
    for i in (len(table), -len(table) - 1):
        with pytest.raises(IndexError):
            ranking[i]


def test_iterating_a_ranking_sorts_the_rest_only_when_read_past_the_head() -> None:
    table = LoadTable()
    for i in range(8 * HEAD):
        table[f"w{i:03d}"] = WorkerLoad(pending_prefill_tokens=10 * (i % 16))
    ranking = Kvroute().rank_columns(q({}, table, 512), table)
    whole = list(Kvroute().rank(q({}, dict(table), 512)))
    assert next(iter(ranking)) == whole[0]
    assert ranking._rest is not None  # the router's retry loop stops here
    assert list(itertools.islice(ranking, 3 * HEAD)) == whole[:3 * HEAD]
    assert ranking._rest is None and list(ranking) == whole


def test_a_slice_of_the_head_leaves_the_rest_unsorted() -> None:
    """A Route response lists the best few (``--route-candidates``): slicing them must not
    sort and tie-break all the workers (over 1,000 workers that was most of a Route)."""
    table = LoadTable()
    for i in range(8 * HEAD):
        table[f"w{i:03d}"] = WorkerLoad(pending_prefill_tokens=10 * (i % 16))
    ranking = Kvroute().rank_columns(q({}, table, 512), table)
    whole = list(Kvroute().rank(q({}, dict(table), 512)))
    assert ranking[:4] == whole[:4]
    assert ranking._rest is not None
    assert ranking[2:HEAD * 3:2] == whole[2:HEAD * 3:2] and ranking._rest is None


def test_a_slice_counted_from_the_end_reads_the_whole_ranking_not_the_head() -> None:
    table = LoadTable()
    for i in range(100):  # 40 tie at the least cost: the head is 40 of the 100
        table[f"w{i:03d}"] = WorkerLoad(pending_prefill_tokens=0 if i < 40 else 10 * i)
    whole = list(Kvroute().rank(q({}, dict(table), 512)))
    for s in (slice(None, -70), slice(-75, -65), slice(35, 5, -3)):
        ranking = Kvroute().rank_columns(q({}, table, 512), table)
        assert ranking[s] == whole[s]
