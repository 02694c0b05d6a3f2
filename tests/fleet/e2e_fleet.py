"""Helpers of the end-to-end tests: `fleetrl.launcher.fleet.Fleet` run in-process, as `fleetrl up` runs it.

`running_fleet` starts embedded NATS + Valkey, gateway, replay, reward, learner and actors as real
child processes under the fleet's supervisor (conftest.py makes one fleet per session). The
supervision loop (`Fleet.serve`) runs in a thread; the SIGHUP handler `fleetrl scale` relies on is
installed on the main thread, so `request_scale(run_dir, n)` works exactly as from another shell.
Tests SIGKILL children by the pids the supervisor holds, and the supervisor restarts them. Every
setting is short (ack waits, leases, polls) and every torch process uses one thread, so a whole
job of a tiny model runs in seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetrl.launcher import jobs_cli as cli
from fleetrl.launcher.fleet import Fleet, FleetLayout, FleetOptions, pid_alive, request_scale
from fleetrl.proto.fleetrl.v1 import replay_pb2
from fleetrl.replay.client import ReplayClient
from fleetrl.sdk.client import Client, Run

MODEL = "tiny-llama"
PPS = 4
"""prompts_per_step of `job_params`."""
FAST_ENV = {
    "FLEETRL_ACTOR_TORCH_THREADS": "1", "FLEETRL_ACTOR_POLL_INTERVAL_S": "0.3", "FLEETRL_ACTOR_FETCH_TIMEOUT_S": "0.5",
    "FLEETRL_ACTOR_NAK_BASE_DELAY_S": "0.2", "FLEETRL_ACTOR_NAK_MAX_DELAY_S": "2", "FLEETRL_ACTOR_GRACE_S": "5",
    "FLEETRL_LEARNER_TORCH_THREADS": "1", "FLEETRL_LEARNER_LEASE_S": "3", "FLEETRL_LEARNER_CLAIM_POLL_S": "0.3",
    "FLEETRL_LEARNER_SAMPLE_WAIT_S": "0.5", "FLEETRL_REPLAY_RECLAIM_INTERVAL_S": "0.2",
    "FLEETRL_REWARD_WORKERS_PER_POOL": "1", "FLEETRL_GATEWAY_WATCH_POLL_S": "0.1",
}


def addition_prompts(n: int) -> str:
    return "".join(json.dumps({"prompt": f"What is {a} + {a + 3}?", "answer": str(2 * a + 3)}) + "\n"
                   for a in range(n))


def job_params(**overrides: Any) -> dict[str, Any]:
    """A tiny job: 4 groups of 4 samples per step, 8 new tokens, short ack wait and lease timeout.

    The lease timeout must outlast a replay restart (the learner cannot renew while replay is down) and
    be short enough that a killed learner's leases expire before the job ends (the chaos accounting
    asserts no lease is left open).
    """
    params: dict[str, Any] = {
        "seed": 5, "learning_rate": 1e-3, "prompts_per_step": PPS, "samples_per_prompt": 4, "max_new_tokens": 8,
        "max_steps": 10, "max_staleness": 1, "checkpoint_interval": 3, "timeout_per_step_s": 120,
        "train.task_ack_wait_s": 3, "train.micro_batch_samples": 16, "replay.lease_timeout_s": 10,
    }
    return {**params, **overrides}


@dataclass
class FleetUnderTest:
    """A running fleet and the handles a test needs on it."""

    fleet: Fleet
    layout: FleetLayout
    run_dir: Path
    client: Client
    prompts: Path

    def submit(self, name: str, **overrides: Any) -> Run:
        return self.client.create_run(MODEL, self.prompts, reward_builtin="numeric_match", name=name,
                                      **job_params(**overrides))

    def pid(self, name: str) -> int:
        pid = self.fleet.supervisor.children[name].pid
        assert pid is not None, f"{name} is not running"
        return pid

    def kill(self, name: str) -> int:
        """SIGKILL a child's whole process group (as a container kill would); returns the killed pid."""
        pid = self.pid(name)
        os.killpg(pid, signal.SIGKILL)
        return pid

    def restarts(self, name: str) -> int:
        return self.fleet.supervisor.children[name].restarts

    def alive(self, name: str) -> bool:
        child = self.fleet.supervisor.children.get(name)
        return child is not None and child.alive()

    def serving(self, name: str, job_id: str) -> bool:
        """Whether the current incarnation of actor `name` has loaded job_id's model and takes its tasks."""
        return self.alive(name) and f"serving job {job_id}" in self.log(name).rsplit("==== start", 1)[-1]

    def actors(self) -> list[str]:
        return self.fleet.actor_names()

    @contextmanager
    def actor_env(self, **env: str) -> Iterator[None]:
        """Actors started inside the block get these extra settings (e.g. FLEETRL_ACTOR_BACKEND)."""
        saved = dict(self.fleet.options.extra_env)
        self.fleet.options.extra_env.update(env)
        try:
            yield
        finally:
            self.fleet.options.extra_env.clear()
            self.fleet.options.extra_env.update(saved)

    def scale_actors(self, count: int) -> list[str]:
        """`fleetrl scale actor=count` (file + SIGHUP to the fleet), then wait until it took effect."""
        request_scale(self.run_dir, count)
        wait_for(lambda: len(names := self.actors()) == count and all(map(self.alive, names)), 30, f"{count} actors")
        return self.actors()

    def stop_actors(self) -> None:
        """Scale to 0 and wait until every actor process is gone, so no insert races an accounting read."""
        pids = [self.pid(name) for name in self.actors() if self.alive(name)]
        request_scale(self.run_dir, 0)
        wait_for(lambda: not any(pid_alive(pid) for pid in pids), 60, "actors to stop")

    def metrics(self, job_id: str) -> list[dict[str, Any]]:
        """The learner's metrics JSONL of a job (one object per surviving step)."""
        path = self.run_dir / "jobs" / job_id / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def replay_stats(self, job_id: str) -> replay_pb2.TableStats:
        return asyncio.run(_replay_call(self.layout.addresses["replay"], lambda r: r.stats(job_id)))

    def lineage(self, job_id: str, limit: int = 100_000) -> list[replay_pb2.LineageRecord]:
        return asyncio.run(_replay_call(self.layout.addresses["replay"], lambda r: r.query(job_id, limit=limit)))

    def log(self, name: str) -> str:
        path = self.layout.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


