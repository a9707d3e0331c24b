"""kvroute: a cluster-level cache-affinity router and scheduler for LLM inference."""

__version__ = "0.1.0"
