"""The worker agent: the sidecar beside each inference engine."""
