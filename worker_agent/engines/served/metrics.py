"""The adapter families a served engine adds to the agent's /metrics:
``kvroute_agent_<kind>_*`` (frames, replays, resets, liveness), the same for every server."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvroute.worker_agent.engines.served.blockmap import BlockMap
from kvroute.worker_agent.engines.served.poller import MetricsStats
from kvroute.worker_agent.engines.served.subscriber import SubscriberStats


def adapter_families(kind: str, product: str, s: SubscriberStats, blocks: BlockMap,
                     m: MetricsStats, alive: bool) -> Iterator[Metric]:
    """``s``: the event stream's counts; ``blocks``: the cache view; ``m``: the /metrics
    poller's counts; ``alive``: whether the server answers."""
    b = blocks.stats
    p = f"kvroute_agent_{kind}_"
    rej = CounterMetricFamily(p + "frames_rejected", "KV-event frames rejected, by reason",
                              labels=["reason"])
    for reason, n in sorted(s.rejected.items()):
        rej.add_metric([reason], n)
    yield rej
    skipped = CounterMetricFamily(p + "blocks_skipped",
                                  f"{product} blocks not published, by reason",
                                  labels=["reason"])
    for reason, n in (("block_size", b.block_size_mismatch),
                      ("unknown_parent", b.unknown_parent), ("opaque", b.opaque_blocks),
                      ("unknown_removal", b.unknown_removals),
                      ("unknown_copy", b.unknown_copies),
                      ("key_conflict", b.key_conflicts)):
        skipped.add_metric([reason], n)
    yield skipped
    for name, doc, value in (
        ("frames", "Live KV-event frames received", s.frames),
        ("batches", "KV-event batches applied (live or replayed)", s.batches),
        ("events", "KV events applied", s.events),
        ("unknown_events", "KV events of an unknown type skipped", s.unknown_events),
        ("duplicates", "Live batches already applied from a replay", s.duplicates),
        ("replayed_batches", "Batches applied from the replay socket", s.replayed_batches),
        ("gaps_healed", "Seq gaps healed from the replay socket", s.gaps_healed),
        ("replay_failures", "Replay requests unanswered or cut short", s.replay_failures),
        ("silent_recoveries", "Idle replay probes that found batches while the live "
         f"stream never delivered a frame ({product}'s publisher connecting instead of "
         "binding)", s.silent_recoveries),
        ("view_resets", "Cache-view resets (CLEAR, then re-learn): new epochs", s.resets),
        ("publisher_restarts", f"{product} event-publisher restarts detected", s.restarts),
        ("metrics_errors", f"Failed polls of {product}'s /metrics", m.errors),
    ):
        yield CounterMetricFamily(p + name, doc, value=value)
    for name, doc, value in (
        ("last_seq", "Last KV-event seq applied", s.last_seq),
        ("view_complete", f"1 if the cache view covers {product}'s whole event history",
         int(s.complete)),
        ("engine_hashes", f"{product} block hashes tracked", blocks.engine_hashes),
        ("cached_keys", "kvroute block keys published as cached", blocks.cached_count),
        ("lower_keys", "Of those, the keys held only in a lower tier (CPU offload, HiCache)",
         blocks.lower_count),
        ("metrics_up", f"1 if the last poll of {product}'s /metrics succeeded", int(m.up)),
        ("up", f"1 while {product} answers; at 0 its blocks are withdrawn and the agent "
         "sends no heartbeat", int(alive)),
        ("metrics_age_seconds", "Seconds since the last good /metrics poll",
         time.monotonic() - m.last_ok if m.last_ok else -1.0),
    ):
        yield GaugeMetricFamily(p + name, doc, value=value)
