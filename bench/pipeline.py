"""Pipeline throughput: the whole fleet against the single-process reference loop, and actor scaling.

`python -m bench.pipeline --json [--steps 6 --actors 2 --scale 1,2,4,8 --latency-s 0.5 --tasks-per-actor 10
--tracing-actors 2 --tracing-latency-s 0 --tracing-tasks 200 --tracing-rounds 5]` prints one JSON object with
three parts, measured in the same run.

Fleet vs reference (tiny-llama, the same job: spec, seed, prompts, steps):
- fleet_groups_per_s: groups the learner trains per second when the whole fleet runs the job
  (`fleetrl.launcher.fleet.Fleet` as `fleetrl up` starts it: embedded NATS + Valkey, gateway, replay,
  reward, learner and `--actors` HF actors, one torch thread each; the job submitted through the
  gateway), steady state: steps 2..S from the learner's metrics timestamps;
- reference_groups_per_s: `fleetrl.train.reference.run` on the same job in this process (generate
  the step's groups, then train; one torch thread by default, like each fleet process: on 2 shared
  cores a second thread mostly spins), steady state likewise;
- ratio: fleet / reference.

With `--job FILE` (`python -m bench.pipeline --job examples/addition/job.toml --steps 6 --actors 1`), only
this instead: the job file's job (the demo's: SmolLM2-135M) cut to --steps steps, on the whole local
fleet with the launcher's thread budget in each of `--cores-modes` (default split,lend,turns; see
fleetrl/launcher/cores.py), against the reference loop with every core, in the same run. Per mode:
fleet_groups_per_s, ratio (fleet / reference; goal >= 1.2 on 2 cores), mean step time, the learner's idle
fraction (`learner_idle_fraction`: the steps' `wait_for_data_s`, the time the learner waited for groups,
over the wall time of steps 2..S; goal <= 0.15), threads per
process, each process's share of the CPU seconds the fleet spent (`cpu_share`, from /proc) and how
busy the cores were (`cpu_busy_fraction`); then reference_groups_per_s and its step time. The
top-level fleet_* fields and `ratio` are those of `fleet_cores_mode`: the launcher's default mode
when it ran, else the first. `--model` trains another model than the job file's (a built-in name or a local
directory, admitted as `fleetrl up --model` admits it); `--device cuda` runs the reference loop on the GPU (the
fleet places its learner and actors on the machine's GPUs itself, fleetrl/launcher/devices.py).

Orchestration scaling, with the fixed backend (`FLEETRL_ACTOR_BACKEND=fixed`: every group's
generation sleeps `--latency-s` and costs no CPU, so what is left is the fleet's own cost: fetch,
weights check, reward call, replay insert, ack). Real NATS, Valkey, replay and reward processes and
k real actor processes; this process plays the learner (job record, replay table, consumer, weights
v0) and publishes k x `--tasks-per-actor` tasks at once, after all k actors hold the job's weights:
- trajectories_per_s: {k: groups stored per second}, from the first task received to the last group
  scored (replay lineage timestamps);
- scaling_efficiency_8: rate(8) / (8 x rate(1)) (goal >= 0.8);
- overhead_ms_per_group: 1000 x (1 / rate(1) - latency_s), what one group costs beyond generation
  (and per k: 1000 x (k / rate(k) - latency_s)).

Tracing on vs off, on that fixed-backend pipeline: two rigs (each its own NATS, Valkey, replay, reward
and `--tracing-actors` actors), one with FLEETRL_TRACING=0 and one with FLEETRL_TRACING=1 (JSONL span
files; each task carries a traceparent, as the feeder's do), run `--tracing-tasks` tasks per round,
alternating off/on for `--tracing-rounds` rounds (the order flips each round); each side's fastest round
counts, as this box is shared and noisy. By default generation takes no time (`--tracing-latency-s 0`),
so the actors do nothing but the pipeline's own work and tracing's share is as large as it can be:
- tracing_off_trajectories_per_s, tracing_on_trajectories_per_s: best of the rounds (all rounds listed);
- tracing_ratio: on / off (1.0: tracing costs nothing measurable);
- tracing_overhead_ms_per_group_off / _on: 1000 x (k / rate - latency_s), the pipeline's cost per group;
- tracing_spans_written: spans the traced rig wrote (checked: at least one actor.task per trajectory).
The learner's spans (a few per step, two per trained group) are not in this comparison: this process
plays the learner, untraced.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from fleetrl.jobs.store import JobState, JobStore
from fleetrl.launcher import cores
from fleetrl.launcher.embedded import EmbeddedNats, EmbeddedValkey, free_port, wait_for_port
from fleetrl.launcher.fleet import Fleet, FleetOptions, model_admission
from fleetrl.launcher.supervisor import ChildSpec, Supervisor
from fleetrl.policy import models
from fleetrl.proto.fleetrl.v1 import common_pb2, replay_pb2
from fleetrl.replay.client import ReplayClient
from fleetrl.sdk.client import Client, load_job_file
from fleetrl.spec.config import JobSpec
from fleetrl.tasks import bus
from fleetrl.train import reference
from fleetrl.weights.channel import encode_safetensors
from fleetrl.weights.store import WeightStore

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "examples" / "addition" / "train.jsonl"
MODEL = "tiny-llama"
QUIET = {"TOKENIZERS_PARALLELISM": "false"}
# Traced processes write JSONL span files, whatever OTLP endpoint the caller's environment names.
TRACING = {False: {"FLEETRL_TRACING": "0"},
           True: {"FLEETRL_TRACING": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ""}}


def job_spec(steps: int, prompts: Path) -> JobSpec:
    """The fleet-vs-reference job: 8 groups of 8 samples per step, 24 new tokens, one checkpoint."""
    return JobSpec.model_validate({
        "name": "bench", "model": MODEL, "prompts": str(prompts), "seed": 11, "reward": {"builtin": "numeric_match"},
        "optim": {"learning_rate": 1e-4},
        "rollout": {"prompts_per_step": 8, "samples_per_prompt": 8, "max_new_tokens": 24},
        "train": {"max_steps": steps, "max_staleness": 1, "checkpoint_interval": steps, "micro_batch_samples": 32,
                  "timeout_per_step_s": 300},
    })


def steady_rate(step_ends_s: list[float], groups_per_step: int) -> float:
    """Groups per second over steps 2..S, given each step's end time."""
    return (len(step_ends_s) - 1) * groups_per_step / (step_ends_s[-1] - step_ends_s[0])


