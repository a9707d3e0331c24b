"""The engine cost model: how long an iteration of continuous batching takes.

The one source of these constants: the replay simulator times its workers with it and
kvroute's policy derives its defaults from it (``kvroute.core.policies.kvroute``), so the
router and the simulated GPU agree unless a replay says otherwise.

One iteration prefills the requests admitted in it and decodes one token for each running
sequence::

    prefill_s(n new tokens after c cached ones) = n * linear_s_per_token
                                                + n * (c + n / 2) * attn_s_per_token_pair
    decode_step_s(batch b)                       = decode_base_s + b * decode_per_seq_s
    iteration_s                                  = sum(prefill_s) + decode_step_s(running)

The attention term counts (query token, context token) pairs: each new token attends to the
``c`` cached tokens and, on average, to half of the new ones.

Default constants: Llama-3.1-8B, BF16, vLLM, one NVIDIA A100 40GB.

* Decode: 75 tokens/s for one sequence (13.3 ms/step) and 6.6x that throughput at 8
  concurrent sequences (8 / (6.6 * 75) = 16.2 ms/step), from J. Musgrave, "vLLM
  throughput-latency sweep on NVIDIA A100" (Llama-3.1-8B-Instruct, vLLM 0.23, 1024 in / 128
  out): ``decode_base_s = 13.3e-3``, ``decode_per_seq_s = (16.2 - 13.3) / 7 ms = 0.41e-3``.
* Prefill: 2 x 8.0e9 FLOPs per token for the weights at 60% of the A100's 312 TFLOPs BF16
  peak gives ``linear_s_per_token = 16e9 / 187e12 = 8.6e-5`` (~11.7k tokens/s, in line with
  published vLLM prefill rates for 8B models on A100); attention adds 4 * d_model * layers =
  4 * 4096 * 32 FLOPs per token pair: ``attn_s_per_token_pair = 524288 / 187e12 = 2.8e-9``.
* KV capacity, for the 80 GB part (same compute): 80 GB - 16 GB of weights, ~60 GB of it
  for KV; Llama-3.1-8B's KV is 128 KiB per token (2 x 32 layers x 8 KV heads x 128 x 2
  bytes), so ~480k tokens: 937 blocks of 512 tokens. (The 40 GB part holds ~160k tokens,
  too few for the longest requests of the Mooncake trace.)
* Lower tier (CPU memory behind the GPU cache: vLLM's offloading, SGLang's HiCache): a
  token's KV comes back over the host link, 128 KiB at ~25 GB/s (PCIe 4.0 x16's 32 GB/s at
  ~80% efficiency, the A100's link): ``lower_tier_s_per_token = 131072 / 25e9 = 5.2e-6``,
  0.061 of the token's linear prefill. So a prefix held only in CPU memory is ~16x cheaper
  than recomputing it, but not free: a 32k-token one takes ~0.17 s to load.
"""

from __future__ import annotations

from dataclasses import dataclass

A100_80GB_LLAMA8B_KV_TOKENS = 480_000


@dataclass(frozen=True, slots=True)
class CostModel:
    linear_s_per_token: float = 8.6e-5
    attn_s_per_token_pair: float = 2.8e-9
    decode_base_s: float = 13.3e-3
    decode_per_seq_s: float = 0.41e-3
    lower_tier_s_per_token: float = 131072 / 25e9

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        n = new_tokens
        return n * self.linear_s_per_token + n * (cached_tokens + n / 2) * \
            self.attn_s_per_token_pair

    def load_s(self, tokens: int) -> float:
        """Seconds to bring ``tokens`` tokens' KV from the lower tier into GPU memory."""
        return tokens * self.lower_tier_s_per_token

    def decode_step_s(self, batch: int) -> float:
        return self.decode_base_s + batch * self.decode_per_seq_s if batch else 0.0
