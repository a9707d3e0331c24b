"""One policy against another, cell by cell: the focus policies of two sets of
``bench/policy_jitter.py --json`` runs on the same traces and loads (a campaign and a
``--variant`` campaign of the other policy, or two commits' campaigns).

    python bench/policy_vs.py OLD_DIR NEW_DIR [--old-focus kvroute] [--new-focus kvroute]

Per cell (a trace at one load, each figure the mean over the rate jitters): NEW's mean and
p99 TTFT over OLD's, and NEW's hit ratio less OLD's in points; then the geometric means of
the two ratios over all cells, and in how many cells NEW is lower. Cells are paired by file
name and load; a cell in one set only is named and left out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from kvroute.simulations.compare import jittered_from_json
from kvroute.simulations.metrics import PolicyMetrics

Cell = tuple[str, float]


def focus_means(folder: Path, focus: str | None) -> dict[Cell, PolicyMetrics]:
    """Each cell's focus policy, averaged over its jitters, from every ``*.json`` file."""
    out: dict[Cell, PolicyMetrics] = {}
    files = sorted(folder.glob("*.json"))
    if not files:
        raise ValueError(f"{folder}: no bench/policy_jitter.py --json files")
    for path in files:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("loads"), list):
            raise ValueError(f"{path}: not a bench/policy_jitter.py --json file")
        who = focus or data.get("focus")
        for i, cell in enumerate(data["loads"]):
            rows = {j.policy: j for j in jittered_from_json(cell.get("runs"),
                                                            f"{path}: loads[{i}]")}
            if who not in rows:
                raise ValueError(f"{path}: loads[{i}]: no policy {who!r}")
            out[(path.stem, float(cell["load"]))] = rows[who].mean()
    return out


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path, help="the runs of the policy compared against")
    ap.add_argument("new", type=Path, help="the runs of the policy compared")
    ap.add_argument("--old-focus", default=None, help="default: each file's focus")
    ap.add_argument("--new-focus", default=None, help="default: each file's focus")
    args = ap.parse_args()
    try:
        old = focus_means(args.old, args.old_focus)
        new = focus_means(args.new, args.new_focus)
    except (OSError, ValueError) as exc:
        sys.exit(f"policy_vs: {exc}")
    for cell in sorted(old.keys() ^ new.keys()):
        print(f"left out (in one set only): {cell[0]} at {cell[1]:.0%}")
    cells = sorted(old.keys() & new.keys())
    if not cells:
        sys.exit("policy_vs: no cell in both sets")
    means, p99s, hits = [], [], []
    print(f"{'cell':<28}{'load':>6}{'mean':>9}{'p99':>9}{'hit pts':>9}")
    for cell in cells:
        a, b = old[cell], new[cell]
        means.append(b.ttft_mean_s / a.ttft_mean_s)
        p99s.append(b.ttft_p99_s / a.ttft_p99_s)
        hits.append(100 * (b.hit_ratio - a.hit_ratio))
        print(f"{cell[0]:<28}{cell[1]:>6.0%}{means[-1]:>8.3f}x{p99s[-1]:>8.3f}x"
              f"{hits[-1]:>+9.2f}")
    n = len(cells)
    print(f"{n} cells: mean TTFT {geomean(means):.3f}x (lower in "
          f"{sum(r < 1 for r in means)}), p99 TTFT {geomean(p99s):.3f}x (lower in "
          f"{sum(r < 1 for r in p99s)}), hit ratio {sum(hits) / n:+.2f} points on average "
          f"(higher in {sum(h > 0 for h in hits)})")


if __name__ == "__main__":
    main()
