"""docs/engines.md's vLLM commands are the ones this suite runs: the same flags on the vLLM
server and the agent (ports, paths and names aside), the same event endpoints, one block size."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from kvroute.demo.vllm_cpu import VllmCpu, VllmServer
from tests.support import ROOT
from tests.test_docs_examples import blocks

TEST_ONLY = {"--structured-outputs-config"}  # for random weights; the docs say why


def flags(argv: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[a] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def documented() -> tuple[list[str], list[str]]:
    text = (ROOT / "docs/engines.md").read_text()
    section = text[text.index("## The vLLM engine"):]
    lines = [shlex.split(c) for c in blocks(section)[0]]
    server = next(a for a in lines if "vllm.entrypoints.openai.api_server" in a)
    agent = next(a for a in lines if a[:2] == ["kvroute", "agent"])
    return server, agent


def test_the_documented_vllm_and_agent_commands_are_the_suites() -> None:
    server, agent = documented()
    ours = VllmServer(VllmCpu(root=Path("/cache")), 8000, 5557, 5558, Path("/tmp/log"))
    theirs, mine = flags(server), flags(ours.argv())
    assert set(theirs) == set(mine) - TEST_ONLY
    events = json.loads(theirs["--kv-events-config"] or "")
    assert events == json.loads(mine["--kv-events-config"] or "")
    assert theirs["--block-size"] == mine["--block-size"]
    doc_agent, our_agent = flags(agent), flags(ours.agent_args())
    assert set(our_agent) <= set(doc_agent)
    for flag in ("--engine", "--block-size", "--vllm-url", "--vllm-events", "--vllm-replay"):
        assert doc_agent[flag] == our_agent[flag], flag
    # The agent follows the server the docs started: its model, its events.
    assert doc_agent["--vllm-model"] == theirs["--served-model-name"]
    assert doc_agent["--model-source"] == theirs["--model"]
