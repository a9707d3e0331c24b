"""Engine adapters the agent drives: sim (more to come: tiny, vllm)."""
