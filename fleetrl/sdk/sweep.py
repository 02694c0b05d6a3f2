"""Hyperparameter sweeps: a grid of spec overrides, submitted as jobs that share the fleet.

    sweep = client.sweep({"optim.learning_rate": [1e-6, 5e-6], "algorithm.clip_eps": [0.2, 0.3]},
                         job_file="job.toml")
    for row in sweep.wait():
        print(row.params, row.final_reward, row.wall_s)

Every combination of the grid's values is one job, submitted at once: the gateway queues them and
learners claim them as they free up, so a sweep runs as wide as the fleet has learners. The sweep
follows its jobs by polling their status (one GetJob per unfinished job per `poll_s`); a job's wall
time runs from the first poll that sees it running to the first that sees it ended, so it excludes
time spent queued and is exact to one poll interval. Cancelling the sweep (or Ctrl-C in `fleetrl
sweep`) cancels every job of it that has not ended, so nothing is left running.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetrl.errors import ConfigError, DeadlineExceeded, FieldViolation
from fleetrl.sdk.records import TERMINAL_STATES, JobInfo, StepInfo
from fleetrl.spec.config import parse_value

if TYPE_CHECKING:
    from fleetrl.sdk.client import Client, Run

MAX_COMBINATIONS = 64
FINAL_STEPS = 3  # final reward: the mean of reward_mean over the last steps, so one lucky step does not decide
PASS_AT_1 = "eval_pass_at_1"  # the step metric a job with an eval set reports (held-out pass@1)


def parse_grid(items: Sequence[str]) -> dict[str, list[Any]]:
    """`key=[v1,v2,...]` strings (the CLI's --grid) as {dotted key: values}; ConfigError naming the bad item."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        values = parse_value(raw.strip()) if sep else None
        if not key or not isinstance(values, list):
            raise ConfigError("bad --grid", [FieldViolation(item, "expected key=[value, ...], e.g. "
                                                                  "optim.learning_rate=[1e-6,5e-6]")])
        grid[key] = values
    return check_grid(grid)


def check_grid(grid: Mapping[str, Sequence[Any]]) -> dict[str, list[Any]]:
    """The grid with each axis a non-empty list without repeats, and at most MAX_COMBINATIONS jobs."""
    bad = [FieldViolation(key, "needs at least one value") for key, values in grid.items() if not values]
    bad += [FieldViolation(key, "repeats a value") for key, values in grid.items()
            if len({json.dumps(v, sort_keys=True) for v in values}) != len(values)]
    if not grid:
        bad.append(FieldViolation("grid", "no axis given"))
    if bad:
        raise ConfigError("bad sweep grid", bad)
    count = 1
    for values in grid.values():
        count *= len(values)
    if count > MAX_COMBINATIONS:
        raise ConfigError("sweep too large", [FieldViolation(
            "grid", f"{count} combinations; at most {MAX_COMBINATIONS} jobs per sweep")])
    return {key: list(values) for key, values in grid.items()}


def combinations(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid's values, the last axis varying fastest."""
    keys = list(grid)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*(grid[k] for k in keys))]


def overrides_of(params: Mapping[str, Any]) -> list[str]:
    """`--set` strings for one combination (values as TOML literals: JSON scalars and arrays are ones)."""
    return [f"{key}={json.dumps(value)}" for key, value in params.items()]


def label(params: Mapping[str, Any]) -> str:
    """`learning_rate=1e-06,clip_eps=0.2`: the leaf names and values, for tables and plots."""
    return ",".join(f"{key.rsplit('.', 1)[-1]}={value}" for key, value in params.items())


def job_name(prefix: str, params: Mapping[str, Any]) -> str:
    """A job name (letters, digits, `_.-`, at most 128) that says the combination: `grid_learning_rate-1e-06`."""
    parts = "_".join(f"{key.rsplit('.', 1)[-1]}-{value}" for key, value in params.items())
    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"{prefix}_{parts}")[:128]


@dataclass
class SweepRow:
    """One combination's job and how it ended."""

    params: dict[str, Any]
    job_id: str
    state: str = "queued"
    reason: str = ""
    steps: int = 0
    final_reward: float | None = None
    pass_at_1: float | None = None
    wall_s: float | None = None
    history: list[StepInfo] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"params": self.params, "job_id": self.job_id, "state": self.state, "reason": self.reason,
                "steps": self.steps, "final_reward": self.final_reward, "pass_at_1": self.pass_at_1,
                "wall_s": self.wall_s}


