"""A service's background loops: repeated every period, retried past a failed pass, stopped for good.

Every service runs a few (lease reclaim, heartbeats, the backlog gauge, retention). Two rules hold for
all of them, so they live here once:
- A cancel ends the loop, even when the client library it was inside turned the cancel into one of the
  errors the loop retries past (a Redis or NATS client cleaning up a connection may). The loop checks
  `Task.cancelling()` before it retries, so a swallowed cancel cannot keep it running forever.
- A service stops a loop with `stop`, which waits (bounded) for it to end, before it closes the clients
  the loop uses: a loop still inside a call when its client closes is what leaves it hanging.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 5.0


async def repeat(step: Callable[[], Awaitable[Any]], interval_s: float, *, what: str,
                 retried: tuple[type[BaseException], ...] = (Exception,), first_after: bool = False) -> None:
    """Run `step` every `interval_s` until cancelled (first after one period when `first_after`). A pass
    that raises one of `retried` is logged and the next period tries again; any other error ends the loop."""
    if first_after:
        await asyncio.sleep(interval_s)
    while True:
        try:
            await step()
        except retried as error:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise asyncio.CancelledError(f"{what} cancelled") from error
            log.warning("%s failed: %s", what, error)
        await asyncio.sleep(interval_s)


async def stop(task: asyncio.Task[Any], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Cancel `task` and wait up to `timeout_s` for it to end; an error it ended with is logged, not raised
    (the service is stopping either way)."""
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        log.warning("%s still running %.0f s after its cancel", task.get_name(), timeout_s)
    elif not task.cancelled() and task.exception() is not None:
        log.warning("%s ended with %r", task.get_name(), task.exception())
