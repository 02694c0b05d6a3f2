"""The end-to-end ledger's own cost on a 100k-task job, against the publish path it rides on.

`python -m bench.ledger --json [--tasks 100000 --batch 32 --steps-of 8]` starts an embedded nats-server
and Valkey in a temp dir. Baseline: the feeder's task publishes alone (one awaited JetStream publish
per task with its `Nats-Msg-Id`, in top-ups of `batch`). Figure: every ledger write of the same job,
timed apart from it: the feeder's record of each top-up (`Ledger.published`, one SADD of `batch` ids),
replay's two fate writes per task (arrival, then consumption; here HSETs in `batch` pipelines of their
own, an upper bound: in replay they are two more commands inside the insert and commit scripts it runs
anyway, no extra round trip) and the learner's record of each step of `steps_of` tasks
(`Ledger.trained`). `ratio` = ledger seconds / publish seconds. Also the Redis memory the job's ledger
holds (`MEMORY USAGE` of its keys, `bytes_per_task`) and the wall time of one accounting
(`Ledger.account`) of the whole job, with `batch` tasks still in the task stream (a real job keeps no
more in flight than its bound).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from fleetrl.launcher.embedded import EmbeddedNats, EmbeddedValkey
from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.tasks import bus, ledger
from fleetrl.tasks.ledger import Ledger

JOB, BASELINE_JOB = "bench-ledger", "bench-publish"


async def publish(js: Any, job: str, indices: range) -> None:
    for i in indices:
        task = common_pb2.Task(job_id=job, task_id=f"0/{i}", epoch=0, prompt_index=i,
                               prompt=f"What is {i} + {i + 3}?", metadata_json='{"answer": "7"}')
        await js.publish(bus.task_subject(job), task.SerializeToString(),
                         headers={"Nats-Msg-Id": bus.task_msg_id(job, 0, i)})


async def publish_all(js: Any, n: int, batch: int) -> float:
    started = time.perf_counter()
    for start in range(0, n, batch):
        await publish(js, BASELINE_JOB, range(start, min(n, start + batch)))
    return time.perf_counter() - started


async def ledger_writes(book: Ledger, redis: aioredis.Redis, n: int, batch: int, steps_of: int) -> dict[str, float]:
    """Seconds spent by each writer: the feeder's, replay's fate writes, the learner's."""
    ids = [f"0/{i}" for i in range(n)]
    fate = ledger.key(JOB, "fate")
    started = time.perf_counter()
    for start in range(0, n, batch):
        await book.published(JOB, ids[start:start + batch], lease_epoch=0)
    feeder_s, started = time.perf_counter() - started, time.perf_counter()
    for code in (ledger.STORED, ledger.CONSUMED):  # the last batch stays in flight
        for start in range(0, n - batch, batch):
            async with redis.pipeline(transaction=False) as pipe:
                for task_id in ids[start:start + batch]:
                    pipe.hset(fate, task_id, code)
                await pipe.execute()
    replay_s, started = time.perf_counter() - started, time.perf_counter()
    for step, start in enumerate(range(0, n - batch, steps_of), start=1):
        await book.trained(JOB, step, ids[start:start + steps_of], lease_epoch=0)
    learner_s = time.perf_counter() - started
    return {"feeder_s": feeder_s, "replay_fate_s": replay_s, "learner_s": learner_s}


async def run(n: int, batch: int, steps_of: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(data_dir=Path(tmp) / "nats") as nats_server, \
            EmbeddedValkey(data_dir=Path(tmp) / "valkey") as valkey:
        nc = await bus.connect(nats_server.url, "bench")
        js = bus.jetstream(nc)
        await bus.ensure_streams(js)
        redis = aioredis.Redis.from_url(valkey.url)
        publish_s = await publish_all(js, n, batch)
        await js.purge_stream(bus.TASKS_STREAM, subject=bus.task_subject(BASELINE_JOB))
        await publish(js, JOB, range(n - batch, n))  # the tasks still in flight at the end
        book = Ledger(redis)
        parts = await ledger_writes(book, redis, n, batch, steps_of)
        ledger_s = sum(parts.values())
        memory = sum([int(await redis.memory_usage(ledger.key(JOB, name)) or 0) for name in ("pub", "fate", "steps")])
        started = time.perf_counter()
        accounting = await book.account(js, JOB)
        account_s = time.perf_counter() - started
        await redis.aclose()
        await nc.close()
    counts = accounting.counts
    assert counts["trained"] == n - batch and counts["in_flight"] == batch and counts["lost"] == 0, counts
    return {
        "tasks": n, "batch": batch, "steps_of": steps_of,
        "figure": "ledger_s", "baseline": "publish_s",
        "ledger_s": round(ledger_s, 3), "publish_s": round(publish_s, 3), "ratio": round(ledger_s / publish_s, 4),
        "ledger_us_per_task": round(ledger_s / n * 1e6, 2), "publish_us_per_task": round(publish_s / n * 1e6, 2),
        **{k: round(v, 3) for k, v in parts.items()}, "ledger_bytes": memory, "bytes_per_task": round(memory / n, 1),
        "account_s": round(account_s, 3), "counts": accounting.counts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=32, help="tasks per feeder top-up (and left in flight)")
    parser.add_argument("--steps-of", type=int, default=8, help="tasks trained per step")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(run(args.tasks, args.batch, args.steps_of))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
