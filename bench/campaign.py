"""The policy campaign in one command: the generated workloads and the Mooncake trace through
kvroute and the peers, every cell scored: the figures the README's policy tables count.

    python bench/campaign.py OUT                         # open loop, cold start
    python bench/campaign.py OUT-warm --warmup 600       # warm start
    python bench/campaign.py OUT-closed --closed-loop --match-load
    python bench/campaign.py OUT-v --variant kvroute:churn_s=1 --peers-from OUT

The traces are ``kvroute gen KIND --requests 3000 --rate 20 --seed S`` for each KIND of
``--kinds`` and S of ``--seeds`` (written to ``OUT/traces``, kept when there) and the shared
Mooncake trace. Each is replayed by ``bench/policy_jitter.py`` (its output in
``OUT/NAME.log``, its replays in ``OUT/NAME.json``), ``--jobs`` at a time; a trace whose JSON
is there is not replayed again, so an interrupted campaign resumes where it stopped (a
trace cut short leaves ``NAME.json.partial``), and the options are kept in
``OUT/campaign.options``: resuming with others is refused. Then ``bench/score_cells.py``
scores every cell (a trace at one load) and counts them, as ``score_cells.py OUT/*.json``
does again later.

``--unseen N`` adds N generated workloads drawn from seeds no campaign tuned on (from
``--unseen-seed``, 1000; the tuned seeds are 1-3): each seed takes a kind (in turn), scales
its prompt lengths (0.35-2.8x), its sharing (0.35-5.7x the system prompts, agent types,
templates or documents, and the documents' Zipf exponent), its session lengths (turns,
calls, fan-out) and its other means (0.5-2x), and makes its arrivals bursty (the rate
multiplied, 10 s at a time, by a gamma variate of mean 1 and coefficient of variation 0, 0.5,
1 or 1.5): traffic the policies were never tuned on, each cell scored against the best peer
as any other. What each drew is printed and kept beside its trace (``.params.json``).

    python bench/campaign.py OUT-unseen --unseen 12 --kinds none --mooncake none

``--variant POLICY --peers-from DIR`` replays only POLICY (a registry name with parameters,
as ``kvroute replay --policies`` takes them) and scores it against the peers' runs of an
earlier campaign with the same options: DIR's replays, its focus's taken out. This is how a
parameter is tuned against the whole campaign in a seventh of its time. Closed-loop runs
with ``--match-load`` cannot be reused so (each peer's matched replays were made at its
focus's load) and are refused.

The whole open-loop campaign (13 traces, 7 policies, 4 loads, 3 jitters: 1,092 replays)
takes about 6 minutes with two jobs on a two-core machine; a variant alone about 1 minute.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from kvroute.simulations.cli import AT_LEAST_ONE, POSITIVE, Warmup, make_policies
from kvroute.simulations.gen_cli import write_jsonl
from kvroute.simulations.generators import KINDS, PARAMS, generate

BENCH = Path(__file__).resolve().parent
MOONCAKE = BENCH.parent / "traces" / "mooncake_synthetic_trace.jsonl"  # traces/README.md
# What a policy_jitter --json record says of how it replayed (older records lack some).
REPLAY_OPTIONS = ("closed_loop", "warmup", "jitters", "workers", "prefill_budget",
                  "chunked_prefill", "long_prefill_threshold", "programs", "nudge")
# What a record made before an option was recorded replayed with.
OPTION_DEFAULTS = {"long_prefill_threshold": 0}
PEERS = "kvroute,llmd,preble,chwbl,sglang,dynamo,mooncake_local"


def csv_ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas: {text!r}") from None
    return out


def csv_kinds(text: str) -> list[str]:
    if text == "none":
        return []
    kinds = text.split(",")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown workload {', '.join(bad)} (known: {', '.join(KINDS)})")
    return kinds


def traces(args: argparse.Namespace) -> list[Path]:
    """The campaign's traces: the Mooncake trace (unless ``none``) and the generated ones,
    generated into ``OUT/traces`` when not there yet."""
    out: list[Path] = []
    if str(args.mooncake) != "none":
        if not args.mooncake.is_file():
            sys.exit(f"campaign: no Mooncake trace at {args.mooncake} "
                     "(give --mooncake PATH, or --mooncake none to leave it out)")
        out.append(args.mooncake)
    folder = args.out / "traces"
    folder.mkdir(parents=True, exist_ok=True)
    for kind in args.kinds:
        for seed in args.seeds:
            path = folder / f"{kind}_s{seed}.jsonl"
            if not path.is_file():
                tmp = path.with_name(path.name + ".tmp")
                write_jsonl(generate(kind, args.requests, args.rate, seed=seed), tmp)
                tmp.replace(path)
            out.append(path)
    return out + unseen_traces(args, folder)


# What an unseen workload varies, by what it stands for: its prompts' lengths, how much they
# share, how long its sessions run; every other mean is scaled 0.5-2x on its own.
LENGTHS = {"system_tokens", "user_tokens", "task_tokens", "tool_result_tokens",
           "template_tokens", "document_tokens", "question_tokens", "context_tokens",
           "branch_tokens"}
SHARING = {"system_prompts", "agent_types", "templates", "documents"}
SESSIONS = {"mean_turns", "mean_calls", "fanout"}
KEPT = {"max_context_tokens", "depth", "docs_per_request"}  # limits and structure
BURST_CVS = (0.0, 0.5, 1.0, 1.5)
BURST_WINDOW_S = 10.0


def unseen_workload(seed: int) -> tuple[str, dict[str, float], float]:
    """The kind, parameters and burstiness (the rate's coefficient of variation) seed
    ``seed`` draws (see the module docstring)."""
    rng = random.Random(seed)
    kind = KINDS[seed % len(KINDS)]  # consecutive seeds cover the kinds evenly
    length = 2.0 ** rng.uniform(-1.5, 1.5)
    sharing = 2.0 ** rng.uniform(-1.5, 2.5)  # distinct shared prefixes: fewer is more sharing
    session = 2.0 ** rng.uniform(-1.0, 1.0)
    params: dict[str, float] = {}
    for f in PARAMS[kind].__dataclass_fields__.values():
        if f.name in KEPT:
            continue
        if f.name == "zipf_s":
            params[f.name] = round(rng.uniform(0.6, 1.5), 3)
            continue
        scale = (length if f.name in LENGTHS else sharing if f.name in SHARING
                 else session if f.name in SESSIONS else 2.0 ** rng.uniform(-1.0, 1.0))
        value = f.default * scale
        if isinstance(f.default, int):
            params[f.name] = max(1, round(value))
        else:
            params[f.name] = round(max(1.0, value) if f.name in SESSIONS else value, 3)
    return kind, params, rng.choice(BURST_CVS)


def bursty(records: list[dict], cv: float, seed: int) -> list[dict]:
    """``records`` with their arrivals warped so the rate is multiplied, one
    ``BURST_WINDOW_S`` window of the trace at a time, by a gamma variate of mean 1 and
    coefficient of variation ``cv`` (0: unchanged); the span is kept, so the mean rate is
    too. Order is kept (the warp is monotone), and so are sessions' orders of turns."""
    if cv <= 0 or not records:
        return records
    rng = random.Random(seed ^ 0xB0B5)
    window = BURST_WINDOW_S * 1000
    span = records[-1]["timestamp"]
    shape = 1.0 / (cv * cv)
    n = int(span // window) + 1
    # A window whose rate is m times the mean lasts 1/m as long (capped: no window vanishes).
    lasts = [window / max(0.05, rng.gammavariate(shape, 1.0 / shape)) for _ in range(n)]
    starts = [0.0]
    for d in lasts:
        starts.append(starts[-1] + d)

    def warp(t: float) -> float:
        j = int(t // window)
        return starts[j] + (t - j * window) * lasts[j] / window

    scale = span / warp(span) if span else 1.0
    return [dict(r, timestamp=math.floor(warp(r["timestamp"]) * scale)) for r in records]


def unseen_traces(args: argparse.Namespace, folder: Path) -> list[Path]:
    """The ``--unseen`` workloads, generated into ``folder`` when not there yet."""
    out = []
    for seed in range(args.unseen_seed, args.unseen_seed + args.unseen):
        kind, params, cv = unseen_workload(seed)
        path = folder / f"unseen_{kind}_s{seed}.jsonl"
        if not path.is_file():
            records = bursty(generate(kind, args.requests, args.rate, seed=seed, **params),
                             cv, seed)
            tmp = path.with_name(path.name + ".tmp")
            write_jsonl(records, tmp)
            path.with_suffix(".params.json").write_text(json.dumps(
                {"kind": kind, "seed": seed, "burst_cv": cv, "params": params}) + "\n")
            tmp.replace(path)
        print(f"unseen {path.stem}: burst cv {cv}, " + ", ".join(
            f"{k}={v}" for k, v in params.items()), flush=True)
        out.append(path)
    return out


def check_options(path: Path, options: dict) -> None:
    """Record a campaign's options in ``path``, or, resuming, exit if they differ: the
    replays already there were made with those."""
    if path.is_file():
        before = json.loads(path.read_text())
        if before != options:
            changed = ", ".join(k for k in options if before.get(k) != options[k])
            sys.exit(f"campaign: {path.parent} holds a campaign made with other options "
                     f"({changed}); give another directory")
    else:
        path.write_text(json.dumps(options, indent=1) + "\n")


def focus_only(record: dict, focus: str, peers: dict) -> dict:
    """``peers`` (a policy_jitter --json record) with its focus's runs replaced by those of
    ``record``, whose only policy is ``focus``: the variant scored against the same peers'
    replays. Loads the peers' record lacks are left out."""
    if peers.get("closed_loop") and any(c.get("matched") for c in peers["loads"]):
        raise ValueError("its closed-loop replays were matched to its focus's load "
                         "(--match-load): replay the peers with the variant instead")
    for key in REPLAY_OPTIONS:
        mine, theirs = (r.get(key, OPTION_DEFAULTS.get(key)) for r in (record, peers))
        if mine is not None and theirs is not None and mine != theirs:
            raise ValueError(f"made with other options ({key}: {theirs!r}, the variant's "
                             f"{mine!r})")
    mine = {c["load"]: c["runs"] for c in record["loads"]}
    loads = []
    for cell in peers["loads"]:
        if cell["load"] not in mine:
            continue
        runs = {p: r for p, r in cell["runs"].items() if p != peers["focus"]}
        runs[focus] = mine[cell["load"]][focus]
        loads.append({"load": cell["load"], "runs": runs, "matched": []})
    return dict(peers, focus=focus, loads=loads)


def replay(trace: Path, args: argparse.Namespace, extra: list[str]) -> tuple[Path, float]:
    """One trace through bench/policy_jitter.py; its JSON lands in OUT when complete."""
    name = trace.name.removesuffix(".jsonl")
    target = args.out / f"{name}.json"
    raw = target if args.variant is None else args.out / "variant" / f"{name}.json"
    start = time.monotonic()
    if not raw.is_file():
        raw.parent.mkdir(parents=True, exist_ok=True)
        # policy_jitter.py rewrites its JSON after each load: only a finished one is renamed
        # to what a resumed campaign takes as done.
        partial = raw.with_name(f"{name}.json.partial")  # not out/*.json for score_cells
        policies = args.variant or args.policies
        cmd = [sys.executable, str(BENCH / "policy_jitter.py"), str(trace), "--policies",
               policies, "--json", str(partial), *extra]
        with (args.out / f"{name}.log").open("w") as log:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=BENCH.parent)
        if done.returncode != 0 or not partial.is_file():
            raise RuntimeError(f"{name}: bench/policy_jitter.py failed (exit "
                               f"{done.returncode}); see {args.out / (name + '.log')}")
        partial.replace(raw)
    if args.variant is not None:
        peers_file = args.peers_from / f"{name}.json"
        try:
            peers = json.loads(peers_file.read_text())
            merged = focus_only(json.loads(raw.read_text()), args.variant_name, peers)
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise RuntimeError(f"{name}: cannot score against {peers_file}: {exc}") from None
        target.write_text(json.dumps(merged) + "\n")
    return target, time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Options after -- go to bench/policy_jitter.py "
                                        "(e.g. -- --chunked-prefill --prefill-budget 8192).")
    ap.add_argument("out", type=Path, help="directory for the traces, replays and logs")
    ap.add_argument("--kinds", type=csv_kinds, default=list(KINDS),
                    help="generated workloads, or none (default: %(default)s)")
    ap.add_argument("--seeds", type=csv_ints, default=[1, 2, 3])
    ap.add_argument("--unseen", type=int, default=0, metavar="N",
                    help="also N workloads drawn from unseen seeds (see above; default 0)")
    ap.add_argument("--unseen-seed", type=int, default=1000, metavar="S",
                    help="the first unseen seed (default: %(default)s)")
    ap.add_argument("--requests", type=AT_LEAST_ONE, default=3000)
    ap.add_argument("--rate", type=POSITIVE, default=20.0,
                    help="the generated traces' request rate (loads are set per cell)")
    ap.add_argument("--mooncake", type=Path, default=MOONCAKE,
                    help="the Mooncake trace, or 'none' (default: %(default)s)")
    ap.add_argument("--policies", default=PEERS,
                    help="the first is the focus (default: %(default)s)")
    ap.add_argument("--variant", default=None, metavar="POLICY",
                    help="replay only this policy, scored against --peers-from's runs")
    ap.add_argument("--peers-from", type=Path, default=None, metavar="DIR")
    ap.add_argument("--warmup", default=None, metavar="N|Ss")
    ap.add_argument("--closed-loop", action="store_true")
    ap.add_argument("--match-load", action="store_true")
    ap.add_argument("--jobs", type=AT_LEAST_ONE, default=2,
                    help="traces replayed at once (default: %(default)s)")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.unseen < 0:
        ap.error(f"--unseen takes a count >= 0, got {args.unseen}")
    tuned = set(range(args.unseen_seed, args.unseen_seed + args.unseen)) & set(args.seeds)
    if tuned:
        ap.error(f"--unseen-seed: seeds {sorted(tuned)} are among --seeds: not unseen")
    if (args.variant is None) != (args.peers_from is None):
        ap.error("--variant and --peers-from go together")
    if args.variant is not None:
        if args.match_load:
            ap.error("--match-load replays cannot be reused with --peers-from")
        if not args.peers_from.is_dir():
            ap.error(f"--peers-from: no directory {args.peers_from}")
        factories = make_policies(args.variant, 0)  # exits with the reason on a bad spec
        if len(factories) != 1:
            ap.error("--variant names one policy")
        args.variant_name = factories[0]().name
    for flag, on in (("--closed-loop", args.closed_loop), ("--match-load", args.match_load)):
        if on:
            extra.append(flag)
    if args.warmup is not None:
        try:
            Warmup.parse(args.warmup)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            ap.error(f"--warmup: {exc}")
        extra += ["--warmup", args.warmup]
    if args.variant is None:
        extra += ["--others-predict-ttl-ms", "0"]
    args.out.mkdir(parents=True, exist_ok=True)
    check_options(args.out / "campaign.options", {
        "kinds": args.kinds, "seeds": args.seeds, "requests": args.requests,
        "rate": args.rate, "mooncake": str(args.mooncake),
        **({"unseen": args.unseen, "unseen_seed": args.unseen_seed} if args.unseen else {}),
        "policies": args.variant or args.policies, "replay": extra})
    todo = traces(args)
    print(f"campaign: {len(todo)} traces into {args.out}, {args.jobs} at a time", flush=True)
    done: list[Path] = []
    failed: list[str] = []
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(replay, t, args, extra) for t in todo]
        for n, fut in enumerate(as_completed(futures), 1):
            try:
                path, took = fut.result()
            except RuntimeError as exc:
                failed.append(str(exc))
                print(f"[{n}/{len(todo)}] {exc}", flush=True)
                continue
            done.append(path)
            print(f"[{n}/{len(todo)}] {path.stem} ({took:.0f} s)", flush=True)
    if done:
        focus = args.variant_name if args.variant else args.policies.split(",")[0]
        print(f"{focus} against the best of the others, cell by cell:", flush=True)
        subprocess.run([sys.executable, str(BENCH / "score_cells.py"),
                        *map(str, sorted(done))], cwd=BENCH.parent, check=False)
    if failed:
        sys.exit(f"campaign: {len(failed)} of {len(todo)} traces failed")


if __name__ == "__main__":
    main()
