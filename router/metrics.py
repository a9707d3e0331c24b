"""Prometheus metrics of one router. The service records into them; the core never sees them."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvroute.core.load import PrefillMode
from kvroute.core.redis_schema import RECORD_KINDS, REJECT_REASONS
from kvroute.router.mirror import PROPAGATION_BOUNDS_S
from kvroute.router.registry import EXCLUSION_REASONS, OWNER_FLIP_S

if TYPE_CHECKING:
    from kvroute.router.mirror import IndexMirror

DECISION_BUCKETS = (10e-6, 25e-6, 50e-6, 100e-6, 200e-6, 300e-6, 500e-6, 1e-3, 2.5e-3, 5e-3,
                    10e-3, 25e-3)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvroute_router_requests",
                                "Requests by API (grpc; http: the OpenAI-compatible front; "
                                "epp: kvroute epp's ext_proc, rpc Process), RPC and outcome",
                                ["api", "rpc", "outcome"], registry=r)
        self.decision_seconds = Histogram(
            "kvroute_router_decision_seconds",
            "Routing decision latency (the prompt's ids read and checked, or tokenized; key "
            "hashing; index lookup; policy)",
            buckets=DECISION_BUCKETS, registry=r)
        self.ttft = Histogram("kvroute_router_ttft_seconds",
                              "Time to first token seen at the router", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.prompt_tokens = Counter("kvroute_router_prompt_tokens", "Prompt tokens routed",
                                     registry=r)
        self.cached_tokens = Counter("kvroute_router_cached_tokens",
                                     "Prompt tokens the serving worker had cached", registry=r)
        self.routed = Counter("kvroute_router_routed", "Requests sent to each worker",
                              ["worker"], registry=r)
        self.overflow = Counter(
            "kvroute_router_program_overflow_branches",
            "Fork children of controller programs sent to another worker than the program's, "
            "because the program's worker could not run them all", registry=r)
        self.retries = Counter("kvroute_router_retries",
                               "Requests retried on the next-best worker", registry=r)
        self.demotions = Counter(
            "kvroute_router_worker_demotions",
            "Times a worker's published blocks were disbelieved for a while: its engine kept "
            "reporting far fewer cached tokens than they promised (router/trust.py)",
            ["worker"], registry=r)
        self.claim_shortfall = Counter(
            "kvroute_router_claimed_uncached_tokens",
            "Prompt tokens the index promised cached on the serving worker that its engine "
            "did not report cached", ["worker"], registry=r)
        self.coalesced = Counter(
            "kvroute_router_coalesced",
            "Requests held until an in-flight sibling's prefill stored the prefix they were "
            "routed to (--predict-ttl-s)", registry=r)
        self.coalesce_declined = Counter(
            "kvroute_router_coalesce_declined",
            "Requests routed again on what workers really hold instead of waiting for an "
            "in-flight prefill that was mostly another request's own (--coalesce-share)",
            registry=r)
        self.copies = Counter(
            "kvroute_router_prefix_copies",
            "Background copies of hot prefixes to a second worker, by outcome: sent, ok, "
            "failed, skipped (--max-copies already in flight)", ["outcome"], registry=r)
        for outcome in ("sent", "ok", "failed", "skipped"):
            self.copies.labels(outcome)  # every series exists from the start, at 0
        self.copied_tokens = Counter(
            "kvroute_router_prefix_copy_tokens",
            "Prompt tokens sent in background copies of hot prefixes", registry=r)
        self.withdrawn = Counter(
            "kvroute_router_predictions_withdrawn",
            "Predicted index entries dropped before their deadline because the request or "
            "background copy they stood for failed before its prefill (--predict-ttl-s)",
            registry=r)
        self.coalesce_wait = Histogram(
            "kvroute_router_coalesce_wait_seconds",
            "How long a coalesced request waited for its sibling's first token",
            buckets=LATENCY_BUCKETS, registry=r)

    def watch(self, mirror: IndexMirror) -> None:
        self.registry.register(_MirrorCollector(mirror))

    def watch_pools(self, mirrors: Mapping[str, IndexMirror]) -> None:
        """Several models' mirrors (router/pools.py): the same metrics, each sample labelled
        with its ``model``."""
        self.registry.register(_ModelsCollector(
            {name: _MirrorCollector(m) for name, m in mirrors.items()}))


class _ModelsCollector(Collector):
    """The samples of several collectors of the same metrics, one family each, labelled
    with the model each came from."""

    def __init__(self, collectors: Mapping[str, Collector]) -> None:
        self._c = dict(collectors)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for model, collector in self._c.items():
            for fam in collector.collect():
                into = families.get(fam.name)
                if into is None:
                    into = families[fam.name] = Metric(fam.name, fam.documentation, fam.type,
                                                       fam.unit)
                into.samples.extend(s._replace(labels={"model": model, **s.labels})
                                    for s in fam.samples)
        yield from families.values()


class _MirrorCollector(Collector):
    def __init__(self, mirror: IndexMirror) -> None:
        self._m = mirror

    def collect(self) -> Iterator[Metric]:
        yield from self._feed()
        yield from self._refusals()
        yield from self._workers()

    def _feed(self) -> Iterator[Metric]:
        """The mirror's state: Redis, the index, the feed's progress and lag."""
        m = self._m
        st = m.stats
        yield GaugeMetricFamily("kvroute_router_redis_up",
                                "1 when the mirror follows Redis; 0 means routing by load alone",
                                value=int(m.available))
        yield GaugeMetricFamily("kvroute_router_index_keys", "Distinct block keys in the index",
                                value=len(m.index))
        yield GaugeMetricFamily("kvroute_router_index_entries",
                                "(block, worker) pairs in the index", value=m.index.entries())
        yield GaugeMetricFamily("kvroute_router_feed_lag_seconds",
                                "Age of the last change-feed entry when it was applied",
                                value=st.lag_s)
        counts = list(itertools.accumulate(st.propagation))
        yield HistogramMetricFamily(
            "kvroute_router_feed_propagation_seconds",
            "Age of each change-feed entry when this mirror applied it (Redis's write time, "
            "from the entry id, to now): written by an agent -> visible to routing",
            buckets=[*((f"{b:g}", c) for b, c in zip(PROPAGATION_BOUNDS_S, counts,
                                                      strict=False)),
                     ("+Inf", counts[-1])],
            sum_value=st.propagation_sum_s)
        for name, doc, v in (
            ("kvroute_router_feed_events_applied", "Change-feed events applied",
             st.events_applied),
            ("kvroute_router_snapshot_loads", "Per-worker snapshot loads", st.snapshot_loads),
            ("kvroute_router_feed_gaps", "Gaps or unannounced epochs healed from snapshots",
             st.gaps),
            ("kvroute_router_feed_malformed", "Malformed feed entries, snapshots, heartbeats",
             st.malformed),
            ("kvroute_router_bootstraps", "Full bootstraps from Redis", st.bootstraps),
        ):
            yield GaugeMetricFamily(name, doc, value=v)

    def _refusals(self) -> Iterator[Metric]:
        """Workers kept or dropped without a heartbeat, records refused, shared decisions."""
        st = self._m.stats
        lost = self._m.lost
        if lost is not None:
            outcomes = CounterMetricFamily(
                "kvroute_router_lost_workers",
                "Workers whose heartbeat was gone from Redis that this router kept because "
                "their agent answered its health check, or dropped because it did not "
                "(router/lost.py)",
                labels=["outcome"])
            outcomes.add_metric(["kept"], lost.kept_total)
            outcomes.add_metric(["dropped"], lost.dropped_total)
            yield outcomes
        apart = CounterMetricFamily(
            "kvroute_router_heartbeat_mismatches",
            "Workers whose cache this mirror held apart from their heartbeat, healed from "
            "their snapshots: another feed chain at the heartbeat's seq (what=chain), or at "
            "two scans running another epoch (epoch) or entries past the heartbeat's seq "
            "(seq): a lost feed entry, or one another agent wrote in their name",
            labels=["what"])
        for what in ("chain", "epoch", "seq"):
            apart.add_metric([what], st.heartbeat_mismatches[what])
        yield apart
        rejected = CounterMetricFamily(
            "kvroute_router_records_rejected",
            "Redis records the mirror refused, by kind (heartbeat, feed, snapshot, member: a "
            "heartbeat key naming no valid worker) and reason; the worker a record is about "
            "is left out of routing until it publishes a valid one", labels=["kind", "reason"])
        for kind in RECORD_KINDS:
            for reason in REJECT_REASONS:
                rejected.add_metric([kind, reason], st.rejected[kind, reason])
        yield rejected
        shared = self._m.shared
        if shared is not None:
            st_shared = shared.stats
            decisions = CounterMetricFamily(
                "kvroute_router_shared_decisions",
                "Routing decisions shared with the other routers (--share-decisions): sent "
                "to Redis, applied here from others, dropped (Redis down, malformed, too old)",
                labels=["direction"])
            for direction in ("sent", "applied", "dropped"):
                decisions.add_metric([direction], getattr(st_shared, direction))
            yield decisions

    def _workers(self) -> Iterator[Metric]:
        """Each worker's load as the policy sees it, and whether it is routable."""
        m = self._m
        inflight = GaugeMetricFamily("kvroute_router_worker_inflight",
                                     "Requests this router has outstanding per worker",
                                     labels=["worker"])
        pending = GaugeMetricFamily("kvroute_router_worker_pending_prefill_tokens",
                                    "Uncached prompt tokens queued per worker", labels=["worker"])
        context = GaugeMetricFamily(
            "kvroute_router_worker_pending_prefill_context",
            "Context the uncached tokens this router sent each worker attend to, in token "
            "pairs (n * (c + n/2) per prefill): the hold rule weighs the queue by it",
            labels=["worker"])
        blocks = GaugeMetricFamily("kvroute_router_worker_cached_blocks",
                                   "Blocks the index holds per worker", labels=["worker"])
        lower = GaugeMetricFamily("kvroute_router_worker_lower_blocks",
                                  "Of those, the blocks its engine holds only in a lower tier "
                                  "(CPU offload, HiCache)", labels=["worker"])
        arrivals = GaugeMetricFamily(
            "kvroute_router_worker_arrival_rate",
            "Requests per second reaching each worker lately (30 s window; the larger of this "
            "router's count and the agent's heartbeat), as the policy sees it",
            labels=["worker"])
        prefills = GaugeMetricFamily(
            "kvroute_router_worker_prefill_rate",
            "Uncached prompt tokens per second each worker prefilled lately (30 s window; the "
            "larger of this router's count and the agent's heartbeat): how fast its cache "
            "turns over once full, as the policy sees it",
            labels=["worker"])
        modes = GaugeMetricFamily(
            "kvroute_router_worker_prefill_mode",
            "1 for how each worker's engine admits a long prompt, as its agent reports it "
            "(whole, chunked, or unknown: the policy's chunked_prefill then decides); the "
            "batch term charges a queue for the whole prompt or its first chunk",
            labels=["worker", "mode"])
        chunk_caps = GaugeMetricFamily(
            "kvroute_router_worker_max_prefill_chunk",
            "Most tokens of one prefill each worker's engine computes per iteration, as its "
            "agent reports it (vLLM's --long-prefill-token-threshold; 0: no cap): the hold "
            "rule counts only the chunks a request there would join",
            labels=["worker"])
        up = GaugeMetricFamily("kvroute_router_worker_routable",
                               "1 if the worker can be routed to", labels=["worker"])
        incompatible = GaugeMetricFamily(
            "kvroute_router_worker_key_mismatch",
            "1 if the worker's block size or key scheme differs from the router's",
            labels=["worker"])
        excluded = GaugeMetricFamily(
            "kvroute_router_worker_excluded",
            "1 if the router sends the worker no traffic for this reason: tokenizer = its "
            "heartbeat reports another tokenizer or vocabulary size than the router's "
            "(--model-source against the router's SOURCE, or --tokenizer, --vocab-size)",
            labels=["worker", "reason"])
        conflicts = CounterMetricFamily(
            "kvroute_router_worker_id_conflicts",
            "Times the worker's heartbeat came back to an address it had left within "
            f"{OWNER_FLIP_S:g} s: two live agents beat under one --worker-id",
            labels=["worker"])
        for info in m.registry.all():
            w = info.worker_id
            conflicts.add_metric([w], info.id_conflicts)
            for reason in EXCLUSION_REASONS:
                excluded.add_metric([w, reason], int(info.excluded == reason))
            ld = m.registry.loads.get(w)
            inflight.add_metric([w], info.inflight)
            pending.add_metric([w], ld.pending_prefill_tokens if ld else 0)
            context.add_metric([w], ld.pending_prefill_context if ld else 0)
            blocks.add_metric([w], m.index.count(w))
            lower.add_metric([w], m.index.count(w) - m.index.gpu_count(w))
            arrivals.add_metric([w], ld.arrival_rate if ld else 0.0)
            prefills.add_metric([w], ld.prefill_rate if ld else 0.0)
            mode = ld.prefill_mode if ld else PrefillMode.UNKNOWN
            for each in PrefillMode:
                modes.add_metric([w, each.value or "unknown"], int(each is mode))
            chunk_caps.add_metric([w], ld.max_prefill_chunk if ld else 0)
            up.add_metric([w], int(ld is not None))
            incompatible.add_metric([w], int(not info.compatible))
        yield from (inflight, pending, context, blocks, lower, arrivals, prefills, modes,
                    chunk_caps, up, incompatible, excluded, conflicts)
