"""Controller programs run by the agent beside its engine: ``program`` (parse, limits),
``runtime`` (the agent's entry point: prepare, run), ``interpreter`` (executing the steps),
``fork_lead`` (a fork's children sharing the prefix prefill), ``overflow`` (fork children on
other workers), ``constrained`` (masks and per-request grammars), ``grammars`` (llguidance
compile, masks), ``continuation`` and ``json_regex`` (a constraint's rest as a regex),
``vocab`` (token tables), ``branch`` (per-branch state), ``logprobs``, ``stats``."""

from kvroute.worker_agent.controller.program import ProgramError, ProgramLimits
from kvroute.worker_agent.controller.runtime import ProgramRuntime

__all__ = ["ProgramError", "ProgramLimits", "ProgramRuntime"]
