"""``kvroute gen``: a synthetic workload trace (:mod:`kvroute.simulations.generators`)
written as JSONL, with a summary of what it holds (:func:`infinite_cache_hit_ratio`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvroute.core.settings import AT_LEAST_ONE, POSITIVE, RawDefaultsFormatter
from kvroute.simulations.generators import (
    DEFAULT_BLOCK_SIZE,
    KINDS,
    PARAMS,
    generate,
)


def write_jsonl(records: Iterable[dict], path: str | Path) -> int:
    """Write one JSON object a line (``-`` = stdout); returns the number written."""
    lines = [json.dumps(r) + "\n" for r in records]
    if str(path) == "-":
        sys.stdout.writelines(lines)
    else:
        Path(path).write_text("".join(lines))
    return len(lines)


def infinite_cache_hit_ratio(records: Sequence[dict]) -> float:
    """Fraction of prompt tokens an unbounded cache would serve, as the replay simulator
    counts it (:func:`kvroute.simulations.metrics.infinite_cache_hits`: full blocks of earlier
    prompts and replies, one prompt token always computed)."""
    from kvroute.simulations.metrics import hit_ratio, infinite_cache_hits
    from kvroute.simulations.trace import parse

    if not records:
        return 0.0
    trace = parse([json.dumps(r) for r in records], source="<generated>", strict=True)
    return hit_ratio(trace, infinite_cache_hits(trace))


def _param_help() -> str:
    lines = ["kind parameters (--param NAME=VALUE):"]
    for kind in KINDS:
        fields = ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(PARAMS[kind]))
        lines.append(f"  {kind}: {fields}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``gen`` arguments, for a sub-parser of the ``kvroute`` command (whose formatter
    must keep the epilog's lines as written)."""
    parser.epilog = _param_help()
    parser.add_argument("kind", choices=KINDS, help="workload kind")
    parser.add_argument("--requests", type=AT_LEAST_ONE.parser(int), default=1000,
                        help="number of requests")
    parser.add_argument("--rate", type=POSITIVE.parser(float), default=10.0,
                        help="mean arrival rate, requests per second")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--block-size", type=AT_LEAST_ONE.parser(int),
                        default=DEFAULT_BLOCK_SIZE, help="tokens per hash id")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="override a kind parameter (repeatable; see below)")
    parser.add_argument("--out", default="-", help="output JSONL file ('-' = stdout)")
    return parser


def _parse_params(kind: str, items: Sequence[str]) -> dict[str, float]:
    defaults = {f.name: f.default for f in dataclasses.fields(PARAMS[kind])}
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in defaults:
            raise ValueError(f"--param {item!r}: expected NAME=VALUE with NAME one of "
                             f"{', '.join(defaults)}")
        kind = type(defaults[name])
        try:
            out[name] = kind(value)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise ValueError(f"--param {item!r}: {value!r} is not {what}") from None
    return out


def run(args: argparse.Namespace) -> int:
    """Generate and write a workload from parsed ``gen`` arguments; prints a summary."""
    try:
        params = _parse_params(args.kind, args.param)
        records = generate(args.kind, args.requests, args.rate, args.seed, args.block_size,
                           **params)
    except ValueError as exc:
        print(f"kvroute gen: error: {exc}", file=sys.stderr)
        return 2
    n = write_jsonl(records, args.out)
    span = records[-1]["timestamp"] / 1000 if records else 0.0
    print(f"{args.kind}: {n} requests over {span:.1f} s "
          f"({n / span if span else 0:.2f}/s), block size {args.block_size}, "
          f"infinite-cache prefix hits {infinite_cache_hit_ratio(records):.1%}"
          + ("" if args.out == "-" else f" -> {args.out}"), file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``kvroute gen KIND --requests N --rate R --seed S --out FILE``."""
    parser = add_arguments(argparse.ArgumentParser(
        prog="kvroute gen", formatter_class=RawDefaultsFormatter,
        description="Generate a synthetic workload trace (Mooncake JSONL format with a "
                    "block_size field)."))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