# --------------------------------------------------------------------------- fleet vs reference


def demo_spec(job_file: Path, steps: int, model: str | None = None) -> JobSpec:
    """A job file's spec (the demo's: examples/addition/job.toml) cut to `steps` steps, on `model` if given."""
    payload = load_job_file(job_file, [f"train.max_steps={steps}", f"train.checkpoint_interval={steps}"])
    spec = JobSpec.model_validate_json(payload.spec)
    update: dict[str, Any] = {"prompts": str((job_file.parent / spec.prompts).resolve())}
    if model:
        update["model"] = model
    return spec.model_copy(update=update)


def reference_rate(spec: JobSpec, threads: int, device: str = "cpu") -> tuple[float, float]:
    """(steady groups/s, mean step seconds) of the single-process loop in this process."""
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(spec.seed)
    model, tokenizer = models.load(spec.model, device=device)
    history = reference.run(spec, model, tokenizer, reference.reward_of(spec), spec.train.max_steps)
    ends, total = [], 0.0
    for metrics in history:
        total += metrics["step_s"]
        ends.append(total)
    return steady_rate(ends, spec.rollout.prompts_per_step), total / len(history)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (and of its waited-for children), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def fleet_rate(spec: JobSpec, run_dir: Path, actors: int, one_thread: bool,
               cores_mode: str = cores.DEFAULT_MODE) -> dict[str, Any]:
    """Steady groups/s, wall seconds from submission to success, mean step seconds and each process's
    share of the CPU time the fleet spent, for the job on a whole local fleet. one_thread: every
    process one torch thread (the tiny job); else the launcher's thread budget in `cores_mode` (the demo's)."""
    env = {**QUIET, "FLEETRL_ACTOR_POLL_INTERVAL_S": "0.3", "FLEETRL_LEARNER_CLAIM_POLL_S": "0.3",
           "FLEETRL_LEARNER_SAMPLE_WAIT_S": "0.5", "FLEETRL_ACTOR_GRACE_S": "5"}
    if one_thread:
        env.update({"FLEETRL_ACTOR_TORCH_THREADS": "1", "FLEETRL_LEARNER_TORCH_THREADS": "1"})
    allowed_models, model_roots = model_admission(spec.model)
    fleet = Fleet(FleetOptions(run_dir=run_dir, actors=actors, metrics=False, extra_env=env, cores_mode=cores_mode,
                               allowed_models=allowed_models, model_roots=model_roots))
    try:
        layout = fleet.start()
        pids = {name: child.pid for name, child in fleet.supervisor.children.items() if child.pid}
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        with Client(layout.addresses["gateway"]) as client:
            started = time.monotonic()
            job = client.submit(spec.model_dump_json(), Path(spec.prompts).read_bytes(), spec_format="json")
            info = client.run(job.job_id).wait(timeout_s=3600)
            wall_s = time.monotonic() - started
        cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
        if info.state != "succeeded":
            raise RuntimeError(f"bench job {info.job_id} ended {info.state}: {info.reason}")
        metrics = [json.loads(line) for line in
                   (run_dir / "jobs" / job.job_id / "metrics.jsonl").read_text().splitlines()]
    finally:
        fleet.stop()
    ends = [m["unix_ms"] / 1000 for m in metrics]
    total_cpu = sum(cpu.values()) or 1.0
    waited = sum(m["wait_for_data_s"] for m in metrics[1:])
    return {"groups_per_s": steady_rate(ends, spec.rollout.prompts_per_step), "wall_s": wall_s,
            "step_s": (ends[-1] - ends[0]) / (len(ends) - 1), "threads": dict(fleet.threads),
            "learner_idle_fraction": round(waited / (ends[-1] - ends[0]), 3),
            "cpu_share": {name: round(seconds / total_cpu, 3) for name, seconds in sorted(cpu.items())},
            "cpu_busy_fraction": round(total_cpu / (wall_s * fleet.cores), 3)}


