"""The services' background loops: a failed pass is retried, a cancel always ends the loop."""

from __future__ import annotations

import asyncio

import pytest

from fleetrl.runtime import background


async def test_a_cancel_that_a_client_turns_into_a_retried_error_still_ends_the_loop() -> None:
    """A client library cleaning up a connection may raise its own error in place of the cancel (the replay
    service's lease reclaim hung a test's teardown for 300 s that way): the loop must end all the same."""
    inside = asyncio.Event()
    passes = 0

    async def step() -> None:
        nonlocal passes
        passes += 1
        inside.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise ConnectionError("connection closed by a cancelled call") from None

    task = asyncio.create_task(background.repeat(step, 0.01, what="probe", retried=(ConnectionError,)))
    await inside.wait()
    await background.stop(task, timeout_s=2)
    assert task.done() and task.cancelled()
    assert passes == 1


async def test_failed_passes_are_retried_and_other_errors_end_the_loop() -> None:
    outcomes: list[BaseException | None] = [ConnectionError("away"), ConnectionError("away"), None,
                                            KeyError("a bug")]
    passes = 0

    async def step() -> None:
        nonlocal passes
        passes += 1
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    with pytest.raises(KeyError, match="a bug"):
        await asyncio.wait_for(background.repeat(step, 0.01, what="probe", retried=(ConnectionError,)), 5)
    assert passes == 4


async def test_stop_is_bounded_when_a_task_ignores_its_cancel(caplog: pytest.LogCaptureFixture) -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    await background.stop(task, timeout_s=0.2)
    assert not task.done() and "stubborn still running" in caplog.text
    release.set()
    task.cancel()
    await asyncio.wait({task}, timeout=2)
    assert task.done()
