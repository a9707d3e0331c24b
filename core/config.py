"""Service configuration: dataclasses whose fields double as CLI flags and env variables.

Each field's metadata carries its help text; ``--some-field`` on the command line, else
``KVROUTE_SOME_FIELD`` in the environment, else the field default. One declaration serves
``--help``, the environment and the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, get_type_hints

from kvroute.core.blocks import DEFAULT_BLOCK_SIZE
from kvroute.core.redis_schema import (  # routers refuse a heartbeat's longer TTL
    MAX_TTL_S,
    check_endpoint,
)

ENV_PREFIX = "KVROUTE_"
# How long a predicted entry stands unless the engine's store event confirms it first, and
# so the window within which a request sharing a new prefix is coalesced with the one in
# flight (sent where it went, after its prefill): the router's and the replay simulator's
# default. A prediction should last until its prefill is stored: it is confirmed then, and
# withdrawn at once if its request fails, so the TTL bounds only one whose outcome the
# router never learns, and an early expiry costs more than a late one (every sibling
# arriving after it redoes the prefix, against one at most that finds it gone). So: as long
# as a client waits for a first token, the OpenAI SDK's default timeout. At 30 s, waits
# past it at 95% load cost kvroute's policy 6.6 points of hit ratio (docs/coalescing.md).
PREDICT_TTL_S = 600.0
# The least fraction of an in-flight prefill a request must get from it to wait for it
# (kvroute.router.coalesce).
COALESCE_SHARE = 0.8
T = TypeVar("T")


@dataclass(frozen=True)
class Range:
    """The values a numeric setting accepts: finite, ``low <= v`` (``low < v`` when
    ``exclusive``) and ``v <= high``. A config's fields declare theirs (:func:`opt`) and are
    checked when it is built, so a bad flag or environment value stops the service at start
    with its name, instead of a busy loop (a 0 s heartbeat), a worker that flaps (a NaN TTL)
    or a traceback deep in an engine; :meth:`parser` checks a CLI's own flags the same way."""

    low: float
    high: float = math.inf
    exclusive: bool = False

    def accepts(self, v: object) -> bool:
        return (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
                and (self.low < v if self.exclusive else self.low <= v) and v <= self.high)

    def wanted(self, integer: bool) -> str:
        """What it accepts, in words: ``an integer >= 1``, ``a finite number in [0, 1]``."""
        bound = (f"in {'(' if self.exclusive else '['}{self.low:g}, {self.high:g}]"
                 if self.high < math.inf else f"{'>' if self.exclusive else '>='} {self.low:g}")
        return f"{'an integer' if integer else 'a finite number'} {bound}"

    def check(self, name: str, v: float) -> None:
        """Exit naming config field ``name``'s flag and environment variable unless ``v`` is
        accepted."""
        if not self.accepts(v):
            raise SystemExit(f"{_flag(name)} ({ENV_PREFIX}{name.upper()}) must be "
                             f"{self.wanted(isinstance(v, int))}, got {v!r}")

    def parser(self, kind: type[int] | type[float]) -> Callable[[str], Any]:
        """An argparse ``type`` reading a ``kind`` in this range: argparse then names the flag
        and what it wanted."""
        def parse(text: str) -> int | float:
            try:
                v = kind(text)
            except ValueError:
                v = None
            if not self.accepts(v):
                raise argparse.ArgumentTypeError(
                    f"expected {self.wanted(kind is int)}, got {text!r}")
            return v  # type: ignore[return-value]

        return parse

    def list_parser(self, kind: type[int] | type[float]) -> Callable[[str], list[Any]]:
        """An argparse ``type`` reading ``16,128``: a non-empty comma-separated list of
        ``kind``, each in this range."""
        one = self.parser(kind)

        def parse(text: str) -> list[Any]:
            parts = [x for x in text.split(",") if x.strip()]
            if not parts:
                raise argparse.ArgumentTypeError(
                    f"expected comma-separated values, each {self.wanted(kind is int)}, "
                    f"got {text!r}")
            return [one(x) for x in parts]

        return parse