# --------------------------------------------------------------------------- orchestration scaling


class ScalingRig:
    """Replay, reward and k fixed-backend actors as supervised processes; this process is the learner.
    With tracing, every process writes its spans to `<tmp>/run/traces/`."""

    def __init__(self, tmp: Path, nats_url: str, redis_url: str, latency_s: float, tracing: bool = False) -> None:
        self.nats_url, self.redis_url, self.latency_s, self.tracing = nats_url, redis_url, latency_s, tracing
        self.run_dir = tmp / "run"
        self.supervisor = Supervisor(tmp / "logs")
        self.replay_addr = self._service("replay", {"REDIS_URL": redis_url})
        self.reward_addr = self._service("reward", {})
        self.actors: list[str] = []

    def _service(self, name: str, env: dict[str, str]) -> str:
        port = free_port()
        settings = {"LISTEN": f"127.0.0.1:{port}", "NATS_URL": self.nats_url, "LOG_LEVEL": "WARNING",
                    "RUN_DIR": str(self.run_dir), **env}
        child = self.supervisor.add(self._child(name, name, settings))
        wait_for_port("127.0.0.1", port, 60, child.proc)
        return f"127.0.0.1:{port}"

    def _child(self, name: str, service: str, settings: dict[str, str]) -> ChildSpec:
        """A service process configured only through its FLEETRL_<SERVICE>_<FIELD> variables."""
        env = {f"FLEETRL_{service.upper()}_{key}": value for key, value in settings.items()}
        argv = [sys.executable, "-m", f"fleetrl.services.{service}"]
        return ChildSpec(name, argv, {**QUIET, **TRACING[self.tracing], **env})

    def grow(self, count: int) -> None:
        while len(self.actors) < count:
            name = f"actor-{len(self.actors) + 1}"
            settings = {"ACTOR_ID": name, "NATS_URL": self.nats_url, "REDIS_URL": self.redis_url,
                        "REPLAY_ADDR": self.replay_addr, "REWARD_ADDR": self.reward_addr, "BACKEND": "fixed",
                        "FIXED_LATENCY_S": str(self.latency_s), "TORCH_THREADS": "1", "POLL_INTERVAL_S": "0.2",
                        "FETCH_TIMEOUT_S": "0.5", "RUN_DIR": str(self.run_dir)}
            self.supervisor.add(self._child(name, "actor", settings))
            self.actors.append(name)

    def all_hold_weights(self, job_id: str) -> bool:
        marker = f"job {job_id}: loaded weights v0"
        return all(marker in (self.supervisor.log_dir / f"{name}.log").read_text(errors="replace")
                   for name in self.actors)

    def stop(self) -> None:
        self.supervisor.stop_all()

    def spans(self) -> list[dict[str, Any]]:
        """The spans the rig's processes wrote (all of them once the rig stopped: exit flushes them)."""
        return [json.loads(line) for path in sorted((self.run_dir / "traces").glob("*.jsonl"))
                for line in path.read_text().splitlines() if line.strip()]