async def _replay_call(addr: str, call: Callable[[ReplayClient], Any]) -> Any:
    async with ReplayClient(addr, timeout_s=10, attempts=10) as replay:
        return await call(replay)


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)
    return value


@contextmanager
def running_fleet(run_dir: Path, actors: int = 2) -> Iterator[FleetUnderTest]:
    """Start a fleet in run_dir, serve it from a thread, stop it (and everything it started) on exit."""
    prompts = run_dir / "prompts.jsonl"
    prompts.write_text(addition_prompts(64))
    fleet = Fleet(FleetOptions(run_dir=run_dir, actors=actors, extra_env=dict(FAST_ENV)))
    previous = signal.signal(signal.SIGHUP, fleet.request_rescale)
    stop = threading.Event()
    serving: threading.Thread | None = None
    try:
        layout = fleet.start()
        serving = threading.Thread(target=fleet.serve, args=(stop,), name="fleet-serve", daemon=True)
        serving.start()
        with Client(layout.addresses["gateway"]) as client:
            yield FleetUnderTest(fleet, layout, run_dir, client, prompts)
    finally:
        stop.set()
        if serving is not None:
            serving.join(10)
        fleet.stop()
        signal.signal(signal.SIGHUP, previous)


def ledger(fleet: FleetUnderTest, job_id: str, steps: int) -> dict[str, int]:
    """The job's end-to-end ledger as `fleetrl jobs account JOB --tasks --json` prints it: every published
    task trained in exactly the step metrics.jsonl names, or dropped stale, or still pending / in flight;
    nothing lost, nothing trained twice."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["jobs", "account", job_id, "--tasks", "--json",
                         "--gateway", fleet.layout.addresses["gateway"]])
    accounting = json.loads(out.getvalue())
    counts: dict[str, int] = accounting["counts"]
    assert code == 0 and accounting["balanced"], counts
    assert counts["lost"] == 0 and counts["duplicated"] == 0 and counts["unpublished"] == 0, counts
    assert counts["trained"] == steps * PPS and counts["dead_lettered"] == counts["evicted"] == 0, counts
    by_step = {m["step"]: sorted(m["task_ids"]) for m in fleet.metrics(job_id)}
    ledger_steps: dict[int, list[str]] = {}
    for task in accounting["tasks"]:
        for step in task["steps"]:
            ledger_steps.setdefault(step, []).append(task["task_id"])
    assert {s: sorted(ids) for s, ids in ledger_steps.items()} == by_step
    assert sum(counts[f] for f in ("trained", "stale", "pending", "in_flight")) == counts["published"], counts
    return counts
