"""Reward-service throughput: a trivial user reward file through gRPC vs. in one process.

`python -m bench.reward --json` prints one JSON object:
- items_per_s: a trivial reward file scored through a real RewardService, batches of 64, several
  concurrent callers (like several actors);
- inprocess_items_per_s: the same function called in a loop in this process (the unsafe baseline);
- hostile_mix_items_per_s: benign items per second while 10% of items hang until their timeout,
  with the pool's default burst workers; hostile_mix_no_burst_items_per_s: the same with
  burst_workers_per_pool=0 (each hanging item holds a worker until its timeout, nothing replaces it);
- items_per_s_by_workers: items_per_s for each worker count tried;
- benign_latency_isolation: the p50 latency of one job's benign batches while another job's callers
  send batches whose every item hangs until its timeout, divided by the same p50 with no hanging
  batches, in one service (goal <= 1.5: one job's slow reward code must not slow another's); the
  median over --isolation-repeats fresh services (isolation_ratios lists each), since on a shared
  2-core machine one pair of p50s moves with whatever else runs; benign_p50_ms_alone /
  benign_p50_ms_beside_hanging are the halves of the median run;
- hanging_replacements_per_s: workers the hanging job's pool replaced per second meanwhile (each
  start costs the machine CPU that the benign job then lacks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from fleetrl.proto.fleetrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from fleetrl.reward.client import spec_to_proto
from fleetrl.reward.metrics import RewardMetrics
from fleetrl.reward.settings import RewardSettings
from fleetrl.runtime.grpcutil import channel
from fleetrl.services.reward.server import running
from fleetrl.spec.config import RewardSpec

SOURCE = """
import time
def reward(completion, prompt, **meta):
    if meta.get("hang"):
        time.sleep(1e9)
    return float(completion.strip() == str(meta.get("answer")))
"""
BATCH = 64


def inprocess_rate(seconds: float) -> float:
    namespace: dict[str, Any] = {}
    exec(compile(SOURCE, "reward.py", "exec"), namespace)
    fn, n, start = namespace["reward"], 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(1000):
            fn("57", "What is 20 + 37?", answer="57")
        n += 1000
    return n / (time.perf_counter() - start)


def batch(hang_every: int = 0) -> list[reward_pb2.ScoreItem]:
    return [reward_pb2.ScoreItem(completion="57", prompt="What is 20 + 37?", metadata_json=json.dumps(
        {"answer": "57", "hang": bool(hang_every and i % hang_every == 0)})) for i in range(BATCH)]


async def service_rate(workers: int, seconds: float, callers: int, hang_every: int, timeout_s: float,
                       burst: int | None = None) -> float:
    """Benign (OK) items per second through a fresh service with `workers` workers (and `burst`)."""
    settings = RewardSettings(listen="127.0.0.1:0", workers_per_pool=workers, grace_s=0.5)
    if burst is not None:
        settings = settings.model_copy(update={"burst_workers_per_pool": burst})
    spec = spec_to_proto(RewardSpec(file="reward.py", timeout_per_item_s=timeout_s), SOURCE.encode())
    async with running(settings) as service, channel(f"127.0.0.1:{service.port}") as chan:
        stub = reward_pb2_grpc.RewardServiceStub(chan)
        await stub.Validate(reward_pb2.ValidateRequest(spec=spec), timeout=60)
        request = reward_pb2.ScoreRequest(job_id="bench", spec=spec, items=batch(hang_every))
        await stub.Score(request, timeout=120)  # all workers up
        ok, start = 0, time.perf_counter()

        async def caller() -> None:
            nonlocal ok
            while time.perf_counter() - start < seconds:
                reply = await stub.Score(request, timeout=120)
                ok += sum(r.status == common_pb2.REWARD_STATUS_OK for r in reply.results)

        await asyncio.gather(*(caller() for _ in range(callers)))
        return ok / (time.perf_counter() - start)


async def benign_p50_ms(stub: reward_pb2_grpc.RewardServiceStub, request: reward_pb2.ScoreRequest,
                        seconds: float) -> float:
    """p50 wall time of one caller's back-to-back Score calls, in ms."""
    latencies: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(latencies) < 5:
        began = time.perf_counter()
        await stub.Score(request, timeout=120)
        latencies.append(time.perf_counter() - began)
    return 1000 * statistics.median(latencies)


