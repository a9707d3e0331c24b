"""What the agent checks of its vLLM server in the background, and how often: the chat
rendering (:mod:`.render_check`) and kvroute's mask plugin (:mod:`.plugin_check`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

RETRY_S = 10.0
"""How soon a check that got no answer (vLLM not up yet, an error) is tried again."""


class CheckError(Exception):
    """vLLM's answer to a check could not be had or read (unreachable, an error status, a
    malformed body): the check is tried again sooner."""


async def every(check: Callable[[], Awaitable[object]], interval_s: float, name: str,
                log: logging.Logger, on_error: Callable[[], None] = lambda: None,
                wake: asyncio.Event | None = None) -> None:
    """Run ``check`` at start and every ``interval_s``, within :data:`RETRY_S` again after
    a :class:`CheckError`, and at once when ``wake`` is set; any other exception is logged
    with its traceback (and counted by ``on_error``), and the checks go on."""
    while True:
        if wake is not None:
            wake.clear()
        try:
            await check()
            wait = interval_s
        except CheckError as exc:
            log.warning("%s: no answer from vLLM yet; retrying", name,
                        extra={"kv": {"error": str(exc), "retry_s": RETRY_S}})
            wait = min(RETRY_S, interval_s)
        except Exception:
            on_error()
            log.exception("%s failed", name)
            wait = interval_s
        if wake is None:
            await asyncio.sleep(wait)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), wait)
