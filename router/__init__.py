"""The router service: index mirror, worker registry, load accounting, forwarding, metrics."""