async def wait_until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench: timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def measure(rig: ScalingRig, k: int, tasks: int, weights: bytes) -> float:
    """Groups per second of k actors on a fresh job of `tasks` tasks."""
    spec = JobSpec.model_validate({
        "name": f"scale-{k}", "model": MODEL, "prompts": "bench", "reward": {"builtin": "numeric_match"},
        "rollout": {"prompts_per_step": tasks, "samples_per_prompt": 4, "max_new_tokens": 16},
        "train": {"max_staleness": 0, "task_ack_wait_s": 60},
    })
    jobs = JobStore.from_url(rig.redis_url)
    nc = await bus.connect(rig.nats_url, "bench-pipeline")
    js = bus.jetstream(nc)
    try:
        async with ReplayClient(rig.replay_addr, timeout_s=30) as replay:
            job_id = await open_job(jobs, js, replay, spec)
            await WeightStore(nc, js).publish(job_id, 0, weights, "bfloat16")
            rig.grow(k)

            async def ready() -> bool:
                return rig.all_hold_weights(job_id)

            await wait_until(ready, 300, f"{k} actors holding weights")
            for index in range(tasks):
                await publish_task(js, job_id, index, traced=rig.tracing)

            async def stored() -> bool:
                return (await replay.stats(job_id)).inserted >= tasks

            await wait_until(stored, 600, f"{tasks} groups from {k} actors")
            stats, lineage = await replay.stats(job_id), await replay.query(job_id, limit=tasks + 1)
            await jobs.set_state(job_id, JobState.SUCCEEDED)
    finally:
        await nc.close()
        await jobs.close()
    return rate_of(stats, lineage, tasks)


async def open_job(jobs: JobStore, js: Any, replay: ReplayClient, spec: JobSpec) -> str:
    record = await jobs.create("bench", spec, b'{"prompt": "unused"}\n', None)
    await jobs.set_state(record.job_id, JobState.RUNNING)
    await replay.configure(record.job_id, spec.replay)
    await bus.ensure_streams(js)
    await bus.ensure_job_consumer(js, record.job_id, spec)
    return record.job_id


async def publish_task(js: Any, job_id: str, index: int, traced: bool = False) -> None:
    """Task `index` of job_id; traced: with a W3C traceparent header, as the feeder of a traced learner sends."""
    a, b = divmod(index, 100)
    task = common_pb2.Task(job_id=job_id, task_id=f"0/{index}", epoch=0, prompt_index=index,
                           prompt=f"What is {a} + {b}?", metadata_json=json.dumps({"answer": str(a + b)}),
                           min_policy_version=0, published_unix_ms=int(time.time() * 1000))
    headers = {"Nats-Msg-Id": bus.task_msg_id(job_id, 0, index)}
    if traced:
        headers["traceparent"] = f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"
    await js.publish(bus.task_subject(job_id), task.SerializeToString(), headers=headers)


def rate_of(stats: replay_pb2.TableStats, lineage: list[replay_pb2.LineageRecord], tasks: int) -> float:
    if stats.inserted != tasks or stats.duplicates or len(lineage) != tasks:
        raise RuntimeError(f"bench: expected {tasks} groups once each, replay reports {stats}")
    first = min(r.lineage.received_unix_ms for r in lineage)
    last = max(r.lineage.scored_unix_ms for r in lineage)
    return tasks / ((last - first) / 1000)


async def scaling(tmp: Path, counts: list[int], latency_s: float, tasks_per_actor: int) -> dict[int, float]:
    tensors = models.state_dict_for_publish(models.load(MODEL)[0], "bfloat16")
    weights = encode_safetensors(tensors)
    with EmbeddedNats(data_dir=tmp / "nats") as nats, EmbeddedValkey(data_dir=tmp / "valkey") as valkey:
        rig = ScalingRig(tmp, nats.url, valkey.url, latency_s)
        try:
            await measure(rig, 1, 2, weights)  # warm-up: the reward service starts the spec's workers once
            return {k: await measure(rig, k, k * tasks_per_actor, weights) for k in sorted(counts)}
        finally:
            rig.stop()


