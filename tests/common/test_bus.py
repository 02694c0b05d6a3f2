"""Bus set-up is idempotent, names are checked, and a full JetStream is named, not waited out as an outage."""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path

import pytest

from fleetrl.errors import InvalidArgument
from fleetrl.launcher.embedded import EmbeddedNats
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


async def test_a_full_jetstream_is_named_at_once_not_retried_as_an_outage(tmp_path: Path) -> None:
    """At max_file_store a publish is answered 503, as by a recovering server, but with err_code 10023:
    retry_outage raises JetStreamFull naming the call and the limit at once, instead of repeating the
    call for OUTAGE_RETRY_S; a server that recovers is retried as before (test_fleet_faults)."""
    with EmbeddedNats(data_dir=tmp_path / "nats", max_file_store_mb=2) as nats:
        nc = await bus.connect(nats.url, "test")
        js = bus.jetstream(nc)
        await bus.ensure_streams(js)
        started = time.monotonic()
        with pytest.raises(bus.JetStreamFull) as full:
            for i in range(100):
                publish = functools.partial(js.publish, bus.task_subject("j"), bytes(100_000),
                                            headers={"Nats-Msg-Id": f"j/0/{i}"})
                await bus.retry_outage(publish, what=f"task publish {i}")
        await nc.close()
    assert time.monotonic() - started < bus.OUTAGE_RETRY_S / 4
    assert "refused: JetStream is full: insufficient resources (err_code 10023" in str(full.value), full.value
