"""Prometheus metrics of one agent. They wrap the engine and publisher; neither knows them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvroute.worker_agent.controller.stats import ProgramStats
    from kvroute.worker_agent.engines.base import Engine
    from kvroute.worker_agent.publisher import CachePublisher

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class AgentMetrics:
    def __init__(self, worker_id: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvroute_agent_requests", "Requests by outcome",
                                ["outcome"], registry=r)
        self.prompt_tokens = Counter("kvroute_agent_prompt_tokens", "Prompt tokens received",
                                     registry=r)
        self.cached_tokens = Counter("kvroute_agent_cached_tokens",
                                     "Prompt tokens served from the prefix cache", registry=r)
        self.generated_tokens = Counter("kvroute_agent_generated_tokens", "Tokens generated",
                                        registry=r)
        self.ttft = Histogram("kvroute_agent_ttft_seconds", "Time to first token at the agent",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.worker_id = worker_id

    def watch(self, engine: Engine, publisher: CachePublisher,
              programs: ProgramStats | None = None) -> None:
        self.registry.register(_StateCollector(engine, publisher, programs))


class _StateCollector(Collector):
    """Read engine load and publisher state at scrape time."""

    def __init__(self, engine: Engine, publisher: CachePublisher,
                 programs: ProgramStats | None) -> None:
        self._engine = engine
        self._pub = publisher
        self._programs = programs

    def collect(self) -> Iterator[Metric]:
        load = self._engine.load()
        st = self._pub.stats
        for name, doc, value in (
            ("kvroute_agent_running", "Sequences in the running batch", load.running),
            ("kvroute_agent_queued", "Requests waiting for capacity", load.queued),
            ("kvroute_agent_free_blocks", "Free KV blocks", load.free_blocks),
            ("kvroute_agent_capacity_blocks", "KV capacity in blocks", load.capacity_blocks),
            ("kvroute_agent_pending_prefill_tokens", "Uncached prompt tokens queued",
             load.pending_prefill_tokens),
            ("kvroute_agent_redis_up", "1 if the last Redis write succeeded", int(st.redis_up)),
            ("kvroute_agent_publish_pending", "Cache events not yet in Redis", st.pending),
            ("kvroute_agent_cache_events_published", "Cache events written to the feed",
             st.events_published),
            ("kvroute_agent_resyncs", "Full snapshot rewrites (new epochs)", st.resyncs),
            ("kvroute_agent_redis_state_losses", "Times Redis was found without this worker's "
             "epoch or with another snapshot size than its writes left (each rewrites it)",
             st.state_losses),
            ("kvroute_agent_feed_seq", "Last feed seq written in this epoch", self._pub.seq),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        if self._programs is not None:
            ps = self._programs
            yield _by_label(
                "kvroute_agent_program_overflow_children",
                "Fork children a router's placement moved to another worker, by outcome: sent "
                "there, fallback (run here: that worker failed before answering), kept (run "
                "here: an open constraint cannot travel)", "outcome",
                sent=ps.overflow_sent, fallback=ps.overflow_fallback, kept=ps.overflow_kept)
            yield _by_label(
                "kvroute_agent_program_forks",
                "Forks of two or more children run here, by how the children started: led (the "
                "first prefilled the shared prefix, the others followed), cached (the prefix "
                "was cached: all at once), warmed (of the led, those whose first child ended "
                "before any prefill, so a warm-up request ran)", "start",
                led=ps.forks_led, cached=ps.forks_cached, warmed=ps.forks_warmed)
        # Engines may export their own families (the vllm adapter: frames, replays, resets).
        extra = getattr(self._engine, "metric_families", None)
        if extra is not None:
            yield from extra()


def _by_label(name: str, doc: str, label: str, **counts: int) -> CounterMetricFamily:
    """A counter family with one sample per value of ``label`` (``counts``: value -> count)."""
    fam = CounterMetricFamily(name, doc, labels=[label])
    for value, n in counts.items():
        fam.add_metric([value], n)
    return fam
