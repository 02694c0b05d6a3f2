"""Round-trip overhead of the Tinker API per primitive: the official SDK over HTTP against the same call in-process.

`python -m bench.tinker --json [--model tiny-llama] [--calls 10] [--threads 1]` starts a Tinker API server
(`services/tinker`) in a thread of this process on a free port, and times `--calls` calls of each
primitive through the SDK (submission plus result, as a user's `.result()` sees them) and the same
work through `TinkerService` directly (queued and waited on, no HTTP). It prints one JSON object with
the median milliseconds of each side and their difference, the overhead of the wire. The in-process
side is measured first, then the SDK side, on one training run each, with the same batch.

With `--fleet-actors N` it also starts an embedded nats-server and Valkey, N actor processes serving the
model's Tinker samples (`tinker_models`) and a second server with `sampling = "fleet"`, and reports, in the
same run: `sample` through the SDK on the fleet against the local server's (`fleet_sample_ms`), and the wall
time of `--burst` sample requests sent at once (4 sequences of 64 tokens each) on each (`burst_s`).

With `--packing` it also times one forward_backward of the example loop's batch shape on `TrainingRun` (on
`--loop-model`, `--threads` torch threads): its datums packed, each group's shared prompt computed once, against
the padded layout (`padded_over_packed`).

With `--loop-steps N` (N >= 3) it also runs, in the same run and one after the other, the user-written loop
`examples/tinker_rl_loop/rl_loop.py` (the demo's addition task through the official SDK, against a Tinker
server in this process with `--loop-threads` torch threads, samples local) and the demo job
(`examples/addition/job.toml`) with the same N steps on a local fleet (`fleetrl up`'s launcher, one actor),
both on `--loop-model`, and reports each side's optimizer steps per second from its first step to its last
(start-up, model loads and the first step's warm-up left out) and their ratio, `loop_over_job` (issue 29's
goal: at least 0.8). With `--loop-fleet` also the loop with `OFF_POLICY=1` (the next step's samples asked for
before this step trains) against a local fleet of one actor whose Tinker API samples on the actor and trains
on the learner (`fleet_loop_over_job`), between the two.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tinker
import torch
from tinker import types

from fleetrl.launcher.embedded import EmbeddedNats, EmbeddedValkey
from fleetrl.runtime.tokens import hash_token
from fleetrl.services.tinker.config import TinkerSettings
from fleetrl.services.tinker.server import limits_of, serve
from fleetrl.tinker import types as domain
from fleetrl.tinker.requests import RequestLog
from fleetrl.tinker.service import TinkerService

KEY = "tml-bench"
TOKENS = list(range(1000, 1032))


def median_ms(call: Callable[[], Any], calls: int) -> float:
    call()  # warm-up: first use loads models and fills caches
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def in_process(settings: TinkerSettings, calls: int) -> dict[str, float]:
    service = TinkerService(limits_of(settings), RequestLog(concurrent.futures.ThreadPoolExecutor(1)))
    session = service.create_session("bench")
    created = service.create_model("bench", session, 0, settings.allowed_models[0], domain.LoraRequest(rank=8, seed=0))
    created.future.result()
    model_id = created.extra["model_id"]
    data = [domain.Datum(TOKENS[:-1], {"target_tokens": np.array(TOKENS[1:])})]
    seq = iter(range(1, 1_000_000))
    sampler = service.create_sampling_session("bench", session, settings.allowed_models[0], None)
    sample = domain.SampleParams(TOKENS[:8], 1, 8, 1.0, 1.0, 0, None, False)
    return {
        "forward": median_ms(lambda: service.forward_backward("bench", model_id, next(seq), data, "cross_entropy", {},
                                                              True).future.result(), calls),
        "forward_backward": median_ms(lambda: service.forward_backward(
            "bench", model_id, next(seq), data, "cross_entropy", {}, False).future.result(), calls),
        "optim_step": median_ms(lambda: service.optim_step("bench", model_id, next(seq),
                                                           domain.AdamParams()).future.result(), calls),
        "sample": median_ms(lambda: service.sample("bench", sampler.id, next(seq), sample).future.result(), calls),
    }


def over_http(url: str, model: str, calls: int, primitives: tuple[str, ...] = ("forward", "forward_backward",
                                                                               "optim_step", "sample")
              ) -> dict[str, float]:
    training = tinker.ServiceClient(base_url=url, api_key=KEY).create_lora_training_client(
        base_model=model, rank=8, seed=0).result()
    data = [types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:]})]
    sampler = tinker.ServiceClient(base_url=url, api_key=KEY).create_sampling_client(base_model=model).result()
    params = types.SamplingParams(max_tokens=8, seed=0)
    prompt = types.ModelInput.from_ints(TOKENS[:8])
    timed: dict[str, Callable[[], Any]] = {
        "forward": lambda: training.forward(data, "cross_entropy").result(),
        "forward_backward": lambda: training.forward_backward(data, "cross_entropy").result(),
        "optim_step": lambda: training.optim_step(types.AdamParams()).result(),
        "sample": lambda: sampler.sample(prompt, 1, params).result(),
    }
    return {name: median_ms(timed[name], calls) for name in primitives}


def start_server(settings: TinkerSettings, stop: threading.Event | None = None) -> str:
    """A Tinker API server in a thread of this process, its URL; it serves until `stop` is set (None: for good)."""
    started, box = threading.Event(), {}

    def on_start(port: int) -> None:
        box["url"] = f"http://127.0.0.1:{port}"
        started.set()

    async def main() -> None:
        stopping = asyncio.Event()
        if stop is not None:
            loop = asyncio.get_running_loop()
            threading.Thread(target=lambda: (stop.wait(), loop.call_soon_threadsafe(stopping.set)), daemon=True).start()
        await serve(settings, stopping, on_start)

    threading.Thread(target=asyncio.run, args=(main(),), daemon=True).start()
    if not started.wait(60):
        raise RuntimeError("the tinker server did not start")
    return str(box["url"])


def start_actor(nats_url: str, redis_url: str, model: str, name: str, threads: int,
                log: Path) -> subprocess.Popen[bytes]:
    """An actor process serving the model's Tinker samples, once it says so in its log."""
    argv = [sys.executable, "-m", "fleetrl.services.actor", "--actor-id", name, "--nats-url", nats_url,
            "--redis-url", redis_url, "--replay-addr", "127.0.0.1:1", "--reward-addr", "127.0.0.1:1",
            "--set", f"torch_threads={threads}", "--set", f'tinker_models=["{model}"]']
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    deadline = time.monotonic() + 120
    while "serving tinker samples of" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"actor {name} did not start: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)
    return proc


