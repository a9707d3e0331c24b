"""Comparing policies robustly: each replayed at small jitters of the offered rate, their
metrics averaged, and each lead checked for consistency across the jitters.

Single replays are chaotic: a 1% change of rate can move one policy's TTFT by 5-20%, as one
unlucky collision of long prefills lands in a different place. A lead that holds at every
jitter is a property of the policies; one that flips between jitters is noise, and the verdict
says so instead of crowning a winner by a coin toss. Each verdict also gives the chance that
two equal policies would look as one-sided (a two-sided sign test): with the default 3
jitters a tie leads at all of them 1 time in 4, so a lead of 1% needs more jitters to be
told from noise (10 jitters: all ten, 1 in 512; nine of ten, 1 in 47). A rate factor scales
every gap between arrivals alike, so a cold start's first decisions are the same at every
jitter and their consequences are in every jitter's figures: with a nudge (:func:`at_rate`)
each jitter's arrivals are also moved, by less than half their gaps, so those decisions
differ too and a lead that holds is not the cold start's luck.

In a closed loop the clients set the pace, and a policy that serves replies slowly is measured
at a lighter load than the others: :func:`match_loads` replays such a policy faster until its
clients send as much as the focus's, so the verdicts can be given again at equal load.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, fields, replace

from kvroute.simulations.metrics import PolicyMetrics
from kvroute.simulations.trace import Trace

DEFAULT_JITTERS = (0.98, 1.0, 1.02)

# The metrics a verdict is given on: field, label, whether higher is better.
CRITERIA: tuple[tuple[str, str, bool], ...] = (
    ("ttft_mean_s", "mean TTFT", False),
    ("ttft_p99_s", "p99 TTFT", False),
    ("hit_ratio", "hit ratio", True),
)


def at_rate(trace: Trace, scale: float, nudge: float = 0.0, seed: int = 0) -> Trace:
    """``trace`` at ``scale`` x its rate, each arrival nudged by up to ``nudge`` x half the
    gap to its neighbour (:meth:`Trace.nudged`) with a seed of its own per rate: each jitter,
    and each rate a load search tries, gets different nudges, the same on every run."""
    out = trace.scaled(scale) if scale != 1.0 else trace
    return out.nudged(nudge, f"{seed}:{scale!r}") if nudge else out


def parse_jitters(text: str) -> tuple[float, ...]:
    """``"0.98,1,1.02"`` -> the rate factors; ValueError says what is wrong."""
    try:
        out = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--jitter takes comma-separated rate factors, got {text!r}") from None
    if not out:
        raise ValueError("--jitter needs at least one rate factor")
    if any(not 0.5 <= j <= 2.0 for j in out):
        raise ValueError(f"--jitter factors must lie in [0.5, 2] (they scale the rate), got "
                         f"{text!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"--jitter factors must differ, got {text!r}")
    return out


@dataclass(frozen=True)
class Jittered:
    """One policy's replays at each jitter of the rate, in jitter order."""

    policy: str
    runs: tuple[PolicyMetrics, ...]

    def mean(self) -> PolicyMetrics:
        """Every numeric metric averaged over the jitters (wall time summed)."""
        avg = {f.name: statistics.mean(getattr(r, f.name) for r in self.runs)
               for f in fields(PolicyMetrics) if f.name not in ("policy", "requests")}
        avg["wall_s"] = sum(r.wall_s for r in self.runs)
        return replace(self.runs[0], **avg)


