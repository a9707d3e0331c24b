"""The services' configuration, in sections (:mod:`kvroute.core.settings` reads them).

The router (:class:`RouterConfig`), the endpoint picker (:class:`EppConfig`: the router's
settings and its own) and the agent (:class:`AgentConfig`) share the sections that mean the
same to them: Redis, TLS, listeners, logging, the model, request limits. The rest are their
own. Where a name would mean two things, the services name it apart: the router's limits on a
whole program are ``--router-max-program-*``, an agent's on its own share ``--max-program-*``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute.core.blocks import DEFAULT_BLOCK_SIZE
from kvroute.core.engine_config import (
    EngineSettings,
    SglangSettings,
    SimSettings,
    TierSettings,
    TinySettings,
    VllmSettings,
)
from kvroute.core.redis_schema import (  # routers refuse a heartbeat's longer TTL
    MAX_TTL_S,
)
from kvroute.core.settings import (
    AT_LEAST_ONE,
    FRACTION,
    NON_NEGATIVE,
    PORT,
    POSITIVE,
    Range,
    Section,
    ServiceConfig,
    opt,
)

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
_REDIS_URL = ("Redis URL holding the cache index and heartbeats; redis+cluster://HOST:PORT for "
              "a Redis Cluster; rediss:// and rediss+cluster:// for TLS (see docs/security.md)")
_TOKENIZER = ("the model's tokenizer when --model gives no SOURCE: byte or gpt2 (the vocabulary "
              "of text prompts and programs' text)")


# -- shared by the router, the endpoint picker and the agent ---------------------------------

@dataclass(frozen=True)
class RedisSettings(Section):
    """Where the index lives and how to reach it (:mod:`kvroute.core.redis_conn`)."""

    prefix = "redis"
    title = "Redis"
    url: str = opt("redis://127.0.0.1:6379/0", _REDIS_URL, flag="redis")
    username: str = opt("", "Redis ACL user (default: the URL's, else 'default')")
    # Prefer the environment variable or --redis-password-file to the flag, which other
    # processes can read.
    password: str = opt("", "Redis password; prefer the environment variable or "
                        "--redis-password-file", secret=True)
    password_file: str = opt("", "file holding the Redis password (a mounted Secret); its "
                             "trailing newline is ignored")
    ca_file: str = opt("", "rediss: CA bundle (PEM) the Redis server's certificate must chain "
                       "to (default: the system's CAs)")
    cert_file: str = opt("", "rediss: client certificate (PEM) for mutual TLS")
    key_file: str = opt("", "rediss: the client certificate's private key (PEM)")


@dataclass(frozen=True)
class TlsSettings(Section):
    """TLS of the gRPC and HTTP listeners and of calls to agents (:mod:`kvroute.core.tls`,
    docs/security.md); the files are re-read when they change."""

    prefix = "tls"
    title = "TLS"
    cert: str = opt("", "TLS certificate (PEM) the gRPC and HTTP listeners serve (default: "
                    "plaintext)")
    key: str = opt("", "the --tls-cert's private key (PEM)")
    client_ca: str = opt("", "require client certificates signed by this CA (PEM): mTLS")
    allowed_sans: str = opt("", "with --tls-client-ca: accept only client certificates naming "
                            "one of these comma-separated SANs")
    ca: str = opt("", "call agents over TLS, verifying them against this CA (PEM)")
    client_cert: str = opt("", "with --tls-ca: the client certificate presented to agents "
                           "(default: --tls-cert)")
    client_key: str = opt("", "the --tls-client-cert's private key (default: --tls-key)")
    server_name: str = opt("", "with --tls-ca: the name agents' certificates must hold "
                           "(default: the host of each agent's address)")


@dataclass(frozen=True)
class ListenSettings(Section):
    """The gRPC listener and the plaintext ports beside it."""

    title = "Listeners"
    host: str = opt("127.0.0.1", "address to bind the gRPC server to")
    port: int = opt(50051, "gRPC port (0 picks a free one)", PORT)
    metrics_port: int = opt(0, "Prometheus /metrics port (0 disables)", PORT)
    metrics_host: str = opt("", "address to bind the metrics and health ports to (default: "
                            "--host); they are plaintext without API keys, for Prometheus and "
                            "probes")
    health_port: int = opt(0, "plaintext gRPC port serving only grpc.health.v1, for probes "
                           "that cannot do TLS (the kubelet's); 0: off", PORT)
    grpc_reflection: bool = opt(True, "serve gRPC server reflection (grpcurl without .proto "
                                "files); it lists every method to anyone reaching the port")

    @property
    def plain_host(self) -> str:
        """The address the plaintext metrics and health ports bind to."""
        return self.metrics_host or self.host


@dataclass(frozen=True)
class LogSettings(Section):
    prefix = "log"
    title = "Logging"
    level: str = opt("info", "log level: debug, info, warning, error")
    json: bool = opt(False, "log one JSON object per line")


@dataclass(frozen=True)
class ModelSettings(Section):
    """The model whose blocks are routed: its name keys every block and Redis key."""

    title = "Model"
    name: str = opt("default", "model name: part of every block key and Redis key",
                    flag="model")
    tokenizer: str = opt("", _TOKENIZER + "; '': token ids only")
    block_size: int = opt(DEFAULT_BLOCK_SIZE, "tokens per KV block; must equal the engine's",
                          AT_LEAST_ONE)
    vocab_size: int = opt(50257, "token ids must be below this (a model given with its "
                          "SOURCE takes the source's size)", AT_LEAST_ONE)


@dataclass(frozen=True)
class LimitSettings(Section):
    """What one request may ask for."""

    title = "Request limits"
    max_prompt_tokens: int = opt(131072, "longest prompt accepted, in tokens", AT_LEAST_ONE)
    max_new_tokens: int = opt(32768, "largest max_tokens accepted", AT_LEAST_ONE)


# -- the router's own ------------------------------------------------------------------------

@dataclass(frozen=True)
class RouterRedis(RedisSettings):
    retry_s: float = opt(1.0, "seconds between Redis reconnect attempts", POSITIVE)


@dataclass(frozen=True)
class RouterModel(ModelSettings):
    # It may name the model's tokenizer too, and be given once per model (router/pools.py:
    # each a pool of the workers serving it).
    name: str = opt("default", "model name (part of every block key and Redis key), or "
                    "NAME=SOURCE: the model and its tokenizer and chat template, SOURCE a HF "
                    "model directory, a tokenizer.json or hf:ORG/REPO[@REV] (needs "
                    "kvroute[models]; the HTTP front's chat endpoint needs one). Repeat it for "
                    "several models, each a pool of its own workers (the first serves requests "
                    "that name none; env: comma-separated)", flag="model", repeat=True)
    lora: str = opt("", "NAME=BASE: LoRA adapter NAME of --model BASE, served by BASE's "
                    "workers (vLLM --lora-modules) and keyed with its own salt; listed in "
                    "/v1/models (repeat it per adapter; env: comma-separated)", repeat=True,
                    flag="lora")


@dataclass(frozen=True)
class RouterLimits(LimitSettings):
    max_inflight: int = opt(0, "most requests in flight at once; past it HTTP answers 429 and "
                            "gRPC RESOURCE_EXHAUSTED (0: unlimited)", NON_NEGATIVE)
    program_fanout: int = opt(1024, "programs: most branches a whole program may have at "
                              "once, over all the workers its forks are split across; refused "
                              "before the router weighs it (an agent's --max-program-fanout "
                              "bounds its own share)", AT_LEAST_ONE,
                              flag="router_max_program_fanout", formerly="max_program_fanout")
    program_steps: int = opt(1024, "programs: most steps, counting sub-programs, refused "
                             "before the router weighs it (an agent's --max-program-steps "
                             "bounds what it runs)", AT_LEAST_ONE,
                             flag="router_max_program_steps", formerly="max_program_steps")


@dataclass(frozen=True)
class PolicySettings(Section):
    """How a worker is chosen (docs/policy.md), and what the router does around the choice."""

    title = "Policy"
    name: str = opt("kvroute", "routing policy: a name from `kvroute policies`, optionally "
                    "with parameter overrides, e.g. kvroute:hold=2 (the spec `kvroute replay "
                    "--policies` compares)", flag="policy")
    predict_ttl_s: float = opt(PREDICT_TTL_S, "predict a routed prompt's blocks on its worker "
                               "until its engine reports them stored, for at most this many "
                               "seconds; a request routed there on a prediction waits for "
                               "that prefill, so requests sharing a new prefix prefill it once "
                               "(0 = off; see README)", NON_NEGATIVE)
    coalesce_wait_s: float = opt(PREDICT_TTL_S, "longest a request waits for the in-flight "
                                 "prefill a prediction stands for before it is sent anyway "
                                 "(the default: as long as that prediction stands)", POSITIVE)
    coalesce_share: float = opt(COALESCE_SHARE, "a request waits for an in-flight prefill only "
                                "if it would get at least this fraction of it (else it is "
                                "routed on what workers really hold; 0: always wait)",
                                FRACTION)
    share_decisions: bool = opt(True, "share each routing decision with the other routers of "
                                "the model through Redis, and count theirs in each worker's "
                                "load and predicted blocks (docs/scaling.md)")
    share_max_age_s: float = opt(30.0, "longest another router's shared request is counted "
                                 "without its first token (a router that died leaves no load "
                                 "behind longer)", POSITIVE)
    program_overflow: bool = opt(True, "split a controller program's fork across workers when "
                                 "the chosen one cannot run all its branches now")
    max_copies: int = opt(4, "most background copies of hot prefixes in flight at once: the "
                          "kvroute policy copies a prefix in demand to a second worker instead "
                          "of moving a request off its holder (0: no copies)", NON_NEGATIVE)
    copy_timeout_s: float = opt(30.0, "deadline of a background copy's call to its worker: a "
                                "hung worker cannot hold a copy (and its load and predicted "
                                "blocks) longer", POSITIVE)
    route_candidates: int = opt(0, "most workers a Route response lists as candidates, best "
                                "first (0: every live worker; listing 128 adds ~0.2-0.5 ms to "
                                "a call, 1,000 ~1 ms)", NON_NEGATIVE)


@dataclass(frozen=True)
class WorkerSettings(Section):
    """Which workers there are, and how the router learns they went."""

    title = "Workers"
    static: str = opt("", "static workers, comma-separated id=host:port (heartbeats add more)",
                      flag="workers")
    discovery: str = opt("redis", "worker discovery: redis (heartbeats) or kubernetes",
                         choices=("redis", "kubernetes"))
    poll_interval_s: float = opt(0.5, "seconds between heartbeat scans", POSITIVE)
    connect_timeout_s: float = opt(2.0, "about the longest a request waits on a hung agent "
                                   "before trying the next: one not answering yet is probed "
                                   "every half of this, and left when a probe is not answered "
                                   "within the other half (docs/failure.md)", POSITIVE)
    k8s_namespace: str = opt("", "kubernetes discovery: namespace (default: the pod's own)")
    k8s_selector: str = opt("app.kubernetes.io/component=worker",
                            "kubernetes discovery: label selector of worker pods")
    k8s_port: int = opt(50061, "kubernetes discovery: agent gRPC port on worker pods",
                        Range(1, 65535))


@dataclass(frozen=True)
class HttpSettings(Section):
    """The HTTP front: OpenAI's API and Anthropic's Messages API (docs/http.md)."""

    prefix = "http"
    title = "HTTP front"
    port: int = opt(0, "HTTP port: OpenAI's /v1/chat/completions, /v1/completions, "
                    "/v1/models, Anthropic's /v1/messages, and /health (0: off; see "
                    "docs/http.md)", PORT)
    max_body_bytes: int = opt(16 << 20, "HTTP front: largest request body accepted, in bytes "
                              "(413 beyond)", AT_LEAST_ONE)
    max_tokens: int = opt(256, "HTTP front: max_tokens of a request that gives none (at most "
                          "--max-new-tokens)", AT_LEAST_ONE)
    max_generations: int = opt(128, "HTTP front: most generations one request asks for (a "
                               "batched completion's prompts times n; 413 beyond); each counts "
                               "against its API key's rate", AT_LEAST_ONE)
    max_batch_tokens: int = opt(262144, "HTTP front: most prompt tokens of all prompts of one "
                                "batched completion (413 beyond)", AT_LEAST_ONE)
    header_timeout_s: float = opt(10.0, "HTTP front: a connection whose request headers are "
                                  "not in this long after it opened is closed", POSITIVE)
    max_connections_per_client: int = opt(512, "HTTP front: most open connections from one "
                                          "client address (behind a proxy: the proxy's); more "
                                          "are closed as they open", AT_LEAST_ONE)
    batch_concurrency: int = opt(8, "HTTP front: prompts of one non-streaming batched "
                                 "completion generated at once (a stream runs them one after "
                                 "another)", AT_LEAST_ONE)
    tool_parser: str = opt("auto", "HTTP front: how models write tool calls, read into "
                           "tool_calls / tool_use blocks: hermes (<tool_call>{...}</tool_call>), "
                           "llama3_json, none (left as text), or auto (from the chat template; "
                           "docs/http.md)", choices=("auto", "hermes", "llama3_json", "none"))


@dataclass(frozen=True)
class AuthSettings(Section):
    title = "API keys"
    keys_file: str = opt("", "require an API key (Authorization: Bearer KEY) on the gRPC and "
                         "HTTP APIs; this file holds the keys' SHA-256 hashes, model "
                         "allowlists and rate limits, re-read on change (docs/security.md; "
                         "default: no keys needed)", flag="api_keys_file")


@dataclass(frozen=True)
class RouterConfig(ServiceConfig):
    """``kvroute router``."""

    redis: RouterRedis = field(default_factory=RouterRedis)
    tls: TlsSettings = field(default_factory=TlsSettings)
    listen: ListenSettings = field(default_factory=ListenSettings)
    log: LogSettings = field(default_factory=LogSettings)
    model: RouterModel = field(default_factory=RouterModel)
    limits: RouterLimits = field(default_factory=RouterLimits)
    policy: PolicySettings = field(default_factory=PolicySettings)
    workers: WorkerSettings = field(default_factory=WorkerSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)


@dataclass(frozen=True)
class EppSettings(Section):
    prefix = "epp"
    title = "Endpoint picker"
    port: int = opt(9002, "ext_proc gRPC port the gateway calls (the InferencePool's "
                    "endpointPickerRef port); health checks are served on it too", PORT)
    target_port: int = opt(8000, "the InferencePool's targetPort: the engines' HTTP port on "
                           "the worker pods, for a worker whose heartbeat carries no engine "
                           "endpoint (the agent's --engine-endpoint)", Range(1, 65535))
    fallbacks: int = opt(2, "most next-best endpoints listed in "
                         "x-gateway-destination-endpoint-fallback (0: none)", NON_NEGATIVE)


@dataclass(frozen=True)
class EppConfig(RouterConfig):
    """``kvroute epp``: the router's settings and the ext_proc port (router/epp.py)."""

    epp: EppSettings = field(default_factory=EppSettings)


