"""The agent's engine sections: the engine's kind and limits, each adapter's own settings,
and its lower tier's transfer rate (``kvroute.core.config.AgentConfig`` holds them)."""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.core.redis_schema import check_endpoint
from kvroute.core.settings import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Range, Section, opt


@dataclass(frozen=True)
class EngineSettings(Section):
    """The engine beside the agent, whatever its kind."""

    title = "Engine"
    kind: str = opt("sim", "engine adapter", flag="engine",
                    choices=("sim", "tiny", "vllm", "sglang"))
    endpoint: str = opt("", "host:port a gateway sends this worker's HTTP requests to (its "
                        "engine's OpenAI server: pod IP and vLLM port), published in "
                        "heartbeats for `kvroute epp` (default: not published)",
                        flag="engine_endpoint")
    capacity_blocks: int = opt(4096, "KV cache capacity in blocks (sim and tiny engines)",
                               AT_LEAST_ONE)
    max_batch: int = opt(64, "most sequences in the running batch (sim and tiny engines; for "
                         "vllm, give its --max-num-seqs); routers split a program's fork "
                         "across workers when it would not fit", AT_LEAST_ONE)
    max_batched_tokens: int = opt(0, "vllm engine: its --max-num-batched-tokens, reported to "
                                  "routers, which avoid delaying requests that would be "
                                  "prefilled with this one (0: unknown; routers assume 8192); "
                                  "sim engine: the most prompt tokens it prefills per step, "
                                  "reported likewise (0: no limit)", NON_NEGATIVE)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.endpoint:
            try:
                check_endpoint(self.endpoint, "--engine-endpoint")
            except ValueError as exc:
                raise SystemExit(str(exc)) from None


@dataclass(frozen=True)
class SimSettings(Section):
    prefix = "sim"
    title = "Sim engine"
    chunked_prefill: bool = opt(False, "sim engine: split long prefills across steps under "
                                "--max-batched-tokens as vLLM V1 does (reported to routers as "
                                "chunked; default: whole prompts)")
    long_prefill_threshold: int = opt(0, "sim engine, with --sim-chunked-prefill: the most "
                                      "tokens of one prefill per step (vLLM's "
                                      "--long-prefill-token-threshold; 0: none)", NON_NEGATIVE)
    time_scale: float = opt(1.0, "multiplies the sim engine's modelled latencies",
                            NON_NEGATIVE, flag="time_scale")
    host_blocks: int = opt(0, "sim engine: blocks of a host (CPU) tier behind its cache: "
                           "evicted blocks go there and load back at the --tier-gbps rate, "
                           "published as lower-tier blocks (0: none)", NON_NEGATIVE)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.long_prefill_threshold and not self.chunked_prefill:
            raise SystemExit("--sim-long-prefill-threshold caps the chunks of a chunked "
                             "prefill: it needs --sim-chunked-prefill")


@dataclass(frozen=True)
class TinySettings(Section):
    prefix = "tiny"
    title = "Tiny engine"
    layers: int = opt(2, "tiny engine: transformer layers", AT_LEAST_ONE)
    dim: int = opt(64, "tiny engine: model width", AT_LEAST_ONE)
    seed: int = opt(0, "tiny engine: weight initialisation seed")


@dataclass(frozen=True)
class VllmSettings(Section):
    prefix = "vllm"
    title = "vLLM engine"
    url: str = opt("http://127.0.0.1:8000", "vllm engine: OpenAI-compatible HTTP base URL")
    model: str = opt("", "vllm engine: served model name (default: --model)")
    events: str = opt("tcp://127.0.0.1:5557", "vllm engine: KV-events ZMQ PUB endpoint")
    replay: str = opt("", "vllm engine: KV-events ZMQ replay (ROUTER) endpoint, optional")
    topic: str = opt("", "vllm engine: KV-events topic to subscribe to ('' = all)")
    chunked_prefill: bool = opt(True, "vllm engine: whether it chunks long prefills (vLLM V1's "
                                "default; --no-vllm-chunked-prefill when vLLM runs with "
                                "--no-enable-chunked-prefill), reported to routers "
                                "(kvroute_router_worker_prefill_mode)")
    long_prefill_threshold: int = opt(0, "vllm engine: its --long-prefill-token-threshold (the "
                                      "most tokens of one prefill per iteration; 0: none), "
                                      "reported to routers", NON_NEGATIVE)
    render_check_s: float = opt(300.0, "vllm engine: seconds between checks that vLLM renders "
                                "a probe chat to the ids the model's tokenizer gives, and "
                                "(with --vllm-mask-plugin) that it runs kvroute's mask plugin",
                                POSITIVE)
    mask_plugin: bool = opt(False, "vllm engine: vLLM runs kvroute's mask plugin "
                            "(--logits-processors kvroute_vllm_mask:KvrouteMask, "
                            "docs/engines.md), so a program continues any constrained region "
                            "there once vLLM says it runs (else: regular constraints only)")


@dataclass(frozen=True)
class SglangSettings(Section):
    prefix = "sglang"
    title = "SGLang engine"
    url: str = opt("http://127.0.0.1:30000", "sglang engine: its HTTP base URL (native "
                   "/generate, /server_info, /metrics)")
    events: str = opt("tcp://127.0.0.1:5557", "sglang engine: KV-events ZMQ PUB endpoint")
    replay: str = opt("", "sglang engine: KV-events ZMQ replay (ROUTER) endpoint, optional")
    topic: str = opt("", "sglang engine: KV-events topic to subscribe to ('' = all)")
    dp_rank: int = opt(-1, "sglang engine run with data parallelism (--dp-size): the rank "
                       "this agent serves as one worker. It follows that rank's KV events (the "
                       "endpoints' ports plus the rank, as SGLang offsets them), reads its "
                       "load and sends every request there (-1: the whole server)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dp_rank < -1:
            raise SystemExit(f"--sglang-dp-rank must be a rank (>= 0) or -1, got {self.dp_rank}")


@dataclass(frozen=True)
class TierSettings(Section):
    """The engine's lower tier (vLLM's CPU offloading, SGLang's HiCache host memory): how
    fast it loads a token's KV back into GPU memory, reported to routers, which weigh a
    prefix held there by that cost (``kvroute.core.policies.kvroute``). The defaults are the
    cost model's: Llama-3.1-8B's KV over PCIe 4.0 x16."""

    prefix = "tier"
    title = "Lower tier"
    kv_bytes_per_token: int = opt(131072, "bytes of KV one token takes: 2 x layers x KV heads "
                                  "x head size x bytes per value (131072: Llama-3.1-8B in "
                                  "BF16, 2 x 32 x 8 x 128 x 2)", AT_LEAST_ONE)
    gbps: float = opt(25.0, "GB/s the engine loads KV from its lower tier into GPU memory at "
                      "(25: PCIe 4.0 x16, 80 percent of its 32 GB/s)",
                      Range(0, 1e4, exclusive=True))

    @property
    def s_per_token(self) -> float:
        """Seconds to load one token's KV back (the heartbeat's lower_tier_s_per_token)."""
        return self.kv_bytes_per_token / (self.gbps * 1e9)