AT_LEAST_ONE = Range(1)
NON_NEGATIVE = Range(0)
POSITIVE = Range(0, exclusive=True)
PORT = Range(0, 65535)  # 0 picks a free one
FRACTION = Range(0, 1)


def opt(default: Any, help: str, range: Range | None = None) -> Any:
    return field(default=default, metadata={"help": help, "range": range})


def repeated(default: str, help: str) -> Any:
    """A flag that may be given several times: its values joined with commas (as its
    environment variable writes them)."""
    return field(default=default, metadata={"help": help, "range": None, "repeat": True})


class _Join(argparse.Action):
    """Each use of a repeated flag adds its value; the first replaces the default."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        seen = f"_{self.dest}_given"
        prior = getattr(namespace, self.dest) if getattr(namespace, seen, False) else ""
        setattr(namespace, seen, True)
        setattr(namespace, self.dest, f"{prior},{values}" if prior else values)


def check_ranges(config: Any) -> None:
    """Refuse a config whose numeric fields are outside their declared :class:`Range`."""
    for f in dataclasses.fields(config):
        if (r := f.metadata.get("range")) is not None:
            r.check(f.name, getattr(config, f.name))


@dataclass(frozen=True)
class CommonConfig:
    redis: str = opt("redis://127.0.0.1:6379/0", "Redis URL holding the cache index and "
                     "heartbeats; redis+cluster://HOST:PORT for a Redis Cluster; rediss:// "
                     "and rediss+cluster:// for TLS (see docs/security.md)")
    redis_username: str = opt("", "Redis ACL user (default: the URL's, else 'default')")
    # Secret: left out of repr and --help (add_arguments); prefer the environment variable
    # or --redis-password-file to the flag, which other processes can read.
    redis_password: str = field(default="", repr=False, metadata={
        "help": "Redis password; prefer the environment variable or --redis-password-file",
        "range": None, "secret": True})
    redis_password_file: str = opt("", "file holding the Redis password (a mounted Secret); "
                                   "its trailing newline is ignored")
    redis_ca_file: str = opt("", "rediss: CA bundle (PEM) the Redis server's certificate must "
                             "chain to (default: the system's CAs)")
    redis_cert_file: str = opt("", "rediss: client certificate (PEM) for mutual TLS")
    redis_key_file: str = opt("", "rediss: the client certificate's private key (PEM)")
    # TLS of the gRPC and HTTP listeners and of calls to agents (core/tls.py,
    # docs/security.md); the files are re-read when they change.
    tls_cert: str = opt("", "TLS certificate (PEM) the gRPC and HTTP listeners serve (default: "
                        "plaintext)")
    tls_key: str = opt("", "the --tls-cert's private key (PEM)")
    tls_client_ca: str = opt("", "require client certificates signed by this CA (PEM): mTLS")
    tls_allowed_sans: str = opt("", "with --tls-client-ca: accept only client certificates "
                                "naming one of these comma-separated SANs")
    tls_ca: str = opt("", "call agents over TLS, verifying them against this CA (PEM)")
    tls_client_cert: str = opt("", "with --tls-ca: the client certificate presented to agents "
                               "(default: --tls-cert)")
    tls_client_key: str = opt("", "the --tls-client-cert's private key (default: --tls-key)")
    tls_server_name: str = opt("", "with --tls-ca: the name agents' certificates must hold "
                               "(default: the host of each agent's address)")
    model: str = opt("default", "model name: part of every block key and Redis key")
    block_size: int = opt(DEFAULT_BLOCK_SIZE, "tokens per KV block; must equal the engine's",
                          AT_LEAST_ONE)
    host: str = opt("127.0.0.1", "address to bind the gRPC server to")
    port: int = opt(50051, "gRPC port (0 picks a free one)", PORT)
    metrics_port: int = opt(0, "Prometheus /metrics port (0 disables)", PORT)
    metrics_host: str = opt("", "address to bind the metrics and health ports to (default: "
                            "--host); they are plaintext without API keys, for Prometheus "
                            "and probes")
    health_port: int = opt(0, "plaintext gRPC port serving only grpc.health.v1, for probes "
                           "that cannot do TLS (the kubelet's); 0: off", PORT)
    grpc_reflection: bool = opt(True, "serve gRPC server reflection (grpcurl without .proto "
                                "files); it lists every method to anyone reaching the port")
    log_level: str = opt("info", "log level: debug, info, warning, error")
    log_json: bool = opt(False, "log one JSON object per line")
    vocab_size: int = opt(50257, "token ids must be below this (an agent given "
                          "--model-source, and a router given --model NAME=SOURCE, take the "
                          "source's size)", AT_LEAST_ONE)
    max_prompt_tokens: int = opt(131072, "longest prompt accepted, in tokens", AT_LEAST_ONE)
    max_new_tokens: int = opt(32768, "largest max_tokens accepted", AT_LEAST_ONE)

    def __post_init__(self) -> None:
        check_ranges(self)


@dataclass(frozen=True)
class RouterConfig(CommonConfig):
    policy: str = opt("kvroute", "routing policy: a name from `kvroute policies`, optionally "
                                 "with parameter overrides, e.g. kvroute:hold=2 (the spec "
                                 "`kvroute replay --policies` compares)")
    workers: str = opt("", "static workers, comma-separated id=host:port (heartbeats add more)")
    tokenizer: str = opt("", "tokenizer for text prompts: '' (token ids only), byte or gpt2")
    poll_interval_s: float = opt(0.5, "seconds between heartbeat scans", POSITIVE)
    connect_timeout_s: float = opt(2.0, "about the longest a request waits on a hung agent "
                                   "before trying the next: one not answering yet is probed "
                                   "every half of this, and left when a probe is not answered "
                                   "within the other half (docs/failure.md)", POSITIVE)
    redis_retry_s: float = opt(1.0, "seconds between Redis reconnect attempts", POSITIVE)
    predict_ttl_s: float = opt(PREDICT_TTL_S, "predict a routed prompt's blocks on its worker "
                               "until its engine reports them stored, for at most this many "
                               "seconds; a request routed there on a prediction waits for "
                               "that prefill, so requests sharing a new prefix prefill it "
                               "once (0 = off; see README)", NON_NEGATIVE)
    coalesce_wait_s: float = opt(PREDICT_TTL_S, "longest a request waits for the in-flight "
                                 "prefill a prediction stands for before it is sent anyway "
                                 "(the default: as long as that prediction stands)", POSITIVE)
    coalesce_share: float = opt(COALESCE_SHARE, "a request waits for an in-flight prefill only "
                                "if it would get at least this fraction of it (else it is "
                                "routed on what workers really hold; 0: always wait)",
                                FRACTION)
    share_decisions: bool = opt(True, "share each routing decision with the other routers "
                                "of the model through Redis, and count theirs in each "
                                "worker's load and predicted blocks (docs/scaling.md)")
    share_max_age_s: float = opt(30.0, "longest another router's shared request is counted "
                                 "without its first token (a router that died leaves no "
                                 "load behind longer)", POSITIVE)
    program_overflow: bool = opt(True, "split a controller program's fork across workers "
                                 "when the chosen one cannot run all its branches now")
    max_program_fanout: int = opt(1024, "programs: most branches a program may have at "
                                  "once, refused before the router weighs it (each agent "
                                  "checks its own --max-program-fanout)", AT_LEAST_ONE)
    max_program_steps: int = opt(1024, "programs: most steps, counting sub-programs, refused "
                                 "before the router weighs it", AT_LEAST_ONE)
    max_copies: int = opt(4, "most background copies of hot prefixes in flight at once: the "
                          "kvroute policy copies a prefix in demand to a second worker instead "
                          "of moving a request off its holder (0: no copies)",
                          NON_NEGATIVE)
    copy_timeout_s: float = opt(30.0, "deadline of a background copy's call to its worker: a "
                                "hung worker cannot hold a copy (and its load and predicted "
                                "blocks) longer", POSITIVE)
    route_candidates: int = opt(0, "most workers a Route response lists as candidates, best "
                                "first (0: every live worker; listing 128 adds ~0.2-0.5 ms to "
                                "a call)", NON_NEGATIVE)
    discovery: str = opt("redis", "worker discovery: redis (heartbeats) or kubernetes")
    k8s_namespace: str = opt("", "kubernetes discovery: namespace (default: the pod's own)")
    k8s_selector: str = opt("app.kubernetes.io/component=worker",
                            "kubernetes discovery: label selector of worker pods")
    k8s_port: int = opt(50061, "kubernetes discovery: agent gRPC port on worker pods",
                        Range(1, 65535))
    # The router's own help for the shared field: it may name the model's tokenizer too,
    # and be given once per model (router/pools.py: each a pool of the workers serving it).
    model: str = repeated("default", "model name (part of every block key and Redis key), or "
                          "NAME=SOURCE: the model and its tokenizer and chat template, SOURCE a "
                          "HF model directory, a tokenizer.json or hf:ORG/REPO[@REV] (needs "
                          "kvroute[models]; the HTTP front's chat endpoint needs one). Repeat "
                          "it for several models, each a pool of its own workers (the first "
                          "serves requests that name none; env: comma-separated)")
    lora: str = repeated("", "NAME=BASE: LoRA adapter NAME of --model BASE, served by BASE's "
                         "workers (vLLM --lora-modules) and keyed with its own salt; listed "
                         "in /v1/models (repeat it per adapter; env: comma-separated)")
    max_inflight: int = opt(0, "most requests in flight at once; past it HTTP answers 429 and "
                            "gRPC RESOURCE_EXHAUSTED (0: unlimited)", NON_NEGATIVE)
    http_port: int = opt(0, "OpenAI-compatible HTTP port: /v1/chat/completions, "
                         "/v1/completions, /v1/models, /health (0: off; see docs/http.md)",
                         PORT)
    http_max_body_bytes: int = opt(16 << 20, "HTTP front: largest request body accepted, in "
                                   "bytes (413 beyond)", AT_LEAST_ONE)
    http_max_tokens: int = opt(256, "HTTP front: max_tokens of a request that gives none (at "
                               "most --max-new-tokens)", AT_LEAST_ONE)
    http_max_generations: int = opt(128, "HTTP front: most generations one request asks for "
                                    "(a batched completion's prompts times n; 413 beyond); "
                                    "each counts against its API key's rate", AT_LEAST_ONE)
    http_max_batch_tokens: int = opt(262144, "HTTP front: most prompt tokens of all prompts "
                                     "of one batched completion (413 beyond)", AT_LEAST_ONE)
    http_header_timeout_s: float = opt(10.0, "HTTP front: a connection whose request headers "
                                       "are not in this long after it opened is closed",
                                       POSITIVE)
    http_max_connections_per_client: int = opt(512, "HTTP front: most open connections from "
                                               "one client address (behind a proxy: the "
                                               "proxy's); more are closed as they open",
                                               AT_LEAST_ONE)
    http_batch_concurrency: int = opt(8, "HTTP front: prompts of one non-streaming batched "
                                      "completion generated at once (a stream runs them one "
                                      "after another)", AT_LEAST_ONE)
    api_keys_file: str = opt("", "require an API key (Authorization: Bearer KEY) on the gRPC "
                             "and HTTP APIs; this file holds the keys' SHA-256 hashes, model "
                             "allowlists and rate limits, re-read on change (docs/security.md; "
                             "default: no keys needed)")



@dataclass(frozen=True)
class EppConfig(RouterConfig):
    """`kvroute epp`: the router's settings and the ext_proc port (router/epp.py)."""
    epp_port: int = opt(9002, "ext_proc gRPC port the gateway calls (the InferencePool's "
                        "endpointPickerRef port); health checks are served on it too", PORT)
    epp_target_port: int = opt(8000, "the InferencePool's targetPort: the engines' HTTP port "
                               "on the worker pods, for a worker whose heartbeat carries no "
                               "engine endpoint (the agent's --engine-endpoint)",
                               Range(1, 65535))
    epp_fallbacks: int = opt(2, "most next-best endpoints listed in "
                             "x-gateway-destination-endpoint-fallback (0: none)", NON_NEGATIVE)