async def isolation(workers: int, seconds: float, hang_timeout_s: float, hostile_callers: int) -> dict[str, float]:
    """Benign p50 alone, then beside another job whose callers keep every one of their items hanging,
    and how many workers the hanging job's pool replaced per second meanwhile."""
    settings = RewardSettings(listen="127.0.0.1:0", workers_per_pool=workers, grace_s=0.5)
    benign = spec_to_proto(RewardSpec(file="reward.py", timeout_per_item_s=5.0), SOURCE.encode())
    hanging = spec_to_proto(RewardSpec(file="reward.py", timeout_per_item_s=hang_timeout_s),
                            (SOURCE + "\n# another job's file\n").encode())
    async with running(settings) as service, channel(f"127.0.0.1:{service.port}") as chan:
        stub = reward_pb2_grpc.RewardServiceStub(chan)
        benign_request = reward_pb2.ScoreRequest(job_id="benign", spec=benign, items=batch())
        hanging_request = reward_pb2.ScoreRequest(job_id="hanging", spec=hanging, items=batch(hang_every=1)[:8])
        await stub.Score(benign_request, timeout=120)  # the benign pool's first worker up
        await benign_p50_ms(stub, benign_request, 1.0)  # warm-up: the pool's other workers start meanwhile
        alone = await benign_p50_ms(stub, benign_request, seconds)
        stop = asyncio.Event()

        async def hang_forever() -> None:
            while not stop.is_set():
                await stub.Score(hanging_request, timeout=120)

        hostile = [asyncio.create_task(hang_forever()) for _ in range(hostile_callers)]
        await asyncio.sleep(min(1.0, hang_timeout_s / 2))  # the hanging pool busy before measuring
        replaced, began = _replacements(service.scorer.metrics), time.perf_counter()
        beside = await benign_p50_ms(stub, benign_request, max(seconds, 2 * hang_timeout_s))
        replacements_per_s = (_replacements(service.scorer.metrics) - replaced) / (time.perf_counter() - began)
        stop.set()
        for task in hostile:
            task.cancel()
        await asyncio.gather(*hostile, return_exceptions=True)
    return {"benign_latency_isolation": round(beside / alone, 2), "benign_p50_ms_alone": round(alone, 1),
            "benign_p50_ms_beside_hanging": round(beside, 1),
            "hanging_replacements_per_s": round(replacements_per_s, 2)}


def _replacements(metrics: RewardMetrics) -> float:
    return sum(sample.value for metric in metrics.worker_restarts.collect() for sample in metric.samples
               if sample.name.endswith("_total"))


async def repeated_isolation(args: argparse.Namespace) -> dict[str, Any]:
    """`isolation` in --isolation-repeats fresh services: the median run, and every run's ratio."""
    runs = [await isolation(max(args.workers), args.seconds, args.hang_timeout_s, args.callers)
            for _ in range(args.isolation_repeats)]
    runs.sort(key=lambda run: run["benign_latency_isolation"])
    return {**runs[len(runs) // 2], "isolation_ratios": [run["benign_latency_isolation"] for run in runs]}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    by_workers = {w: await service_rate(w, args.seconds, args.callers, 0, 5.0) for w in args.workers}
    hostile_s = max(args.seconds, 4 * args.hang_timeout_s)
    hostile = await service_rate(max(args.workers), hostile_s, args.callers, 10, args.hang_timeout_s)
    no_burst = await service_rate(max(args.workers), hostile_s, args.callers, 10, args.hang_timeout_s, burst=0)
    return {
        "items_per_s": round(by_workers[max(args.workers)], 1),
        "inprocess_items_per_s": round(inprocess_rate(args.seconds), 1),
        "hostile_mix_items_per_s": round(hostile, 1),
        "hostile_mix_no_burst_items_per_s": round(no_burst, 1),
        "items_per_s_by_workers": {str(w): round(r, 1) for w, r in by_workers.items()},
        **await repeated_isolation(args),
        "batch": BATCH, "callers": args.callers, "hang_timeout_s": args.hang_timeout_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per figure")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="worker counts to try")
    parser.add_argument("--callers", type=int, default=4, help="concurrent Score callers")
    parser.add_argument("--hang-timeout-s", type=float, default=2.0, help="timeout of the hanging items")
    parser.add_argument("--isolation-repeats", type=int, default=3,
                        help="fresh services benign_latency_isolation is measured in (the median is reported)")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
