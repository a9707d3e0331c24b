"""Engine adapters the agent drives: sim (no model), tiny (numpy transformer), vllm."""