async def tracing_rounds(tmp: Path, actors: int, latency_s: float, tasks: int, rounds: int) -> dict[str, Any]:
    """Groups/s of the same fixed-backend pipeline untraced and traced, `rounds` alternating rounds each."""
    weights = encode_safetensors(models.state_dict_for_publish(models.load(MODEL)[0], "bfloat16"))
    rates: dict[bool, list[float]] = {False: [], True: []}
    with ExitStack() as stack:
        rigs = {}
        for tracing in (False, True):
            side = tmp / ("on" if tracing else "off")
            nats = stack.enter_context(EmbeddedNats(data_dir=side / "nats"))
            valkey = stack.enter_context(EmbeddedValkey(data_dir=side / "valkey"))
            rigs[tracing] = ScalingRig(side, nats.url, valkey.url, latency_s, tracing)
            stack.callback(rigs[tracing].stop)
        for rig in rigs.values():
            await measure(rig, actors, 2 * actors, weights)  # warm-up: actors load, reward workers start
        for index in range(rounds):
            for tracing in (False, True) if index % 2 == 0 else (True, False):
                rates[tracing].append(await measure(rigs[tracing], actors, tasks, weights))
    spans = rigs[True].spans()
    trajectories = sum(1 for span in spans if span["name"] == "actor.task")
    if rigs[False].spans() or trajectories < rounds * tasks:
        raise RuntimeError(f"bench: tracing did not follow the switch: {trajectories} traced trajectories")
    off, on = max(rates[False]), max(rates[True])
    return {
        "tracing_actors": actors, "tracing_latency_s": latency_s, "tracing_tasks": tasks, "tracing_rounds": rounds,
        "tracing_off_trajectories_per_s": round(off, 3), "tracing_on_trajectories_per_s": round(on, 3),
        "tracing_ratio": round(on / off, 3),
        "tracing_off_rounds": [round(rate, 3) for rate in rates[False]],
        "tracing_on_rounds": [round(rate, 3) for rate in rates[True]],
        "tracing_overhead_ms_per_group_off": round(1000 * (actors / off - latency_s), 2),
        "tracing_overhead_ms_per_group_on": round(1000 * (actors / on - latency_s), 2),
        "tracing_spans_written": len(spans),
    }


