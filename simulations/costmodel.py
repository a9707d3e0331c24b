"""The engine cost model the replay simulator times its workers with. It lives in
:mod:`kvroute.core.policies.cost_model` (its constants and where they come from), beside the
policy that derives its defaults from it: one source for the router and the simulator."""

from kvroute.core.policies.cost_model import A100_80GB_LLAMA8B_KV_TOKENS, CostModel

__all__ = ["A100_80GB_LLAMA8B_KV_TOKENS", "CostModel"]