@dataclass(frozen=True)
class Verdict:
    """Who leads on one metric, by how much on average, and at how many jitters."""

    metric: str
    leader: str
    value: float
    runner_up: str
    lead: float  # relative to the runner-up's average (hit ratio: the difference)
    ahead_in: int  # jitters at which the leader beats the runner-up
    jitters: int

    @property
    def consistent(self) -> bool:
        return self.ahead_in == self.jitters

    @property
    def tie_chance(self) -> float:
        """The chance that two policies equal but for noise split the jitters at least this
        unevenly: a two-sided sign test (1.0 for an even split)."""
        n, k = self.jitters, max(self.ahead_in, self.jitters - self.ahead_in)
        return min(1.0, 2.0 * sum(math.comb(n, i) for i in range(k, n + 1)) / 2.0 ** n)

    def __str__(self) -> str:
        unit = "points" if self.metric == "hit ratio" else "%"
        size = f"{self.lead * 100:.2f} {unit}" if unit == "points" else f"{self.lead:.1%}"
        value = f"{self.value:.2%}" if self.metric == "hit ratio" else f"{self.value:.4g} s"
        word = "above" if self.metric == "hit ratio" else "below"
        tail = "" if self.consistent else " (within noise)"
        chance = self.tie_chance
        odds = f"; a tie would split them so 1 time in {1 / chance:.3g}" if chance < 1 else ""
        return (f"{self.metric}: {self.leader} {value}, {size} {word} {self.runner_up}; "
                f"ahead at {self.ahead_in}/{self.jitters} jitters{tail}{odds}")


def verdicts(rows: Sequence[Jittered], focus: str | None = None) -> list[Verdict]:
    """Who leads on each of :data:`CRITERIA` by its jitter average, and at how many jitters
    the leader is strictly better. The pair compared is the best two policies, or with
    ``focus``, that policy and the best of the others. Needs two policies."""
    if len(rows) < 2:
        return []
    mine = next((j for j in rows if j.policy == focus), None)
    if focus is not None and mine is None:
        raise ValueError(f"no policy {focus!r} among {', '.join(j.policy for j in rows)}")
    out = []
    for name, label, higher in CRITERIA:
        sign = -1.0 if higher else 1.0

        def key(j: Jittered, name: str = name, sign: float = sign) -> float:
            return sign * statistics.mean(getattr(r, name) for r in j.runs)

        if mine is None:
            first, second = sorted(rows, key=key)[:2]
        else:
            first, second = sorted((mine, min((j for j in rows if j is not mine), key=key)),
                                   key=key)
        a, b = sign * key(first), sign * key(second)
        lead = (a - b) if higher else ((b - a) / b if b else 0.0)
        ahead = sum(sign * getattr(x, name) < sign * getattr(y, name)
                    for x, y in zip(first.runs, second.runs, strict=True))
        out.append(Verdict(label, first.policy, a, second.policy, lead, ahead,
                           len(first.runs)))
    return out


def replay_jittered(jitters: Sequence[float],
                    replay: Callable[[float], Sequence[PolicyMetrics]]) -> list[Jittered]:
    """``replay(factor)`` replays every policy at ``factor`` x the chosen rate; the runs are
    gathered per policy, in the order the first replay returned them."""
    per: dict[str, list[PolicyMetrics]] = {}
    for j in jitters:
        for m in replay(j):
            per.setdefault(m.policy, []).append(m)
    return [Jittered(name, tuple(runs)) for name, runs in per.items()]


# A closed-loop policy whose clients sent this much less than the focus's (fraction of
# capacity) is compared again at a higher rate; within it, loads count as equal.
LOAD_TOLERANCE = 0.01


@dataclass(frozen=True)
class Matched:
    """A policy replayed at the load another policy's clients offered: in a closed loop each
    client sends its next turn when its reply has ended, so a policy that serves replies
    slowly is measured at a lighter load than it was given, and its TTFT lead can be the
    load's, not the policy's. ``runs`` are its replays at ``scale`` x the compared replays'
    rate, where its clients sent ``sent``; when ``reached`` is false no rate up to the
    search's limit made them send ``target``, and ``runs`` are those that sent the most."""

    policy: str
    target: float  # the load to reach, a fraction of capacity
    scale: float
    sent: float
    runs: Jittered
    reached: bool

    def __str__(self) -> str:
        m = self.runs.mean()
        figures = (f"mean/p99 TTFT {m.ttft_mean_s:.4g}/{m.ttft_p99_s:.4g} s, hit ratio "
                   f"{m.hit_ratio:.2%}")
        if self.reached:
            return f"{self.policy}: sent {self.sent:.0%} at {self.scale:.3g}x the rate: {figures}"
        return (f"{self.policy}: its clients could not send {self.target:.0%} of capacity (at "
                f"most {self.sent:.0%}, at {self.scale:.3g}x the rate: {figures}): not compared")