class Sweep:
    """The jobs of one sweep: wait for them, cancel them, read their rows."""

    def __init__(self, client: Client, runs: list[tuple[dict[str, Any], Run]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self._clock = client, clock
        self.rows = [SweepRow(params, run.job_id) for params, run in runs]
        self._running_since: dict[str, float] = {}

    @property
    def job_ids(self) -> list[str]:
        return [row.job_id for row in self.rows]

    def poll(self) -> bool:
        """Refresh every unfinished row once; True when all have ended."""
        now = self._clock()
        for row in self.rows:
            if row.state in TERMINAL_STATES:
                continue
            job = self.client.get_job(row.job_id)
            if job.state != "queued":
                self._running_since.setdefault(row.job_id, now)
            if job.done:
                self._finish(row, job, now)
            else:
                row.state = job.state
        return all(row.state in TERMINAL_STATES for row in self.rows)

    def wait(self, timeout_s: float | None = None, poll_s: float = 1.0,
             on_change: Callable[[Sweep], None] | None = None) -> list[SweepRow]:
        """Block until every job has ended (DeadlineExceeded after timeout_s, jobs left as they are)."""
        deadline = None if timeout_s is None else self._clock() + timeout_s
        while True:
            before = [(r.state, r.steps) for r in self.rows]
            finished = self.poll()
            if on_change is not None and before != [(r.state, r.steps) for r in self.rows]:
                on_change(self)
            if finished:
                return self.rows
            if deadline is not None and self._clock() >= deadline:
                raise DeadlineExceeded(f"sweep not finished after {timeout_s}s: "
                                       f"{sum(r.state not in TERMINAL_STATES for r in self.rows)}"
                                       f" of {len(self.rows)} jobs still queued or running")
            time.sleep(poll_s)

    def cancel(self, reason: str = "sweep cancelled") -> None:
        """Cancel every job of the sweep that has not ended."""
        for row in self.rows:
            if row.state not in TERMINAL_STATES:
                job = self.client.cancel_job(row.job_id, reason)
                row.state, row.reason = job.state, job.reason

    def _finish(self, row: SweepRow, job: JobInfo, now: float) -> None:
        row.state, row.reason = job.state, job.reason
        row.history = list(self.client.run(row.job_id).watch())
        row.steps = row.history[-1].step if row.history else 0
        rewards = [s.values["reward_mean"] for s in row.history if "reward_mean" in s.values][-FINAL_STEPS:]
        row.final_reward = sum(rewards) / len(rewards) if rewards else None
        evals = [s.values[PASS_AT_1] for s in row.history if PASS_AT_1 in s.values]
        row.pass_at_1 = evals[-1] if evals else None
        started = self._running_since.get(row.job_id)
        row.wall_s = now - started if started is not None else None


def submit(client: Client, grid: Mapping[str, Sequence[Any]], job_file: str | Path | None = None, *,
           overrides: Sequence[str] = (), name: str | None = None, **run_kwargs: Any) -> Sweep:
    """Submit one job per combination: from job_file (with --set style overrides), or from
    Client.create_run's keyword arguments. A failed submission cancels the jobs already submitted."""
    grid = check_grid(grid)
    runs: list[tuple[dict[str, Any], Run]] = []
    try:
        for params in combinations(grid):
            if job_file is not None:
                sets = [*overrides, *overrides_of(params)]
                if name is not None:
                    sets.append(f"name={json.dumps(job_name(name, params))}")
                job = client.submit_file(job_file, sets)
                runs.append((params, client.run(job.job_id)))
            else:
                runs.append((params, client.create_run(name=job_name(name or "sweep", params),
                                                       **{**run_kwargs, **params})))
    except BaseException:
        Sweep(client, runs).cancel("sweep submission failed")
        raise
    return Sweep(client, runs)


def plot(path: Path, rows: Sequence[SweepRow]) -> None:
    """Reward per step, one line per combination."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows:
        points = [(s.step, s.values["reward_mean"]) for s in row.history if "reward_mean" in s.values]
        if points:
            ax.plot(*zip(*points, strict=True), marker=".", label=f"{label(row.params)} ({row.state})")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
