"""What tracing costs an actor per trajectory: tracing off (the default) against on (JSONL exporter).

`bench.pipeline` compares whole pipelines traced and untraced; this bench isolates the actor's own
tracing calls, so it also shows what they cost with tracing off (OpenTelemetry's no-op), which no
on/off comparison of a pipeline can.

`python -m bench.tracing --json [--trajectories 2000 --rounds 5]` measures, in one process, first
with tracing off (no tracer provider: OpenTelemetry's no-op) and then on (`telemetry.setup_tracing`
with the JSONL file exporter behind a batch processor, in a temp run directory):

- `spans`: exactly the tracing calls the actor makes for one trajectory: extract the task's
  `traceparent`, open 6 spans (`actor.task`, `actor.fetch` and the four stage spans), inject gRPC
  metadata for the reward and replay calls, read the trace and span ids for the lineage;
- `task_loop`: the actor's real `service.take_round`, one task a round (a `JobQueue` delivery, the `Rollout`'s weights,
  generate, score, insert, then the ack) on in-memory
  stand-ins that answer at once (a message with headers, a policy that holds weights, `FixedBackend`
  with no latency on tiny-llama's tokenizer, reward and replay fakes), i.e. the loop's own bookkeeping
  without any real work, so tracing's share of it is as large as it can ever be.

Each figure is the best of `rounds` rounds of `trajectories` trajectories, in microseconds per
trajectory. `figure` is tracing on, `baseline` tracing off, `ratio` = on / off of the task loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opentelemetry import context as otel_context

from fleetrl.policy import models
from fleetrl.policy.backends import FixedBackend
from fleetrl.proto.fleetrl.v1 import common_pb2, replay_pb2, reward_pb2
from fleetrl.reward.client import spec_to_proto
from fleetrl.rollout.metrics import Activity
from fleetrl.rollout.rollout import JobContext, Rollout
from fleetrl.rollout.settings import ActorSettings
from fleetrl.runtime import telemetry
from fleetrl.services.actor.service import ServedJob, take_round
from fleetrl.spec.config import JobSpec
from fleetrl.tasks.queue import JobQueue

SPEC = JobSpec.model_validate({
    "model": "tiny-llama", "prompts": "p.jsonl", "reward": {"builtin": "numeric_match"},
    "rollout": {"samples_per_prompt": 4, "max_new_tokens": 8},
})
STAGES = ("actor.ensure_weights", "actor.generate", "actor.score", "actor.insert")


def actor_spans(headers: dict[str, str], tracer: Any) -> None:
    """The tracing calls of one trajectory on the actor, in the order the actor makes them."""
    with tracer.start_as_current_span("actor.task", context=telemetry.extract(headers)):
        tracer.start_span("actor.fetch").end()
        for name in STAGES:
            with tracer.start_as_current_span(name):
                if name in ("actor.score", "actor.insert"):
                    telemetry.grpc_metadata()
        telemetry.current_trace_id()
        telemetry.current_span_id()


class Meta:
    num_delivered = 1


class Msg:
    """A delivered task that acks at once."""

    def __init__(self, data: bytes, headers: dict[str, str]) -> None:
        self.data, self.headers, self.metadata = data, headers, Meta()

    async def ack_sync(self, timeout: float) -> None: ...

    async def nak(self, delay: float | None = None) -> None: ...

    async def in_progress(self) -> None: ...


class Sub:
    def __init__(self, msgs: list[Msg]) -> None:
        self.msgs = msgs

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        return [self.msgs.pop()]


class Policy:
    job_id = "bench"
    version = 1

    def __init__(self, backend: FixedBackend) -> None:
        self.backend = backend

    async def refresh(self) -> bool:
        return True

    async def ensure(self, min_version: int, wait_s: float) -> bool:
        return True


class Replay:
    async def insert(self, groups: Any) -> list[int]:
        return [replay_pb2.INSERT_OUTCOME_INSERTED] * len(groups)


class Reward:
    async def score(self, job_id: str, spec: Any, items: Any) -> list[Any]:
        return [reward_pb2.ScoreResult(reward=1.0, status=common_pb2.REWARD_STATUS_OK) for _ in items]


def feeder_headers(tracer: Any) -> dict[str, str]:
    """Task headers as the feeder writes them (a traceparent only when tracing is on)."""
    with tracer.start_as_current_span("feeder.publish", context=otel_context.Context()):
        return telemetry.inject_headers({"Nats-Msg-Id": "bench/0/0"})


def best_us(run: Callable[[int], float], n: int, rounds: int) -> float:
    return min(run(n) for _ in range(rounds)) / n * 1e6


def time_spans(n: int) -> float:
    tracer = telemetry.tracer("bench")
    headers = feeder_headers(tracer)
    started = time.perf_counter()
    for _ in range(n):
        actor_spans(headers, tracer)
    return time.perf_counter() - started


def time_task_loop(backend: FixedBackend) -> Callable[[int], float]:
    def run(n: int) -> float:
        tracer = telemetry.tracer("bench")
        task = common_pb2.Task(job_id="bench", task_id="0/0", prompt="What is 2 + 3?", metadata_json='{"answer": "5"}')
        msgs = [Msg(task.SerializeToString(), feeder_headers(tracer)) for _ in range(n)]
        settings, activity = ActorSettings(actor_id="bench"), Activity()
        rollout = Rollout(settings, Replay(), Reward(), activity)
        queue = JobQueue("bench", SPEC.train, None, Sub(msgs), settings)  # type: ignore[arg-type]
        job = ServedJob(JobContext("bench", SPEC, spec_to_proto(SPEC.reward), Policy(backend)), queue)  # type: ignore[arg-type]

        async def go() -> float:
            started = time.perf_counter()
            for _ in range(n):
                await take_round(job, rollout, 0)  # round_tokens 0: one task a round
            return time.perf_counter() - started

        return asyncio.run(go())

    return run


def run(trajectories: int, rounds: int) -> dict[str, Any]:
    _, tokenizer = models.load("tiny-llama")
    backend = FixedBackend(tokenizer, 0.0)
    loop = time_task_loop(backend)
    off = {"spans": best_us(time_spans, trajectories * 10, rounds), "loop": best_us(loop, trajectories, rounds)}
    with tempfile.TemporaryDirectory() as run_dir:
        telemetry.setup_tracing("bench", Path(run_dir), enabled=True)
        on = {"spans": best_us(time_spans, trajectories, rounds), "loop": best_us(loop, trajectories, rounds)}
        telemetry.shutdown_tracing()
        spans_written = sum(len(p.read_text().splitlines()) for p in Path(run_dir, "traces").glob("*.jsonl"))
    return {
        "figure": round(on["loop"], 1), "baseline": round(off["loop"], 1), "ratio": round(on["loop"] / off["loop"], 3),
        "unit": "us per trajectory (actor take_round of one task, no-op backend/reward/replay)",
        "tracing_off_spans_us": round(off["spans"], 2), "tracing_on_spans_us": round(on["spans"], 2),
        "tracing_on_cost_us": round(on["loop"] - off["loop"], 1),
        "trajectories": trajectories, "rounds": rounds, "spans_written": spans_written,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=2000, help="trajectories per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the best is reported")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    args = parser.parse_args(argv)
    result = run(args.trajectories, args.rounds)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
