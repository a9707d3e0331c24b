"""Replay simulator: real traces through the router's own policies on a simulated cluster."""
