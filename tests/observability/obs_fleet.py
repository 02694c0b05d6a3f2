"""Helpers of the observability tests: one traced fleet, as `fleetrl up --tracing` runs it, and scraping.

`traced_fleet` starts `fleetrl.launcher.fleet.Fleet` with tracing on and the Tinker API (`fleetrl up
--tracing --tinker`; each process writes its spans to
`<run_dir>/traces/<service>-<pid>.jsonl`) and metrics ports for every service and actor, serves it
from a thread, submits one tiny job, and scrapes every /metrics endpoint once the job's first step
is reported, while the rest of the job still runs. Tests then read what they need after the job ends.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from fleetrl.launcher.fleet import Fleet, FleetLayout, FleetOptions
from fleetrl.sdk.client import Client, Run

MODEL = "tiny-llama"
MAX_STEPS = 4
FAST_ENV = {
    "FLEETRL_ACTOR_TORCH_THREADS": "1", "FLEETRL_ACTOR_POLL_INTERVAL_S": "0.3", "FLEETRL_ACTOR_FETCH_TIMEOUT_S": "0.5",
    "FLEETRL_ACTOR_GRACE_S": "5",
    "FLEETRL_LEARNER_TORCH_THREADS": "1", "FLEETRL_LEARNER_LEASE_S": "3", "FLEETRL_LEARNER_CLAIM_POLL_S": "0.3",
    "FLEETRL_LEARNER_SAMPLE_WAIT_S": "0.5", "FLEETRL_REPLAY_RECLAIM_INTERVAL_S": "0.2",
    "FLEETRL_REWARD_WORKERS_PER_POOL": "1", "FLEETRL_GATEWAY_WATCH_POLL_S": "0.1", "FLEETRL_TINKER_TORCH_THREADS": "1",
}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class TracedFleet:
    """A running traced fleet, its one job, and the scrape taken while the job ran."""

    fleet: Fleet
    layout: FleetLayout
    run_dir: Path
    client: Client
    run: Run
    early: dict[str, Samples] = field(default_factory=dict)

    def targets(self) -> dict[str, int]:
        """Every /metrics port of the fleet: service name or actor name -> port."""
        return {name: port for name, port in self.layout.metrics_ports.items() if port}

    def scrape_all(self) -> dict[str, Samples]:
        return {name: scrape(port) for name, port in self.targets().items()}

    def spans(self) -> list[dict[str, Any]]:
        return [json.loads(line) for path in sorted((self.run_dir / "traces").glob("*.jsonl"))
                for line in path.read_text().splitlines() if line.strip()]


def scrape(port: int) -> Samples:
    """One /metrics scrape, parsed by prometheus_client's parser: (sample name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of a sample over every label set that contains labels."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)
    return value


def prompts(n: int) -> str:
    return "".join(json.dumps({"prompt": f"What is {a} + {a + 3}?", "answer": str(2 * a + 3)}) + "\n"
                   for a in range(n))


@contextmanager
def traced_fleet(run_dir: Path) -> Iterator[TracedFleet]:
    """Start the fleet (1 actor, tracing on, the Tinker API too, its samples served by the actor), submit the
    job, scrape after its first step; stop on exit."""
    (run_dir / "prompts.jsonl").write_text(prompts(16))
    fleet = Fleet(FleetOptions(run_dir=run_dir, actors=1, tracing=True, extra_env=FAST_ENV, tinker=True,
                               tinker_models=(MODEL,), tinker_learner_models=(MODEL,)))
    stop = threading.Event()
    serving: threading.Thread | None = None
    try:
        layout = fleet.start()
        serving = threading.Thread(target=fleet.serve, args=(stop,), name="fleet-serve", daemon=True)
        serving.start()
        with Client(layout.addresses["gateway"]) as client:
            run = client.create_run(
                MODEL, run_dir / "prompts.jsonl", reward_builtin="numeric_match", name="traced", seed=3,
                learning_rate=1e-3, prompts_per_step=2, samples_per_prompt=2, max_new_tokens=6,
                max_steps=MAX_STEPS, max_staleness=1, checkpoint_interval=2, timeout_per_step_s=120)
            under_test = TracedFleet(fleet, layout, run_dir, client, run)
            wait_for(lambda: (job := run.status()).last is not None or job.done, 240, "the job's first step")
            under_test.early = under_test.scrape_all()
            yield under_test
    finally:
        stop.set()
        if serving is not None:
            serving.join(10)
        fleet.stop()
