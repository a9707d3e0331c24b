"""Score cells: how one policy fared against the best of the others in every cell (a trace at
one load) of ``bench/policy_jitter.py --json`` runs, and how many cells it won.

    python bench/policy_jitter.py TRACE --json out/chat_s1.json [...]   # one file per trace
    python bench/score_cells.py out/*.json [--focus kvroute] [--alpha 0.05]

Per cell, one code per metric (mean TTFT, p99 TTFT, hit ratio) and the focus's margin
against the best other policy on it (TTFT in percent, below zero lower; hit ratio in points,
above zero higher): ``W``/``L`` when the lead holds by the sign test at ``--alpha`` over the
jitters (ten jitters: at 9 or 10 of them), ``w``/``l`` when it holds on the jitters' average
only; a tie on the average counts as won. With ``--match-load`` runs, the cell is scored
again at the focus's load (``at equal load``). Then the counts the README's policy tables
give: cells at least the best other's on all three by the averages, cells won on all three
consistently, cells with no consistent loss, and the losses per metric.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

from kvroute.simulations.compare import (
    ALPHA,
    CRITERIA,
    AimsScore,
    CellScore,
    at_matched_load,
    jittered_from_json,
    matched_from_json,
    score_aims,
    score_cell,
)

Cell = tuple[float, CellScore, CellScore | None, AimsScore | None]


def cells(path: Path, focus: str | None, alpha: float, aims: bool = False,
          peers: list[str] | None = None) -> list[Cell]:
    """Each load of one ``--json`` file: its score, at equal load when matched, and against
    the aims (``aims``; ``peers``: who counts as a peer, default every policy not named
    ``kvroute...``)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("loads"), list):
        raise ValueError(f"{path}: not a bench/policy_jitter.py --json file (no 'loads')")
    who = focus or data.get("focus")
    if not isinstance(who, str):
        raise ValueError(f"{path}: no focus policy recorded; give --focus")
    out = []
    for i, cell in enumerate(data["loads"]):
        where = f"{path}: loads[{i}]"
        if not isinstance(cell, dict) or not isinstance(cell.get("load"), int | float):
            raise ValueError(f"{where}: expected an object with a 'load'")
        rows = jittered_from_json(cell.get("runs"), f"{where}.runs")
        if who not in {j.policy for j in rows}:
            raise ValueError(f"{where}: no policy {who!r} among "
                             f"{', '.join(j.policy for j in rows)}")
        if len(rows) < 2:
            raise ValueError(f"{where}: only {who} was replayed: nothing to score it against")
        matched = matched_from_json(cell.get("matched", []), f"{where}.matched")
        equal = score_cell(at_matched_load(rows, matched), who, alpha) if matched else None
        against = None
        if aims:
            names = peers or [j.policy for j in rows if not j.policy.startswith("kvroute")]
            try:
                against = score_aims(rows, who, names)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
        out.append((float(cell["load"]), score_cell(rows, who, alpha), equal, against))
    return out


def summary(scores: list[CellScore], label: str) -> list[str]:
    lost: Counter[str] = Counter()
    consistent: Counter[str] = Counter()
    for s in scores:
        for v in s.verdicts:
            if not s.won(v):
                lost[v.metric] += 1
                consistent[v.metric] += s.significant(v)
    n = len(scores)
    return [f"{label}: {n} cells",
            f"  all three at least the best other's (averages): "
            f"{sum(s.won_all for s in scores)}",
            f"  all three won consistently: {sum(s.won_all_consistently for s in scores)}",
            f"  no consistent loss: {sum(s.no_consistent_loss for s in scores)}",
            "  lost (averages / consistently): " + ", ".join(
                f"{name} {lost[name]} / {consistent[name]}" for _, name, _ in CRITERIA)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="bench/policy_jitter.py --json files")
    ap.add_argument("--focus", default=None,
                    help="the policy to score (default: each file's --focus)")
    ap.add_argument("--alpha", type=float, default=ALPHA,
                    help=f"a lead is consistent when a tie would split the jitters so at most "
                         f"this often (default {ALPHA})")
    ap.add_argument("--aims", action="store_true",
                    help="also score every cell against issue 39's aims (see above)")
    ap.add_argument("--peers", default=None,
                    help="with --aims: the peers, comma-separated (default: every policy not "
                         "named kvroute...)")
    args = ap.parse_args()
    if not 0 < args.alpha < 1:
        ap.error(f"--alpha is a probability in (0, 1), got {args.alpha}")
    peers = [p for p in args.peers.split(",") if p] if args.peers else None
    raw: list[CellScore] = []
    equal: list[CellScore] = []
    missed: list[tuple[str, ...]] = []
    for path in args.files:
        try:
            scored = cells(path, args.focus, args.alpha, args.aims, peers)
        except ValueError as exc:
            ap.error(str(exc))
        for load, score, at_equal, aims in scored:
            line = f"{path.stem:24s} {load:4.0%}  {score.codes()}  {score.margins()}"
            if at_equal is not None:
                line += f"  | at equal load {at_equal.codes()}"
            if aims is not None:
                line += (f"  | aims: {aims.mean_margin:+.1%} / {aims.p99_margin:+.1%} / "
                         f"{aims.hit_margin * 100:+.2f} "
                         f"{'met' if not aims.failed else 'missed ' + ', '.join(aims.failed)}")
                missed.append(aims.failed)
            print(line, flush=True)
            raw.append(score)
            equal.append(at_equal or score)
    print()
    for line in summary(raw, "as replayed"):
        print(line)
    if any(a is not b for a, b in zip(raw, equal, strict=True)):
        for line in summary(equal, "at equal load (closed loop, --match-load)"):
            print(line)
    if args.aims:
        print(f"against the aims: {sum(not m for m in missed)} of {len(missed)} cells met; "
              "missed on " + ", ".join(f"{label} {sum(label in m for m in missed)}"
                                       for _, label, _ in CRITERIA))


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # read through `| head`: stop quietly, as other filters do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