def match_load(target: float, sent: Callable[[Jittered], float],
               replay: Callable[[float], Jittered], runs: Jittered, *,
               max_scale: float = 3.0, growth: float = 1.5, bisections: int = 3) -> Matched:
    """The least rate factor (within ``bisections`` halvings) at which one policy's clients
    send at least ``target``: ``replay(scale)`` replays it at every jitter at ``scale`` x
    the rate of ``runs`` (its replays at factor 1), ``sent`` reads their offered load. The
    factor grows by ``growth`` up to ``max_scale``, then is bisected between the last too
    light and the first heavy enough (the peer is measured at the focus's load, not past
    it). Loads within :data:`LOAD_TOLERANCE` of ``target`` reach it."""
    def reached(load: float) -> bool:
        return load >= target - LOAD_TOLERANCE

    first = sent(runs)
    if reached(first):
        return Matched(runs.policy, target, 1.0, first, runs, True)
    lo, most = 1.0, (first, 1.0, runs)
    hi: tuple[float, float, Jittered] | None = None
    scale = 1.0
    while hi is None and scale < max_scale:
        scale = min(max_scale, scale * growth)
        got = replay(scale)
        if reached(load := sent(got)):
            hi = (scale, load, got)
        else:
            lo = scale
            if load > most[0]:
                most = (load, scale, got)
    if hi is None:
        return Matched(runs.policy, target, most[1], most[0], most[2], False)
    for _ in range(bisections):
        mid = (lo + hi[0]) / 2
        got = replay(mid)
        if reached(load := sent(got)):
            hi = (mid, load, got)
        else:
            lo = mid
    return Matched(runs.policy, target, hi[0], hi[1], hi[2], True)


def match_loads(rows: Sequence[Jittered], focus: str, sent: Callable[[Jittered], float],
                replay: Callable[[str, float], Jittered], **search: float) -> list[Matched]:
    """:func:`match_load` for each policy of ``rows`` whose clients sent less than
    ``focus``'s and that leads it on any of :data:`CRITERIA` (one that trails it at a lighter
    load would only trail further at a heavier one); ``replay(policy, scale)`` replays one
    policy. The policies within :data:`LOAD_TOLERANCE` are left as they are."""
    mine = next((j for j in rows if j.policy == focus), None)
    if mine is None:
        raise ValueError(f"no policy {focus!r} among {', '.join(j.policy for j in rows)}")
    target = sent(mine)
    out = []
    for j in rows:
        if j is mine or sent(j) >= target - LOAD_TOLERANCE:
            continue
        if not any(v.leader == j.policy for v in verdicts([mine, j], focus=focus)):
            continue
        out.append(match_load(target, sent, lambda s, name=j.policy: replay(name, s), j,
                              **search))
    return out


def at_matched_load(rows: Sequence[Jittered], matched: Sequence[Matched]) -> list[Jittered]:
    """``rows`` with each matched policy's runs replaced by those at the matched load, and
    those that could not reach it left out."""
    by = {m.policy: m.runs if m.reached else None for m in matched}
    return [r for j in rows if (r := by.get(j.policy, j)) is not None]


def matched_lines(rows: Sequence[Jittered], matched: Sequence[Matched], focus: str) -> list[str]:
    """The report of :func:`match_loads`: a heading, each matched policy, then the verdicts
    at ``focus``'s load (nothing when no policy needed matching)."""
    if not matched:
        return []
    return [f"at {focus}'s load (the lighter policies that lead it, replayed faster):",
            *(f"  {m}" for m in matched),
            *(f"  {v}" for v in verdicts(at_matched_load(rows, matched), focus=focus))]