def burst_s(url: str, model: str, requests: int) -> float:
    """Wall time of `requests` sample requests sent at once (4 sequences of 64 tokens each)."""
    sampler = tinker.ServiceClient(base_url=url, api_key=KEY).create_sampling_client(base_model=model).result()
    prompt = types.ModelInput.from_ints(TOKENS[:8])
    sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, seed=0)).result()  # warm-up
    start = time.perf_counter()
    futures = [sampler.sample(prompt, 4, types.SamplingParams(max_tokens=64, seed=i, stop=[])) for i in range(requests)]
    for future in futures:
        future.result()
    return time.perf_counter() - start


def on_the_fleet(settings: TinkerSettings, local_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """`sample` on `--fleet-actors` actors against the local server's, in the same run."""
    with EmbeddedNats(data_dir=settings.run_dir / "nats") as nats, \
            EmbeddedValkey(data_dir=settings.run_dir / "valkey") as valkey:
        actors = [start_actor(nats.url, valkey.url, args.model, f"bench-{i}", args.threads,
                              settings.run_dir / f"actor-{i}.log") for i in range(args.fleet_actors)]
        done = threading.Event()  # the fleet server stops before its NATS does
        try:
            fleet_url = start_server(settings.model_copy(update={"sampling": "fleet", "nats_url": nats.url}), done)
            sample = {"local": over_http(local_url, args.model, args.calls, ("sample",))["sample"],
                      "fleet": over_http(fleet_url, args.model, args.calls, ("sample",))["sample"]}
            burst = {"local": burst_s(local_url, args.model, args.burst),
                     "fleet": burst_s(fleet_url, args.model, args.burst)}
        finally:
            done.set()
            for actor in actors:
                actor.kill()
                actor.wait(10)
    return {"actors": args.fleet_actors, "fleet_sample_ms": sample, "fleet_overhead_ms": sample["fleet"] -
            sample["local"], "burst_requests": args.burst, "burst_s": burst}


ROOT = Path(__file__).resolve().parents[1]
LOOP = ROOT / "examples" / "tinker_rl_loop" / "rl_loop.py"
DEMO_JOB = ROOT / "examples" / "addition" / "job.toml"


def steps_per_s(times: list[float]) -> float:
    """Steps a second between the first step's end and the last's (the first is the warm-up)."""
    if len(times) < 3:
        raise RuntimeError(f"{len(times)} steps: at least 3 are needed to time the steps after the first")
    return (len(times) - 1) / (times[-1] - times[0])


def loop_steps(settings: TinkerSettings, model: str, steps: int, log: Path) -> list[float]:
    """When each step of the example loop ended, against a local Tinker server (its own `steps`)."""
    url = start_server(settings.model_copy(update={"allowed_models": (model,)}))
    return run_loop(url, model, steps, log, off_policy=False)


def run_loop(url: str, model: str, steps: int, log: Path, *, off_policy: bool) -> list[float]:
    """When each step of the example loop ended, against the Tinker API at url."""
    env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": KEY, "MODEL": model, "STEPS": str(steps),
           "EVAL": "1", "TOKENIZERS_PARALLELISM": "false", "OFF_POLICY": "1" if off_policy else "0"}
    times = []
    with open(log, "w") as err, subprocess.Popen([sys.executable, str(LOOP)], stdout=subprocess.PIPE, stderr=err,
                                                 env=env, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith('{"step"'):
                times.append(time.perf_counter())
    if proc.returncode != 0:
        raise RuntimeError(f"the example loop failed: {log.read_text(errors='replace')[-2000:]}")
    return times


def fleet_loop_steps(run_dir: Path, model: str, steps: int, log: Path) -> list[float]:
    """When each step of the example loop, OFF_POLICY, ended against a local fleet of one actor whose Tinker API
    samples on the actor and trains on the learner (`fleetrl up --tinker --tinker-on-actors M
    --tinker-on-learner M`): the job's processes, and the job's overlap of sampling and training."""
    from fleetrl.launcher.fleet import Fleet, FleetOptions

    fleet = Fleet(FleetOptions(run_dir=run_dir, actors=1, tinker=True, tinker_models=(model,),
                               tinker_learner_models=(model,)))
    stop = threading.Event()
    try:
        layout = fleet.start()
        threading.Thread(target=fleet.serve, args=(stop,), daemon=True).start()
        return run_loop(f"http://{layout.addresses['tinker']}", model, steps, log, off_policy=True)
    finally:
        stop.set()
        fleet.stop()


def job_steps(run_dir: Path, model: str, steps: int) -> list[float]:
    """When each step of the demo job ended, on a local fleet of one actor (the watch's step events)."""
    from fleetrl.launcher.fleet import Fleet, FleetOptions
    from fleetrl.sdk.client import Client

    fleet, stop = Fleet(FleetOptions(run_dir=run_dir, actors=1)), threading.Event()
    try:
        layout = fleet.start()
        threading.Thread(target=fleet.serve, args=(stop,), daemon=True).start()
        with Client(layout.addresses["gateway"]) as client:
            job = client.submit_file(DEMO_JOB, [f"train.max_steps={steps}", f'model="{model}"'])
            times = [time.perf_counter() for event in client.watch_job(job.job_id) if event.step is not None]
            if client.get_job(job.job_id).state != "succeeded":
                raise RuntimeError(f"the demo job ended {client.get_job(job.job_id).state}")
    finally:
        stop.set()
        fleet.stop()
    return times


def loop_against_job(settings: TinkerSettings, args: argparse.Namespace) -> dict[str, Any]:
    """The example loop's steps per second against the demo job's, same model and steps, one after the other:
    the loop as written against a Tinker server in this process, then (`--loop-fleet`) OFF_POLICY against a
    fleet that samples on its actor and trains on its learner, then the job."""
    torch.set_num_threads(args.loop_threads)
    loop = steps_per_s(loop_steps(settings, args.loop_model, args.loop_steps, settings.run_dir / "loop.log"))
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"model": args.loop_model, "steps": args.loop_steps, "loop_threads": args.loop_threads,
                              "loop_steps_per_s": loop}
    if args.loop_fleet:
        result["fleet_loop_steps_per_s"] = steps_per_s(fleet_loop_steps(
            settings.run_dir / "loop-fleet", args.loop_model, args.loop_steps, settings.run_dir / "loop-fleet.log"))
    job = steps_per_s(job_steps(settings.run_dir / "fleet", args.loop_model, args.loop_steps))
    result.update(job_steps_per_s=job, loop_over_job=loop / job)
    if args.loop_fleet:
        result["fleet_loop_over_job"] = result["fleet_loop_steps_per_s"] / job
    return result


