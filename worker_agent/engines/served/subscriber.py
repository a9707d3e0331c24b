"""Follows vLLM's KV-event stream: ZMQ SUB, seq tracking, replay, resets.

Every batch is applied exactly once, in seq order, or the view is reset:

* **Start:** with a replay endpoint, ask for everything from seq 0. If the reply starts at 0
  the view is *complete* (it saw the engine's whole history); else it is incomplete (it starts
  empty and learns from new events). Without a replay endpoint the first live frame decides.
* **In order** (``seq == next``): applied. **Behind** (``seq < next``) but ahead of the last
  live frame: a batch already applied from a replay; skipped as a duplicate.
* **Gap** (``seq > next``): ask the replay socket for ``next..``; if its buffer still starts
  at or before ``next`` the missing batches are applied in order (healed). Otherwise the
  batches are gone: **reset** (a new epoch of this view: ``Op.CLEAR``, then re-learn from the
  batches that follow; the router under-reports this worker's cache until vLLM stores the
  blocks again, never over-reports).
* **Publisher restart** (vLLM restarted: empty cache, seqs from 0 again). Checked when the
  live stream goes backwards (``seq <= last live seq``) and after the SUB connection dropped
  (a socket monitor reports it): the replay socket is asked for the last applied seq; if it
  no longer has it, or has different bytes under it, the publisher is a new one: reset and
  follow it from 0 (replaying what it has). Without a replay endpoint, seq 0 or two
  consecutive backward frames count as a restart. A backward frame from the same publisher
  is rejected as ``out_of_order``.
* **Idle:** after ``probe_s`` without live frames the replay socket is asked for anything
  from ``next`` on, which heals a lost *last* batch (no later frame would reveal that gap).
  A batch found there counts as lost only if it does not arrive live within 50 ms: vLLM
  buffers a batch as it publishes it, so a probe can race the frame on its way.
* **Malformed** frames (wrong frame count, seq width, topic, msgpack, layout) are rejected
  with a logged reason and counted; they never change the seq state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import xxhash
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvroute.worker_agent.engines.served.wire import (
    Batch,
    FrameError,
    decode_batch,
    encode_seq,
    parse_live,
    parse_replay,
)

log = logging.getLogger("kvroute.agent.vllm")

_DRAIN = 256  # live frames handled per loop turn before yielding to other tasks
_IN_FLIGHT_MS = 50  # how long a probe waits for a batch the replay holds to arrive live
_digest = xxhash.xxh3_64_intdigest

# (seq, digest of the payload, decoded batch)
Replayed = tuple[int, int, Batch]


SILENT_STREAM = ("the live kv-event stream has delivered nothing while vLLM's replay socket "
                 "holds new batches: the cache view follows only by idle replay probes. vLLM's "
                 "publisher most likely connects instead of binding (its endpoint must be "
                 "tcp://*:PORT or ipc://..., not tcp://HOST:PORT; the agent's --vllm-events "
                 "is then tcp://HOST:PORT)")


@dataclass
class SubscriberStats:
    frames: int = 0  # live frames received
    batches: int = 0  # batches applied (live or replayed)
    events: int = 0  # events applied
    unknown_events: int = 0  # events of unknown type skipped
    duplicates: int = 0  # live batches already applied from a replay
    replayed_batches: int = 0
    gaps_healed: int = 0  # gaps (incl. idle tail probes that found batches) healed by replay
    silent_recoveries: int = 0  # idle probes that found batches while no live frame ever came
    replay_failures: int = 0  # replay requests unanswered or cut short
    resets: int = 0  # view reset (CLEAR): unhealable gap or publisher restart
    restarts: int = 0  # publisher restarts detected
    disconnects: int = 0  # SUB connection drops seen by the socket monitor
    rejected: Counter[str] = field(default_factory=Counter)  # reason -> frames
    last_seq: int = -1
    complete: bool = False  # view started from seq 0 with no unhealed gap since
    last_frame_at: float = 0.0


class BatchSink:
    """What the subscriber drives (the engine): apply a batch, or reset the view."""

    def apply_batch(self, seq: int, batch: Batch) -> None:  # pragma: no cover - protocol
        raise NotImplementedError

    def reset_view(self, reason: str) -> None:  # pragma: no cover - protocol
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class SubscriberConfig:
    events: str
    replay: str = ""
    topic: str = ""
    replay_timeout_s: float = 1.0  # silence on the replay socket that ends a replay
    probe_s: float = 1.0  # idle time before asking the replay socket for a lost tail
    rcvhwm: int = 100_000  # as vLLM's PUB hwm: queue a burst rather than drop it


class EventSubscriber:
    def __init__(self, cfg: SubscriberConfig, sink: BatchSink,
                 ctx: zmq.asyncio.Context | None = None) -> None:
        self.cfg = cfg
        self._sink = sink
        self._ctx = ctx or zmq.asyncio.Context()
        self._own_ctx = ctx is None
        self._topic = cfg.topic.encode()
        self.stats = SubscriberStats()
        self._next: int | None = None  # next seq to apply
        self._last_digest = 0  # digest of the payload applied at seq next - 1
        self._live_last: int | None = None  # last seq seen on the live stream
        self._behind_last: int | None = None  # last rejected backwards seq (no-replay probe)
        self._verify = False  # the SUB connection dropped: check the publisher is the same
        self._verified_next: int | None = None  # publisher confirmed unchanged at this next
        self._sub: zmq.asyncio.Socket | None = None
        self._mon: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._warned: dict[str, float] = {}
        self.ready = asyncio.Event()  # set once the start-up replay is done

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.cfg.rcvhwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._mon = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(self.cfg.events)
        self._sub = sub
        self._task = asyncio.create_task(self._run(), name="vllm-kv-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sub is not None:
            self._sub.disable_monitor()
        for s in (self._mon, self._sub, self._dealer):
            if s is not None:
                s.close(linger=0)
        self._sub = self._mon = self._dealer = None
        if self._own_ctx:
            self._ctx.term()

    # -- main loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        if self.cfg.replay:
            await self._initial_sync()
        self.ready.set()
        while True:
            try:
                await self._follow()
            except asyncio.CancelledError:
                raise
            except Exception:
                # A bug must not silently stop the view: log, reset, keep following.
                log.exception("kv-event loop failed; resetting the cache view")
                self._reset("internal error")
                self._next = self._live_last = None
                await asyncio.sleep(0.1)

    async def _follow(self) -> None:
        assert self._sub is not None and self._mon is not None
        sub, mon = self._sub, self._mon
        drain = zmq.Socket.shadow(sub.underlying)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll(self.cfg.probe_s * 1000))
            if not ready:
                if self._verify and self.cfg.replay:
                    # Reconnected (or still down): a restarted vLLM is found through its
                    # replay socket before it publishes anything.
                    restarted = await self._publisher_restarted(None)
                    if restarted is not None:
                        self._verify = False
                    if restarted:
                        self._restarted(None)
                if self.cfg.replay and self._next is not None:
                    await self._probe_tail()
                continue
            if mon in ready:
                while True:
                    try:
                        msg = await mon.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if parse_monitor_message(msg)["event"] == zmq.EVENT_DISCONNECTED:
                        self.stats.disconnects += 1
                        self._verify = True
                        self._verified_next = None
            if sub in ready:
                for _ in range(_DRAIN):
                    try:
                        # Non-blocking reads on a synchronous shadow of the same socket:
                        # no future per frame (a third of the ingest cost otherwise).
                        frames = drain.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    await self._on_live(frames)
            await asyncio.sleep(0)  # let the publisher and request handlers run

    async def _initial_sync(self) -> None:
        # Let the SUB connection settle first, so batches published after the replay's
        # snapshot arrive live (a batch lost in between shows up as a gap or tail later).
        await asyncio.sleep(0.05)
        got = await self._replay_from(0)
        if got is None:
            return  # no replay server: the first live frame decides
        if not got:
            self._next, self.stats.complete = 0, True  # nothing published yet
            return
        first = got[0][0]
        self.stats.complete = first == 0
        if first != 0:
            log.info("vLLM replay buffer starts after seq 0: the cache view starts empty and "
                     "fills as vLLM stores blocks", extra={"kv": {"first_seq": first}})
        self._next = first
        self._apply_run(got)

    # -- live frames -------------------------------------------------------------------------

    async def _on_live(self, frames: list[bytes]) -> None:
        st = self.stats
        st.frames += 1
        st.last_frame_at = time.monotonic()
        try:
            f = parse_live(frames)
            if self._topic and f.topic != self._topic:
                raise FrameError("topic", f"topic {f.topic[:64]!r}")
            batch = decode_batch(f.payload)
        except FrameError as exc:
            self._reject(exc, frames)
            return
        backwards = self._live_last is not None and f.seq <= self._live_last
        if self._verify or (backwards and self._verified_next != self._next):
            self._verify = False
            if await self._publisher_restarted(f.seq):
                self._restarted(f.seq)
        if self._live_last is not None and f.seq <= self._live_last:
            self._behind_last = f.seq
            self._reject(FrameError("out_of_order", f"seq {f.seq} after {self._live_last}"),
                         frames)
            return
        self._behind_last = None
        if self._next is None:
            self._next = f.seq
            st.complete = f.seq == 0
        if f.seq < self._next:
            st.duplicates += 1  # applied from a replay already
        elif f.seq == self._next:
            self._apply(f.seq, _digest(f.payload), batch)
        else:
            await self._heal(f.seq, _digest(f.payload), batch)
        self._live_last = f.seq

    async def _publisher_restarted(self, seq: int | None) -> bool | None:
        """Is the publisher a new process? Asks the replay socket for the last applied batch
        and compares its bytes; without an answer, guesses from the live seq (None: cannot
        tell)."""
        if self._next is None or self._next == 0:
            return False  # nothing applied: nothing to lose
        if self.cfg.replay:
            last = self._next - 1
            got = await self._replay_from(last)
            if got is not None:
                same = bool(got) and got[0][0] == last and got[0][1] == self._last_digest
                if same:
                    self._verified_next = self._next  # stray frames need not ask again
                return not same
        if seq is None:
            return None
        return seq == 0 or (self._behind_last is not None and seq == self._behind_last + 1)

    def _restarted(self, seq: int | None) -> None:
        st = self.stats
        st.restarts += 1
        log.warning("vLLM event publisher restarted; resetting the cache view",
                    extra={"kv": {"seq": seq, "previous": self._live_last}})
        self._reset("publisher restarted")
        # The new publisher's history starts at 0: following it from there (live, or by
        # replay if frame 0 was lost) makes the view complete again.
        self._next, self._live_last, self._verified_next, st.complete = 0, None, None, True

    async def _heal(self, seq: int, digest: int, batch: Batch) -> None:
        assert self._next is not None
        want = self._next
        got = await self._replay_from(want) if self.cfg.replay else None
        if got and got[0][0] <= want:
            self.stats.gaps_healed += 1
            log.info("kv-event gap healed from the replay buffer",
                     extra={"kv": {"from": want, "to": seq - 1, "replayed": len(got)}})
            self._apply_run(got)
        else:
            first = got[0][0] if got else None
            log.warning("kv-event gap beyond the replay buffer; resetting the cache view",
                        extra={"kv": {"missing_from": want, "seq": seq,
                                      "replay_first": first}})
            self._reset(f"gap {want}..{seq - 1} not replayable")
            self._next = first if first is not None and first <= seq else seq
            if got:
                self._apply_run(got)
        if self._next == seq:
            self._apply(seq, digest, batch)
        elif self._next < seq:
            # The replay ended short of this frame (it should not): start over from here.
            self._reset(f"replay ended at {self._next - 1} before {seq}")
            self._next = seq
            self._apply(seq, digest, batch)

    async def _probe_tail(self) -> None:
        assert self._next is not None and self._sub is not None
        got = await self._replay_from(self._next)
        if got and await self._sub.poll(_IN_FLIGHT_MS, zmq.POLLIN):
            return  # vLLM stores a batch as it sends it: the live frame was on its way
        if got and got[0][0] == self._next:
            self.stats.gaps_healed += 1
            kv = {"from": self._next, "replayed": len(got)}
            if self.stats.frames:
                log.info("lost kv-event batches recovered while idle", extra={"kv": kv})
            else:
                # vLLM publishes, yet nothing ever came live: the view lags by probe_s.
                self.stats.silent_recoveries += 1
                self._warn("silent_stream", SILENT_STREAM, {**kv, "events": self.cfg.events})
            self._apply_run(got)  # should the lost frames still arrive: duplicates
        elif got and got[0][0] > self._next:
            self._reset(f"tail {self._next}..{got[0][0] - 1} not replayable")
            self._next = got[0][0]
            self._apply_run(got)

    def _apply_run(self, got: list[Replayed]) -> None:
        """Apply replayed batches from ``self._next`` on; stop at a hole."""
        for seq, digest, batch in got:
            if self._next is not None and seq < self._next:
                continue
            if seq != self._next:
                break
            self.stats.replayed_batches += 1
            self._apply(seq, digest, batch)

    def _apply(self, seq: int, digest: int, batch: Batch) -> None:
        st = self.stats
        self._sink.apply_batch(seq, batch)
        st.batches += 1
        st.events += len(batch.events)
        if batch.unknown_events:
            st.unknown_events += batch.unknown_events
            self._warn("unknown_event", "skipping kv events of an unknown type",
                       {"seq": seq, "count": batch.unknown_events})
        st.last_seq = seq
        self._next = seq + 1
        self._last_digest = digest

    def _reset(self, reason: str) -> None:
        self.stats.resets += 1
        self.stats.complete = False
        self._sink.reset_view(reason)

    def _reject(self, exc: FrameError, frames: list[bytes]) -> None:
        self.stats.rejected[exc.reason] += 1
        self._warn(exc.reason, "rejected kv-event frame", {
            "reason": exc.reason, "detail": exc.detail, "frames": len(frames),
            "total": self.stats.rejected[exc.reason]})

    def _warn(self, key: str, msg: str, kv: dict[str, object]) -> None:
        # At most one line per reason per 10 s: a flood of bad frames must not flood the log.
        now = time.monotonic()
        if now - self._warned.get(key, -1e9) >= 10.0:
            self._warned[key] = now
            log.warning(msg, extra={"kv": kv})

    # -- replay ------------------------------------------------------------------------------

    async def _replay_from(self, start: int) -> list[Replayed] | None:
        """Batches with seq >= start from the replay socket, in order; None if it did not
        answer (timeout). A malformed reply ends the list there."""
        if self._dealer is None:
            d = self._ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.RCVHWM, 0)  # a full replay must fit, as vLLM sizes its SNDHWM
            d.connect(self.cfg.replay)
            self._dealer = d
        dealer = self._dealer
        await dealer.send_multipart([b"", encode_seq(start)])
        out: list[Replayed] = []
        broken = False
        while True:
            if not await dealer.poll(self.cfg.replay_timeout_s * 1000, zmq.POLLIN):
                # No end marker: drop the socket so late replies cannot be mistaken later.
                dealer.close(linger=0)
                self._dealer = None
                self.stats.replay_failures += 1
                self._warn("replay_timeout", "vLLM replay socket did not answer",
                           {"endpoint": self.cfg.replay, "start": start, "got": len(out)})
                return out if out else None
            msg = await dealer.recv_multipart()
            try:
                fr = parse_replay(msg)
                if fr is None:
                    return out
                if broken:
                    continue  # read up to the end marker; keep what came before the fault
                if self._topic and fr.topic and fr.topic != self._topic:
                    raise FrameError("topic", f"replayed topic {fr.topic[:64]!r}")
                batch = decode_batch(fr.payload)
            except FrameError as exc:
                if not broken:
                    self._reject(exc, msg)
                    self.stats.replay_failures += 1
                    broken = True
                continue
            if fr.seq >= start and (not out or fr.seq > out[-1][0]):
                out.append((fr.seq, _digest(fr.payload), batch))
