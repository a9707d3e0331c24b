"""The SGLang releases this adapter supports, and what differs between them on the wire.

``SUPPORTED`` is the one statement of the range; both ends are tested
(tests/worker_agent/engines/sglang/: SGLang's own ``kv_events.py`` of each release executed
from its wheel, and a test server answering as that release's HTTP code does). The agent
reads the server's version from ``GET /server_info`` (``/get_server_info`` before 0.5.12)
and warns, without refusing, when it is outside.

What differs across the range (from each release's own code):

* KV events (``sglang/srt/disaggregation/kv_events.py``): arrays before 0.5.12, tagged maps
  with ``medium`` after; ``cache_salt`` in ``BlockStored`` since :data:`CACHE_SALT_SINCE`.
  :mod:`..served.wire` decodes every layout, whatever the version.
* ``cache_salt`` in ``/generate`` (``GenerateReqInput``): since :data:`CACHE_SALT_SINCE`, the
  release whose events name it too. Older releases isolate by ``extra_key`` but do not say so
  in their events, so the agent could not key those blocks as the router does: a salted
  request to them is refused.
* ``sampling_params.sampling_seed``: since 0.5.3; older ``SamplingParams`` reject unknown
  names, so the seed is sent only to releases that take it.
* The data-parallel rank a request is pinned to: ``data_parallel_rank``, renamed
  ``routed_dp_rank`` in 0.5.10 (:data:`ROUTED_DP_RANK_SINCE`; the old name is read by some
  later releases with a deprecation warning, by others not at all).
* LoRA: ``lora_path`` in ``/generate`` in every supported release, but ``BlockStored`` names
  the adapter (``lora_name``) only from :data:`LORA_EVENTS_SINCE`. Before, an adapter's blocks
  look like the base model's: the agent serves the request and warns once that the router's
  view of adapter blocks is wrong on that server.
* Streamed ``output_ids``: whole so far, or only the new ones (``--stream-output`` before
  0.5.12, ``--incremental-streaming-output`` after): the client takes the new ones from
  ``meta_info.completion_tokens`` either way, so the flag does not matter.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.worker_agent.engines.vllm.versions import Version, parse_version

SUPPORTED: tuple[str, str] = ("0.5.1", "0.5.23")
"""(oldest, newest) SGLang release supported, both tested."""

CACHE_SALT_SINCE: Version = (0, 5, 18)
SAMPLING_SEED_SINCE: Version = (0, 5, 3)
ROUTED_DP_RANK_SINCE: Version = (0, 5, 10)
LORA_EVENTS_SINCE: Version = (0, 5, 22)


@dataclass(frozen=True, slots=True)
class Features:
    """What a release's ``/generate`` takes beyond the fields every supported one has."""

    cache_salt: bool = True
    sampling_seed: bool = True
    dp_rank_field: str = "routed_dp_rank"
    lora_events: bool = True
    """Its ``BlockStored`` names a LoRA adapter's blocks (``lora_name``)."""

    @classmethod
    def of(cls, version: Version | None) -> Features:
        """The newest's when ``version`` is unknown."""
        if version is None:
            return cls()
        return cls(cache_salt=version >= CACHE_SALT_SINCE,
                   sampling_seed=version >= SAMPLING_SEED_SINCE,
                   dp_rank_field="routed_dp_rank" if version >= ROUTED_DP_RANK_SINCE
                   else "data_parallel_rank",
                   lora_events=version >= LORA_EVENTS_SINCE)


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Data-parallel rank ``rank``'s KV-event endpoint, as SGLang's publisher derives it from
    the configured one (``offset_endpoint_port``): a ``tcp://`` port plus the rank, an
    ``inproc://`` name with ``_dp<rank>``; rank 0 unchanged. ValueError for another scheme
    (SGLang's publisher refuses it too)."""
    if not endpoint or rank <= 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint:
        if ":" not in endpoint:
            return endpoint
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    raise ValueError(f"{endpoint!r}: SGLang gives data-parallel ranks their own endpoints "
                     "only for tcp:// and inproc:// ones")


def is_supported(text: str) -> bool:
    version = parse_version(text)
    lo, hi = (parse_version(v) for v in SUPPORTED)
    return version is not None and lo is not None and hi is not None and lo <= version <= hi