@dataclass(frozen=True)
class AgentConfig(CommonConfig):
    port: int = opt(50061, "gRPC port (0 picks a free one)", PORT)
    engine: str = opt("sim", "engine adapter: sim, tiny or vllm")
    worker_id: str = opt("", "this worker's id (default: hostname:port)")
    advertise: str = opt("", "address routers use to reach this agent (default host:port)")
    engine_endpoint: str = opt("", "host:port a gateway sends this worker's HTTP requests to "
                               "(its engine's OpenAI server: pod IP and vLLM port), published "
                               "in heartbeats for `kvroute epp` (default: not published)")
    capacity_blocks: int = opt(4096, "KV cache capacity in blocks (sim engine)", AT_LEAST_ONE)
    max_batch: int = opt(64, "most sequences in the running batch (sim and tiny engines; "
                         "for vllm, give its --max-num-seqs); routers split a program's fork "
                         "across workers when it would not fit", AT_LEAST_ONE)
    max_batched_tokens: int = opt(0, "vllm engine: its --max-num-batched-tokens, reported to "
                                  "routers, which avoid delaying requests that would be "
                                  "prefilled with this one (0: unknown; routers assume 8192); "
                                  "sim engine: the most prompt tokens it prefills per step, "
                                  "reported likewise (0: no limit)", NON_NEGATIVE)
    sim_chunked_prefill: bool = opt(False, "sim engine: split long prefills across steps "
                                    "under --max-batched-tokens as vLLM V1 does (reported to "
                                    "routers as chunked; default: whole prompts)")
    sim_long_prefill_threshold: int = opt(0, "sim engine, with --sim-chunked-prefill: the most "
                                          "tokens of one prefill per step (vLLM's "
                                          "--long-prefill-token-threshold; 0: none)",
                                          NON_NEGATIVE)
    time_scale: float = opt(1.0, "multiplies the sim engine's modelled latencies", NON_NEGATIVE)
    heartbeat_s: float = opt(1.0, "seconds between heartbeats", POSITIVE)
    heartbeat_ttl_s: float = opt(3.0, "heartbeat TTL: a worker silent this long is dead; longer "
                                   "than --heartbeat-s", Range(0, MAX_TTL_S, exclusive=True))
    publish_buffer: int = opt(100000, "cache events buffered while Redis is down before resync",
                              NON_NEGATIVE)
    feed_maxlen: int = opt(1000000, "approximate cap on change-feed length (XADD MAXLEN ~)",
                           AT_LEAST_ONE)
    # -- engine tiny
    tiny_layers: int = opt(2, "tiny engine: transformer layers", AT_LEAST_ONE)
    tiny_dim: int = opt(64, "tiny engine: model width", AT_LEAST_ONE)
    tiny_seed: int = opt(0, "tiny engine: weight initialisation seed")
    tokenizer: str = opt("byte", "without --model-source: byte or gpt2, the tiny engine's "
                         "vocabulary, and programs' on any engine whose --vocab-size is its")
    # -- controller programs (limits checked before any engine work)
    max_program_fanout: int = opt(16, "programs: most branches a program may have at once",
                                  AT_LEAST_ONE)
    max_program_tokens: int = opt(16384, "programs: most tokens generated or fast-forwarded, "
                                  "over all branches", AT_LEAST_ONE)
    max_program_steps: int = opt(256, "programs: most steps, counting sub-programs",
                                 AT_LEAST_ONE)
    max_grammar_bytes: int = opt(65536, "programs: largest constraint (schema, regex, lark, "
                                 "choices) in bytes", AT_LEAST_ONE)
    grammar_compile_timeout_s: float = opt(2.0, "programs: seconds to compile one constraint "
                                           "(0: every constraint is refused)", NON_NEGATIVE)
    # -- engine vllm
    vllm_url: str = opt("http://127.0.0.1:8000", "vllm engine: OpenAI-compatible HTTP base URL")
    vllm_model: str = opt("", "vllm engine: served model name (default: --model)")
    vllm_events: str = opt("tcp://127.0.0.1:5557", "vllm engine: KV-events ZMQ PUB endpoint")
    vllm_replay: str = opt("", "vllm engine: KV-events ZMQ replay (ROUTER) endpoint, optional")
    vllm_topic: str = opt("", "vllm engine: KV-events topic to subscribe to ('' = all)")
    vllm_chunked_prefill: bool = opt(True, "vllm engine: whether it chunks long prefills "
                                     "(vLLM V1's default; --no-vllm-chunked-prefill when vLLM "
                                     "runs with --no-enable-chunked-prefill), reported to routers "
                                     "(kvroute_router_worker_prefill_mode)")
    vllm_long_prefill_threshold: int = opt(0, "vllm engine: its --long-prefill-token-threshold "
                                           "(the most tokens of one prefill per iteration; "
                                           "0: none), reported to routers",
                                           NON_NEGATIVE)
    model_source: str = opt("", "the model's tokenizer: the SOURCE the router is given as "
                            "--model NAME=SOURCE (a HF model directory, a tokenizer.json or "
                            "hf:ORG/REPO[@REV]; needs kvroute[models]). The agent reports "
                            "that tokenizer and its size to routers (no --vocab-size to "
                            "work out), checks ids against it and runs programs' text, "
                            "constraints and stop strings with it; a vllm agent also checks "
                            "now and then that vLLM renders a probe chat to the same ids "
                            "(docs/http.md)")
    vllm_render_check_s: float = opt(300.0, "vllm engine: seconds between those checks",
                                     POSITIVE)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.engine_endpoint:
            try:
                check_endpoint(self.engine_endpoint, "--engine-endpoint")
            except ValueError as exc:
                raise SystemExit(str(exc)) from None
        if not self.heartbeat_ttl_s > self.heartbeat_s:
            # Its key would expire between two beats: routers would drop a live worker.
            raise SystemExit(f"--heartbeat-ttl-s ({self.heartbeat_ttl_s:g} s) must be longer than "
                             f"--heartbeat-s ({self.heartbeat_s:g} s)")
        if self.sim_chunked_prefill and not self.max_batched_tokens:
            raise SystemExit("--sim-chunked-prefill needs --max-batched-tokens > 0 (the token "
                             "budget each step's chunks share)")
        if self.sim_long_prefill_threshold and not self.sim_chunked_prefill:
            raise SystemExit("--sim-long-prefill-threshold caps the chunks of a chunked "
                             "prefill: it needs --sim-chunked-prefill")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, unless the help already says it (say, "default:
    the router's") or the option is a switch (its default is always off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class RawDefaultsFormatter(DefaultsFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and a description kept as written (a formula)."""


def add_arguments(parser: argparse.ArgumentParser, cls: type, env: Mapping[str, str]) -> None:
    """One flag per field; the default shown is the environment's value if set."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        env_name = ENV_PREFIX + f.name.upper()
        default = _parse(typ, env[env_name], env_name) if env_name in env else f.default
        help_text = f"{f.metadata.get('help', '')} (env {env_name}; default: %(default)s)"
        if f.metadata.get("secret"):  # --help must not print a secret set in the environment
            help_text = (f"{f.metadata.get('help', '')} (env {env_name}; default: none; a "
                         "value given is never shown)")
        if typ is bool:
            parser.add_argument(_flag(f.name), dest=f.name, default=default,
                                action=argparse.BooleanOptionalAction, help=help_text)
        elif f.metadata.get("repeat"):
            parser.add_argument(_flag(f.name), dest=f.name, default=default, action=_Join,
                                help=help_text)
        else:
            parser.add_argument(_flag(f.name), dest=f.name, type=typ, default=default,
                                help=help_text)


def _parse(typ: type, raw: str, where: str) -> Any:
    try:
        if typ is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        return typ(raw)
    except ValueError:
        raise SystemExit(f"{where}={raw!r} is not a valid {typ.__name__}") from None


def from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]


def from_env(cls: type[T], env: Mapping[str, str] | None = None, **overrides: Any) -> T:
    """Build a config from the environment and keyword overrides (for tests and embedding)."""
    env = os.environ if env is None else env
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        env_name = ENV_PREFIX + f.name.upper()
        if env_name in env:
            values[f.name] = _parse(hints[f.name], env[env_name], env_name)
    values.update(overrides)
    return cls(**values)
