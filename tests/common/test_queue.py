"""A job's task queue serves an actor's rounds on a real JetStream consumer (`fetch`, then `handle_round`,
as `take_round` calls them): none when the queue is empty (not an error), what is there up to the limit,
each delivery acked on its own, a malformed one dead-lettered without holding up the round."""

from __future__ import annotations

import asyncio
import time

from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.rollout.settings import ActorSettings
from fleetrl.spec.config import TrainConfig
from fleetrl.tasks import bus
from fleetrl.tasks.queue import Delivery, JobQueue, parse, parsed_count


async def test_rounds_take_what_is_there_and_ack_each_delivery(nats_url: str) -> None:
    job = "queue-rounds"
    nc = await bus.connect(nats_url, "test")
    js = bus.jetstream(nc)
    try:
        await bus.ensure_streams(js)
        await bus.ensure_task_consumer(js, job, ack_wait_s=30, max_deliver=3, max_ack_pending=16)
        sub = await js.pull_subscribe_bind(durable=bus.task_consumer(job), stream=bus.TASKS_STREAM)
        settings = ActorSettings(actor_id="a", fetch_timeout_s=0.3)
        queue = JobQueue(job, TrainConfig(), js, sub, settings)
        produced: list[str] = []

        async def produce(delivery: Delivery) -> str:
            produced.append(delivery.task.task_id)
            await asyncio.sleep(0.05)  # the round's deliveries are in hand together
            return "inserted"

        assert await queue.fetch(4) == []  # an empty queue: a fetch timeout, no error
        hasty = JobQueue(job, TrainConfig(), js, sub, ActorSettings(actor_id="a", fetch_timeout_s=0.001))
        for _ in range(20):
            # the event loop held up (an actor's generation holds the GIL) while a batch's fetch waits: nats-py
            # then raises the builtin TimeoutError, not its own subclass, and it must still read as "no task"
            asyncio.get_running_loop().call_soon(time.sleep, 0.01)
            assert await hasty.fetch(4) == []
        for i in range(3):
            task = common_pb2.Task(job_id=job, task_id=f"0/{i}", prompt=f"p{i}")
            await js.publish(bus.task_subject(job), task.SerializeToString(), headers={"Nats-Msg-Id": f"t{i}"})
        await js.publish(bus.task_subject(job), b"\xff not a task", headers={"Nats-Msg-Id": "bad"})
        msgs = await queue.fetch(8)
        assert len(msgs) == 4
        tasks = [parse(msg) for msg in msgs]
        assert parsed_count(tasks) == 3  # the malformed one is not in the round
        await queue.handle_round(msgs, tasks, time.time_ns(), produce)
        assert sorted(produced) == ["0/0", "0/1", "0/2"]
        info = await js.consumer_info(bus.TASKS_STREAM, bus.task_consumer(job))
        assert info.num_ack_pending == 0 and info.num_pending == 0
        dead = await js.pull_subscribe(bus.dlq_subject(job), stream=bus.DLQ_STREAM)
        (letter,) = await dead.fetch(1, timeout=5)
        assert "does not parse" in (letter.headers or {}).get("Fleet-Reason", "")
    finally:
        await nc.close()