# A lead counts as consistent when two equal policies would split the jitters at least that
# unevenly at most this often (the sign test of :attr:`Verdict.tie_chance`): ten jitters need
# 9 of 10 (1 time in 47), three jitters can never show it (1 time in 4).
ALPHA = 0.05


@dataclass(frozen=True)
class CellScore:
    """How ``focus`` fared in one cell (a trace at one load) against the best of the other
    policies on each of :data:`CRITERIA`: ``verdicts`` as :func:`verdicts` gives them.

    On each metric, :meth:`codes` gives ``W`` or ``L`` when the lead holds by the sign test
    at ``alpha`` (won or lost consistently: the leader strictly ahead at so many jitters that
    two equal policies would split them so at most ``alpha`` of the time), ``w`` or ``l``
    when it holds on the jitters' average only; a tie on the average counts as won (at least
    as good)."""

    focus: str
    verdicts: tuple[Verdict, ...]
    alpha: float = ALPHA

    def won(self, v: Verdict) -> bool:
        return v.leader == self.focus

    def significant(self, v: Verdict) -> bool:
        # The leader must be strictly ahead at most jitters: level at every one (ahead at
        # none) is as one-sided for the sign test, but it is a tie, not a lead.
        return 2 * v.ahead_in > v.jitters and v.tie_chance <= self.alpha

    def codes(self) -> str:
        return "".join(("W" if self.won(v) else "L") if self.significant(v)
                       else ("w" if self.won(v) else "l") for v in self.verdicts)

    @property
    def won_all(self) -> bool:
        """At least the best other's on all three, by the jitters' averages (the test of the
        README's policy tables)."""
        return all(self.won(v) for v in self.verdicts)

    @property
    def won_all_consistently(self) -> bool:
        return all(self.won(v) and self.significant(v) for v in self.verdicts)

    @property
    def no_consistent_loss(self) -> bool:
        return not any(not self.won(v) and self.significant(v) for v in self.verdicts)

    def margins(self) -> str:
        """The focus's margin on each metric against the best other: TTFT in percent (below
        zero: lower), hit ratio in points (above zero: higher)."""
        out = []
        for v in self.verdicts:
            won = self.won(v)
            other = v.runner_up if won else v.leader
            if v.metric == "hit ratio":
                out.append(f"{v.metric} {(1 if won else -1) * v.lead * 100:+.2f} pts ({other})")
            else:  # lead is relative to the runner-up's; the margin to the other's value
                margin = -v.lead if won else v.lead / (1 - v.lead)
                out.append(f"{v.metric} {margin:+.1%} ({other})")
        return ", ".join(out)