# --------------------------------------------------------------------------- report


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    """The demo's job (SmolLM2-135M) on the whole local fleet, with the launcher's thread budget in
    each cores mode, against the reference loop with every core, in the same run."""
    spec = demo_spec(Path(args.job), args.steps, args.model)
    modes = args.cores_modes.split(",")
    if unknown := set(modes) - set(cores.MODES):
        raise SystemExit(f"--cores-modes: unknown {', '.join(sorted(unknown))} (choose from {', '.join(cores.MODES)})")
    fleets = {}
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp_dir:
            fleets[mode] = fleet_rate(spec, Path(tmp_dir) / "fleet", args.actors, one_thread=False, cores_mode=mode)
    threads = len(os.sched_getaffinity(0)) if args.threads is None else args.threads
    reference_gps, reference_step_s = reference_rate(spec, threads, args.device)
    by_mode = {mode: {"fleet_groups_per_s": round(f["groups_per_s"], 4),
                      "ratio": round(f["groups_per_s"] / reference_gps, 3), "fleet_step_s": round(f["step_s"], 1),
                      "fleet_wall_s": round(f["wall_s"], 1), "learner_idle_fraction": f["learner_idle_fraction"],
                      "threads": f["threads"], "cpu_share": f["cpu_share"],
                      "cpu_busy_fraction": f["cpu_busy_fraction"]} for mode, f in fleets.items()}
    top = cores.DEFAULT_MODE if cores.DEFAULT_MODE in by_mode else modes[0]
    default = by_mode[top]
    return {
        "job": args.job, "model": spec.model, "steps": args.steps, "groups_per_step": spec.rollout.prompts_per_step,
        "samples_per_group": spec.rollout.samples_per_prompt, "max_new_tokens": spec.rollout.max_new_tokens,
        "fleet_actors": args.actors, "fleet_cores_mode": top, "by_cores_mode": by_mode,
        "fleet_groups_per_s": default["fleet_groups_per_s"], "fleet_step_s": default["fleet_step_s"],
        "fleet_threads": default["threads"], "fleet_cpu_share": default["cpu_share"],
        "fleet_cpu_busy_fraction": default["cpu_busy_fraction"],
        "learner_idle_fraction": default["learner_idle_fraction"],
        "reference_groups_per_s": round(reference_gps, 4), "reference_step_s": round(reference_step_s, 1),
        "reference_threads": torch.get_num_threads(), "reference_device": args.device, "ratio": default["ratio"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.job:
        return run_demo(args)
    counts = [int(k) for k in args.scale.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp_dir:
        tmp = Path(tmp_dir)
        spec = job_spec(args.steps, Path(args.prompts).resolve())
        reference_gps, _ = reference_rate(spec, 1 if args.threads is None else args.threads)
        fleet = fleet_rate(spec, tmp / "fleet", args.actors, one_thread=True)
        fleet_gps, fleet_wall_s = fleet["groups_per_s"], fleet["wall_s"]
        rates = asyncio.run(scaling(tmp / "scaling", counts, args.latency_s, args.tasks_per_actor))
        tracing = asyncio.run(tracing_rounds(tmp / "tracing", args.tracing_actors, args.tracing_latency_s,
                                             args.tracing_tasks, args.tracing_rounds))
    overhead = {k: round(1000 * (k / rate - args.latency_s), 1) for k, rate in rates.items()}
    result: dict[str, Any] = {
        "model": MODEL, "steps": args.steps, "groups_per_step": spec.rollout.prompts_per_step,
        "samples_per_group": spec.rollout.samples_per_prompt, "max_new_tokens": spec.rollout.max_new_tokens,
        "fleet_actors": args.actors, "fleet_groups_per_s": round(fleet_gps, 3),
        "fleet_wall_s": round(fleet_wall_s, 1), "reference_groups_per_s": round(reference_gps, 3),
        "reference_threads": torch.get_num_threads(), "ratio": round(fleet_gps / reference_gps, 3),
        "fixed_latency_s": args.latency_s, "tasks_per_actor": args.tasks_per_actor,
        "trajectories_per_s": {str(k): round(rate, 3) for k, rate in rates.items()},
        "overhead_ms_per_group_by_actors": {str(k): v for k, v in overhead.items()},
    }
    if 1 in rates:
        result["overhead_ms_per_group"] = overhead[1]
        if 8 in rates:
            result["scaling_efficiency_8"] = round(rates[8] / (8 * rates[1]), 3)
    return {**result, **tracing}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps of the fleet-vs-reference job (default 6)")
    parser.add_argument("--actors", type=int, default=2, help="HF actors of the fleet run (default 2)")
    parser.add_argument("--prompts", default=str(PROMPTS), help="prompt JSONL (default the addition examples)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of the reference loop (default 1, as each fleet process of the tiny "
                             "job; with --job, every core; 0: torch's default)")
    parser.add_argument("--job", help="instead: this job file (e.g. examples/addition/job.toml, the demo's) on the "
                                      "fleet with its thread budget vs the reference loop, --steps steps, nothing else")
    parser.add_argument("--model", help="with --job: this model instead of the job file's (a built-in name or a "
                                        "local directory)")
    parser.add_argument("--device", default="cpu", help="with --job: the reference loop's device (default cpu; cuda)")
    parser.add_argument("--cores-modes", default=",".join(cores.MODES),
                        help="with --job: the launcher's cores modes to run the fleet in, one after the other")
    parser.add_argument("--scale", default="1,2,4,8", help="actor counts of the fixed-backend runs")
    parser.add_argument("--latency-s", type=float, default=0.5, help="fixed backend seconds per group")
    parser.add_argument("--tasks-per-actor", type=int, default=10, help="tasks per actor in each scaling run")
    parser.add_argument("--tracing-actors", type=int, default=2, help="actors of each tracing on/off rig")
    parser.add_argument("--tracing-latency-s", type=float, default=0.0,
                        help="fixed backend seconds per group in the tracing comparison (default 0: no generation)")
    parser.add_argument("--tracing-tasks", type=int, default=200, help="tasks per tracing round")
    parser.add_argument("--tracing-rounds", type=int, default=5,
                        help="alternating tracing off/on rounds; each side's fastest counts")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    args = parser.parse_args(argv)
    result = run(args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