# -- the agent's own -------------------------------------------------------------------------

@dataclass(frozen=True)
class AgentListen(ListenSettings):
    port: int = opt(50061, "gRPC port (0 picks a free one)", PORT)


@dataclass(frozen=True)
class AgentModel(ModelSettings):
    name: str = opt("default", "model name (part of every block key and Redis key), or "
                    "NAME=SOURCE as the router is given it (the same as --model NAME "
                    "--model-source SOURCE)", flag="model")
    tokenizer: str = opt("byte", _TOKENIZER + "; the tiny engine's vocabulary, and programs' "
                         "on any engine whose --vocab-size is its")
    source: str = opt("", "the model's tokenizer: the SOURCE the router is given as --model "
                      "NAME=SOURCE (a HF model directory, a tokenizer.json or "
                      "hf:ORG/REPO[@REV]; needs kvroute[models]). The agent reports that "
                      "tokenizer and its size to routers (no --vocab-size to work out), checks "
                      "ids against it and runs programs' text, constraints and stop strings "
                      "with it; a vllm agent also checks now and then that vLLM renders a "
                      "probe chat to the same ids (docs/http.md)", flag="model_source")

    def __post_init__(self) -> None:
        super().__post_init__()
        if "=" in self.name:
            name, source = (x.strip() for x in self.name.split("=", 1))
            if not name or not source or self.source not in ("", source):
                raise SystemExit(f"--model {self.name}: give NAME=SOURCE, or NAME and "
                                 "--model-source SOURCE, not both")
            object.__setattr__(self, "name", name)
            object.__setattr__(self, "source", source)


