"""Bus set-up is idempotent and names are checked."""

from __future__ import annotations

import asyncio

import pytest

from fleetrl.errors import InvalidArgument
from fleetrl.tasks import bus


def test_setup_twice_is_a_no_op(nats_url: str) -> None:
    async def run() -> None:
        nc = await bus.connect(nats_url, "test")
        js = bus.jetstream(nc)
        for _ in range(2):
            await bus.ensure_streams(js)
            info = await bus.ensure_task_consumer(js, "j1", ack_wait_s=5, max_deliver=4, max_ack_pending=8)
            await bus.ensure_weights_kv(js)
            await bus.ensure_object_store(js, "j1")
        assert info.config.max_deliver == 4
        streams = {s.config.name for s in await js.streams_info()}
        assert {bus.TASKS_STREAM, bus.DLQ_STREAM, bus.EVENTS_STREAM} <= streams
        consumers = await js.consumers_info(bus.TASKS_STREAM)
        assert [c.name for c in consumers] == [bus.task_consumer("j1")]
        await nc.close()

    asyncio.run(run())


@pytest.mark.parametrize("job_id", ["", "a.b", "a b", "x" * 65, "a*"])
def test_bad_job_ids_are_refused(job_id: str) -> None:
    with pytest.raises(InvalidArgument, match="job_id"):
        bus.task_subject(job_id)
