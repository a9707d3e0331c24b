"""Controller programs run by the agent beside its engine: ``program`` (parse, limits),
``grammars`` (llguidance compile, masks), ``vocab`` (token tables), ``branch`` (per-branch
state), ``runtime`` (execution)."""

from kvroute.worker_agent.controller.program import ProgramError, ProgramLimits
from kvroute.worker_agent.controller.runtime import ProgramRuntime

__all__ = ["ProgramError", "ProgramLimits", "ProgramRuntime"]