@dataclass(frozen=True)
class ProgramLimits(Section):
    """Limits of the controller programs an agent runs, checked before any engine work."""

    title = "Programs"
    fanout: int = opt(16, "programs: most branches of a program this agent runs at once",
                      AT_LEAST_ONE, flag="max_program_fanout")
    tokens: int = opt(16384, "programs: most tokens generated or fast-forwarded, over all "
                      "branches", AT_LEAST_ONE, flag="max_program_tokens")
    steps: int = opt(256, "programs: most steps, counting sub-programs", AT_LEAST_ONE,
                     flag="max_program_steps")
    grammar_bytes: int = opt(65536, "programs: largest constraint (schema, regex, lark, "
                             "choices) in bytes", AT_LEAST_ONE, flag="max_grammar_bytes")
    compile_timeout_s: float = opt(2.0, "programs: seconds to compile one constraint (0: every "
                                   "constraint is refused)", NON_NEGATIVE,
                                   flag="grammar_compile_timeout_s")


@dataclass(frozen=True)
class PublishSettings(Section):
    """Who this worker is to routers, and how it publishes its cache and load."""

    title = "Worker"
    worker_id: str = opt("", "this worker's id (default: hostname:port)")
    advertise: str = opt("", "address routers use to reach this agent (default host:port)")
    heartbeat_s: float = opt(1.0, "seconds between heartbeats", POSITIVE)
    heartbeat_ttl_s: float = opt(3.0, "heartbeat TTL: a worker silent this long is dead; "
                                 "longer than --heartbeat-s",
                                 Range(0, MAX_TTL_S, exclusive=True))
    publish_buffer: int = opt(100000, "cache events buffered while Redis is down before "
                              "resync", NON_NEGATIVE)
    feed_maxlen: int = opt(1000000, "approximate cap on change-feed length (XADD MAXLEN ~)",
                           AT_LEAST_ONE)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.heartbeat_ttl_s > self.heartbeat_s:
            # Its key would expire between two beats: routers would drop a live worker.
            raise SystemExit(f"--heartbeat-ttl-s ({self.heartbeat_ttl_s:g} s) must be longer "
                             f"than --heartbeat-s ({self.heartbeat_s:g} s)")


@dataclass(frozen=True)
class AgentConfig(ServiceConfig):
    """``kvroute agent``."""

    redis: RedisSettings = field(default_factory=RedisSettings)
    tls: TlsSettings = field(default_factory=TlsSettings)
    listen: AgentListen = field(default_factory=AgentListen)
    log: LogSettings = field(default_factory=LogSettings)
    model: AgentModel = field(default_factory=AgentModel)
    limits: LimitSettings = field(default_factory=LimitSettings)
    programs: ProgramLimits = field(default_factory=ProgramLimits)
    worker: PublishSettings = field(default_factory=PublishSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    sim: SimSettings = field(default_factory=SimSettings)
    tiny: TinySettings = field(default_factory=TinySettings)
    vllm: VllmSettings = field(default_factory=VllmSettings)
    sglang: SglangSettings = field(default_factory=SglangSettings)
    tier: TierSettings = field(default_factory=TierSettings)

    def __post_init__(self) -> None:
        if self.sim.chunked_prefill and not self.engine.max_batched_tokens:
            raise SystemExit("--sim-chunked-prefill needs --max-batched-tokens > 0 (the token "
                             "budget each step's chunks share)")
