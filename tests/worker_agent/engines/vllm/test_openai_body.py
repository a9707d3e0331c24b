"""What the agent sends vLLM for a constraint: structured outputs, or for a grammar continued
from a state the mask plugin's arguments."""

from __future__ import annotations

from kvroute.worker_agent.engines.base import GrammarState
from kvroute.worker_agent.engines.vllm.openai import (
    PLUGIN_GRAMMAR,
    PLUGIN_PREFIX,
    CompletionsClient,
    structured_outputs,
)


def test_a_grammar_state_goes_as_the_mask_plugins_xargs() -> None:
    client = CompletionsClient("http://127.0.0.1:1", "m")
    state = GrammarState('start: "(" "a"+ ")"', (40, 64))
    body = client.body([1, 2, 40, 64], 8, state=state, report_reused=True)
    assert body["vllm_xargs"] == {"kv_cache_report_mode": "full",
                                  PLUGIN_GRAMMAR: state.grammar, PLUGIN_PREFIX: [40, 64]}
    assert "structured_outputs" not in body
    # A fresh constraint goes as vLLM's own structured outputs, with no plugin arguments.
    fresh = client.body([1], 8, structured=structured_outputs("regex", "a+"))
    assert fresh["structured_outputs"] == {"regex": "a+"} and "vllm_xargs" not in fresh