def score_cell(rows: Sequence[Jittered], focus: str, alpha: float = ALPHA) -> CellScore:
    """``focus`` against the best of the others in ``rows`` (see :class:`CellScore`)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha is a probability in (0, 1), got {alpha}")
    return CellScore(focus, tuple(verdicts(rows, focus=focus)), alpha)


@dataclass(frozen=True)
class AimsScore:
    """One cell against issue 39's aims for a default policy: its jitter-averaged mean TTFT
    no worse than the best peer's, its p99 within ``p99_slack`` of the best peer's and its
    hit ratio within ``hit_slack`` (a fraction, 0.005 = half a point) of the best peer's.
    The best peer on each metric may be a different policy."""

    mean_margin: float  # relative to the best peer's mean TTFT (below 0: lower)
    p99_margin: float  # relative to the best peer's p99 TTFT
    hit_margin: float  # hit ratio minus the best peer's (a fraction)
    p99_slack: float = 0.02
    hit_slack: float = 0.005

    @property
    def failed(self) -> tuple[str, ...]:
        """The metrics whose aim is missed, by :data:`CRITERIA` label."""
        misses = (self.mean_margin > 0, self.p99_margin > self.p99_slack,
                  self.hit_margin < -self.hit_slack)
        return tuple(label for (_, label, _), miss in zip(CRITERIA, misses, strict=True)
                     if miss)


def score_aims(rows: Sequence[Jittered], focus: str, peers: Sequence[str]) -> AimsScore:
    """``focus`` against the best of ``peers`` in ``rows`` on each metric (see
    :class:`AimsScore`); ValueError if either is missing."""
    means = {j.policy: j.mean() for j in rows}
    if focus not in means:
        raise ValueError(f"no policy {focus!r} among {', '.join(means)}")
    theirs = [means[p] for p in peers if p in means and p != focus]
    if not theirs:
        raise ValueError(f"none of the peers ({', '.join(peers)}) was replayed")
    mine = means[focus]
    best_mean = min(m.ttft_mean_s for m in theirs)
    best_p99 = min(m.ttft_p99_s for m in theirs)
    return AimsScore(mine.ttft_mean_s / best_mean - 1 if best_mean else 0.0,
                     mine.ttft_p99_s / best_p99 - 1 if best_p99 else 0.0,
                     mine.hit_ratio - max(m.hit_ratio for m in theirs))


def jittered_to_json(rows: Sequence[Jittered]) -> dict[str, list[dict[str, object]]]:
    """Each policy's replays, one metrics row per jitter (``bench/policy_jitter.py --json``)."""
    return {j.policy: [m.row() for m in j.runs] for j in rows}


def jittered_from_json(data: object, where: str) -> list[Jittered]:
    """The inverse of :func:`jittered_to_json`, checked: ``where`` names the data in errors."""
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{where}: expected an object of policy -> list of metrics rows")
    rows = []
    for policy, runs in data.items():
        if not isinstance(runs, list) or not runs:
            raise ValueError(f"{where}: {policy}: expected a non-empty list of metrics rows")
        rows.append(Jittered(policy, tuple(_metrics_row(row, f"{where}: {policy}: row {i}",
                                                        policy)
                                           for i, row in enumerate(runs))))
    if len({len(j.runs) for j in rows}) != 1:
        raise ValueError(f"{where}: the policies were not replayed at the same jitters")
    return rows


_RETIRED = frozenset({"fetched_ratio"})
"""Written before a field was dropped (KV fetched from other workers: replays no more)."""


def _metrics_row(row: object, where: str, policy: str) -> PolicyMetrics:
    """One policy's metrics row, checked."""
    if not isinstance(row, dict):
        raise ValueError(f"{where} is not an object")
    row = {k: v for k, v in row.items() if k not in _RETIRED}
    names = {f.name for f in fields(PolicyMetrics)}
    required = {f.name for f in fields(PolicyMetrics) if f.default is MISSING}
    if bad := set(row) - names:
        raise ValueError(f"{where}: unknown fields {', '.join(sorted(bad))}")
    if missing := required - set(row):
        raise ValueError(f"{where}: missing fields {', '.join(sorted(missing))}")
    if not all(type(x) in (int, float) for k, x in row.items() if k != "policy"):
        raise ValueError(f"{where}: every metric must be a number")
    if row.get("policy") != policy:
        raise ValueError(f"{where} is {row.get('policy')!r}'s")
    return PolicyMetrics(**row)


def matched_to_json(matched: Sequence[Matched]) -> list[dict[str, object]]:
    return [{"policy": m.policy, "target": m.target, "scale": m.scale, "sent": m.sent,
             "reached": m.reached, "runs": [r.row() for r in m.runs.runs]} for m in matched]


def matched_from_json(data: object, where: str) -> list[Matched]:
    if not isinstance(data, list):
        raise ValueError(f"{where}: expected a list of matched policies")
    out = []
    for i, m in enumerate(data):
        try:
            runs = jittered_from_json({m["policy"]: m["runs"]}, f"{where}[{i}]")[0]
            out.append(Matched(m["policy"], float(m["target"]), float(m["scale"]),
                               float(m["sent"]), runs, bool(m["reached"])))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{where}[{i}]: not a matched policy ({exc})") from None
    return out
