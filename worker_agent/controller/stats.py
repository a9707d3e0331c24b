"""Per-agent counters of program execution that the agent's metrics read.

The runtime only increments them; nothing in it reads them back."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ProgramStats:
    """Counters the agent's metrics read (the runtime does not know them)."""

    overflow_sent: int = 0
    """Fork children sent to another worker's agent (the router's placement)."""
    overflow_fallback: int = 0
    """Of those, children run here instead because their worker failed before answering."""
    overflow_kept: int = 0
    """Children a placement would move but that stayed: an open constraint cannot travel."""
    forks_led: int = 0
    """Forks of 2+ local children whose first child prefilled the parent's prefix while the
    others waited for it (``fork_lead.lead``)."""
    forks_cached: int = 0
    """Forks of 2+ local children that found the prefix cached: all started at once."""
    forks_warmed: int = 0
    """Of the led forks, those whose leader ended before any prefill: a warm-up request ran."""
