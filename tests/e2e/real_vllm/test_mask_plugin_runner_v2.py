"""kvroute's mask plugin under Model Runner V2's logits-processor interface, the GPU default
from vLLM 0.32, which cannot run on this machine: ``runner_v2_drive.py`` makes the V2
sampler's calls in vLLM's own environment, through vLLM's own loaders and with its
``LogitsContext``, over the runner's buffers held as CPU tensors (the one part not real)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute.demo.vllm_cpu import VllmCpu, mask_plugin_dir

DRIVER = Path(__file__).with_name("runner_v2_drive.py")


V2_MODULE = "vllm.v1.worker.gpu.sample.logits_processor"


def has_runner_v2(cpu: VllmCpu) -> bool:
    """Whether ``cpu``'s vLLM release has Model Runner V2's logits-processor interface."""
    probe = f"import importlib.util as u; print(u.find_spec({V2_MODULE!r}) is not None)"
    run = subprocess.run([str(cpu.python), "-c", probe], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "VLLM_NO_USAGE_STATS": "1"})
    return run.stdout.strip().endswith("True")


def test_the_mask_plugin_serves_model_runner_v2_as_it_serves_v1() -> None:
    cpu = VllmCpu()
    model = cpu.ensure()
    if not has_runner_v2(cpu):
        pytest.skip(f"vllm-cpu {cpu.version} has no Model Runner V2 ({V2_MODULE})")
    env = {**os.environ, "PYTHONPATH": str(mask_plugin_dir()), "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1"}
    run = subprocess.run([str(cpu.python), str(DRIVER), str(model)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    sys.stderr.write(f"runner V2 drive: {seen}\n")
    # One name loads under both runners, and V2's API-server check refuses bad arguments.
    assert "KvrouteMask" in seen["v1_loaded"] and seen["v2_loaded"] == ["KvrouteMask"]
    assert seen["refused"] == ["VLLMValidationError"] * 3
    # Only the request with a grammar is processed; the batch's other row is left alone.
    assert seen["needs_processing"] == [True, False]
    assert seen["other_row_untouched"]
    # Every step's mask is llguidance's from the prefix and the committed tokens, and greedy
    # decoding over random logits writes the grammar's language, then ends.
    assert seen["masks_exact"] and seen["ended"]
    text = seen["text"]
    assert text.startswith("[12,") and text.endswith("]")
    assert all(n.isdigit() and len(n) <= 3 for n in text[1:-1].split(","))
    # Speculative rows see the drafts before them; a refused draft's rows are left as they
    # are (the row before rejects it); a refused committed token ends the request.
    assert seen["draft_rows_exact"] and seen["refused_draft_rows_unmasked"]
    assert seen["refused_token_ends"]
    # A reused slot forgets its former request's grammar.
    assert seen["reused_slot_needs_processing"] is False and seen["reused_slot_unmasked"]
