"""Helpers of the actor tests: a real fleet minus the learner (see conftest.py for the fixtures).

NATS, Valkey, the replay service and the reward service are real processes started once per
module (each test uses its own job id); `Fleet` plays the learner's part: it creates the job
record, configures the replay table, creates the task consumer, publishes weights and tasks.
Actors are `python -m fleetrl.services.actor` subprocesses that tests SIGKILL, SIGSTOP and restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from fleetrl.jobs.store import JobState, JobStore
from fleetrl.launcher.embedded import wait_for_port
from fleetrl.policy import models
from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.replay.client import ReplayClient
from fleetrl.spec.config import JobSpec
from fleetrl.tasks import bus
from fleetrl.tasks.ledger import Ledger
from fleetrl.weights.store import WeightStore, encode_safetensors

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"


@dataclass
class Services:
    nats_url: str
    redis_url: str
    replay_addr: str
    reward_addr: str
    log_dir: Path


def start_service(argv: list[str], log: Path, port: int) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    wait_for_port("127.0.0.1", port, 60, proc)
    return proc


def job_spec(**sections: dict[str, Any]) -> JobSpec:
    data: dict[str, Any] = {
        "model": MODEL, "prompts": "prompts.jsonl", "seed": 7,
        "reward": {"builtin": "numeric_match"},
        "rollout": {"samples_per_prompt": 4, "max_new_tokens": 16, "prompts_per_step": 8, "temperature": 1.0},
        "train": {"task_ack_wait_s": 3.0, "max_retries_per_episode": 3, "max_staleness": 0},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return JobSpec.model_validate(data)


def perturbed_weights(scale: float) -> dict[str, torch.Tensor]:
    """tiny-llama's publishable weights with every tensor shifted (a distinct, recognisable version)."""
    model, _ = models.load(MODEL)
    tensors = models.state_dict_for_publish(model, "float32")
    return {name: t + scale for name, t in tensors.items()}


@dataclass
class Fleet:
    """The learner's side of a job, done by hand."""

    services: Services
    nc: NATS
    js: JetStreamContext
    jobs: JobStore
    replay: ReplayClient
    weights: WeightStore
    actors: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    job_ids: list[str] = field(default_factory=list)

    async def create_job(self, spec: JobSpec, prompts: list[dict[str, Any]],
                         environment_file: bytes | None = None, tenant: str = "test", weight: float = 1.0) -> str:
        body = "".join(json.dumps(p) + "\n" for p in prompts).encode()
        record = await self.jobs.create(tenant, spec, body, None, environment_file=environment_file, weight=weight)
        await self.jobs.set_state(record.job_id, JobState.RUNNING)
        await self.replay.configure(record.job_id, spec.replay)
        await bus.ensure_job_consumer(self.js, record.job_id, spec)
        await bus.ensure_advisory_consumer(self.js, record.job_id)
        self.job_ids.append(record.job_id)
        return record.job_id

    async def publish_weights(self, job_id: str, version: int, tensors: dict[str, torch.Tensor] | None = None,
                              dtype: str = "bfloat16") -> None:
        if tensors is None:
            tensors = models.state_dict_for_publish(models.load(MODEL)[0], dtype)
        tensors = {k: v.to(models.as_dtype(dtype)).contiguous() for k, v in tensors.items()}
        await self.weights.publish(job_id, version, encode_safetensors(tensors), dtype)

    @property
    def ledger(self) -> Ledger:
        return Ledger(self.jobs.redis)

    async def publish_task(self, job_id: str, index: int, prompt: str, answer: str,
                           min_version: int = 0) -> common_pb2.Task:
        """As the feeder does: recorded in the job's ledger, then published with its dedup id."""
        await self.ledger.published(job_id, [f"0/{index}"], lease_epoch=0)
        task = common_pb2.Task(job_id=job_id, task_id=f"0/{index}", epoch=0, prompt_index=index, prompt=prompt,
                               metadata_json=json.dumps({"answer": answer}), min_policy_version=min_version,
                               published_unix_ms=int(time.time() * 1000))
        await self.js.publish(bus.task_subject(job_id), task.SerializeToString(),
                              headers={"Nats-Msg-Id": bus.task_msg_id(job_id, 0, index)})
        return task

    def start_actor(self, name: str, *settings: str, reward_addr: str = "") -> subprocess.Popen[bytes]:
        s = self.services
        argv = [sys.executable, "-m", "fleetrl.services.actor", "--actor-id", name, "--nats-url", s.nats_url,
                "--redis-url", s.redis_url, "--replay-addr", s.replay_addr,
                "--reward-addr", reward_addr or s.reward_addr,
                "--set", "torch_threads=1", "--set", "poll_interval_s=0.3", "--set", "nak_base_delay_s=0.2",
                *[arg for item in settings for arg in ("--set", item)]]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "FLEETRL_TRACING": "0"}
        with open(self.log(name), "ab") as out:
            self.actors[name] = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        return self.actors[name]

    def log(self, name: str) -> Path:
        return self.services.log_dir / f"{name}.log"

    def log_text(self, name: str) -> str:
        path = self.log(name)
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.actors[name]
        proc.send_signal(sig)
        if sig == signal.SIGKILL:
            proc.wait(10)

    def stop_all(self) -> None:
        for proc in self.actors.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(10)


async def wait_until(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.2) -> Any:
    """Await predicate() (sync or async) until it is truthy; fail with `what` after timeout_s."""
    import asyncio
    import inspect

    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(interval_s)