def packing(model: str, threads: int) -> dict[str, Any]:
    """One forward_backward of the example loop's batch shape (4 prompts of 46 tokens, 8 completions of 12 each,
    LoRA rank 16, cross_entropy weighted on the completions) on `TrainingRun`, its datums packed with each prompt
    once against padded, each after a warm-up on its own run."""
    from fleetrl.spec.config import LoraSpec
    from fleetrl.tinker.training import TrainingRun

    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    data = []
    for _ in range(4):
        prompt = [int(t) for t in rng.integers(100, 30000, 46)]
        for _ in range(8):
            tokens = prompt + [int(t) for t in rng.integers(100, 30000, 12)]
            weights = np.asarray([0.0] * (len(prompt) - 1) + [0.1] * 12, dtype=np.float32)
            data.append(domain.Datum(tokens[:-1], {"target_tokens": np.asarray(tokens[1:]), "weights": weights}))
    seconds = {}
    for layout in ("packed", "padded"):
        run = TrainingRun.create("bench:train:0", "bench", model, LoraSpec(rank=16), seed=0)
        if layout == "padded":
            run._packing_ratio = None
        run.forward_backward(data[:8], "cross_entropy", {}, backward=True)
        start = time.perf_counter()
        run.forward_backward(data, "cross_entropy", {}, backward=True)
        seconds[layout] = time.perf_counter() - start
        run.close()
    return {"model": model, "threads": threads, "forward_backward_s": seconds,
            "padded_over_packed": seconds["padded"] / seconds["packed"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the service's torch_threads)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--fleet-actors", type=int, default=0, help="also time sample on this many actors")
    parser.add_argument("--burst", type=int, default=8, help="sample requests sent at once (with --fleet-actors)")
    parser.add_argument("--loop-steps", type=int, default=0,
                        help="also time the example loop against the demo job, this many steps each (at least 3)")
    parser.add_argument("--loop-model", default="smollm2-135m", help="the model of the loop and the job")
    parser.add_argument("--packing", action="store_true",
                        help="also time one forward_backward of the example loop's batch, packed against padded, on "
                             "--loop-model")
    parser.add_argument("--loop-fleet", action="store_true",
                        help="with --loop-steps: also time the loop, OFF_POLICY, against a local fleet that samples "
                             "on its actor and trains on its learner")
    parser.add_argument("--loop-threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="the loop's Tinker server's torch threads (default: this process's cores, as the "
                             "fleet's learner and actor share them)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = TinkerSettings(listen="127.0.0.1:0", run_dir=Path(tempfile.mkdtemp(prefix="bench-tinker-")),
                              allowed_models=(args.model,), tokens={"bench": hash_token(KEY)}, poll_s=10.0)
    local = in_process(settings, args.calls)
    url = start_server(settings)
    remote = over_http(url, args.model, args.calls)
    result: dict[str, Any] = {"model": args.model, "calls": args.calls, "in_process_ms": local, "sdk_ms": remote,
                              "overhead_ms": {name: remote[name] - local[name] for name in local}}
    if args.fleet_actors:
        result["fleet"] = on_the_fleet(settings, url, args)
    if args.packing:
        result["packing"] = packing(args.loop_model, args.threads)
    if args.loop_steps:
        result["loop"] = loop_against_job(settings, args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
