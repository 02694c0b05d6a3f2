"""Soak: a 10,000-prompt job on the whole local fleet for a set time; memory, bounded structures, ledger.

`python -m bench.soak --json [--minutes 30 --interval-s 60 --actors 2 --prompts 10000 --latency-s 0.05]`
prints one JSON object. Not in CI.

The fleet is `fleetrl.launcher.fleet.Fleet` as `fleetrl up` starts it (embedded NATS + Valkey, gateway,
replay, reward, learner, `--actors` actors), every torch process on one thread, the actors on the fixed
backend (`FLEETRL_ACTOR_BACKEND=fixed`: each group's generation sleeps `--latency-s` and costs no CPU,
so the run exercises the fleet's own machinery for as many steps as the time allows). The job
(tiny-llama, `--prompts` addition prompts, 4 prompts x 4 samples a step, max_steps far beyond what the
time allows) runs for `--minutes`; then its ledger is taken while it still runs (the ledger is built to
be asked on demand: tasks in flight are counted as such) and the job is cancelled.

Every `--interval-s` (default 60 s, or a tenth of a run shorter than 10 minutes) it samples:
- the RSS of every service process: gateway, replay, reward (its main process, and with its sandbox
  workers), learner, each actor, nats-server and valkey-server (/proc/<pid>/status VmRSS);
- the job's step, and its ledger counts (GetJobAccounting).
It reports:
- rss_slope_mb_per_min per process: the least-squares slope of RSS over time, from the sample at which
  the job's first step was done (model loads and first-touch allocations come before), with the
  first and last RSS (MB) and their difference; a process restarted during the run is reported as such;
- structures: the sizes of the job's dedup and lineage structures against their bounds. Replay:
  `seen` (every task id ever inserted, the insert dedup; bound: the tasks published), `lin` (lineage
  records; bound: replay's `max_lineage_records`), `data` (stored groups; bound: the table's
  `capacity_groups`), `done` (committed lease ids; bound: those committed in the last 7 days); the
  ledger's `pub` and `fate` (bound: the tasks published) and `steps` (bound: the steps trained);
  JetStream: FLEET_TASKS messages of the job (bound: the feeder's in-flight bound) and the job's
  weight object store (bound: `keep_weight_versions` snapshots);
- ledger: the final counts, `balanced`, and lost / duplicated at every sample. A sample taken while the
  feeder tops up can count a task as lost that it has recorded and not yet published (the ledger's
  record-then-publish window, see `fleetrl.tasks.ledger`); the final accounting is the verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis

from fleetrl.launcher.fleet import Fleet, FleetOptions
from fleetrl.replay.table import prefix as replay_prefix
from fleetrl.sdk.client import Client, Run
from fleetrl.tasks import bus
from fleetrl.tasks.ledger import PREFIX as LEDGER_PREFIX

PPS, SAMPLES, STALENESS = 4, 4, 1
QUIET = {"FLEETRL_TRACING": "0", "TOKENIZERS_PARALLELISM": "false"}


def prompts_file(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"What is {i % 97} + {i // 97}?", "answer": str(i % 97 + i // 97)})
                            + "\n" for i in range(n)))
    return path


def rss_mb(pid: int) -> float | None:
    """Resident set size of a live process in MB, None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def descendants(pid: int) -> list[int]:
    """Every process below pid (from /proc/<pid>/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*") if Path(f"/proc/{parent}").exists() else []:
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def service_pids(fleet: Fleet) -> dict[str, int]:
    pids = {name: child.pid for name, child in fleet.supervisor.children.items() if child.pid}
    if fleet.infra is not None:
        for name, server in (("nats-server", fleet.infra.nats), ("valkey-server", fleet.infra.valkey)):
            if server.proc is not None:
                pids[name] = server.proc.pid
    return pids


def sample_rss(pids: dict[str, int]) -> dict[str, float | None]:
    rss = {name: rss_mb(pid) for name, pid in pids.items()}
    if "reward" in pids:  # the sandbox workers are the reward service's too
        workers = [rss_mb(pid) for pid in descendants(pids["reward"])]
        main = rss["reward"]
        rss["reward+workers"] = None if main is None else main + sum(w for w in workers if w is not None)
    return rss


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) points, in MB per minute."""
    if len(points) < 2:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60 * sum((t - mean_t) * (v - mean_v) for t, v in points) / var


def memory_report(samples: list[dict[str, Any]], restarted: dict[str, int]) -> dict[str, Any]:
    warm = next((i for i, s in enumerate(samples) if s["step"] >= 1), 0)
    kept = samples[warm:]
    report: dict[str, Any] = {}
    for name in sorted({n for s in samples for n in s["rss_mb"]}):
        points = [(s["t_s"], s["rss_mb"][name]) for s in kept if s["rss_mb"].get(name) is not None]
        if not points:
            continue
        slope = slope_per_min(points)
        report[name] = {"slope_mb_per_min": None if slope is None else round(slope, 3),
                        "first_mb": round(points[0][1], 1), "last_mb": round(points[-1][1], 1),
                        "delta_mb": round(points[-1][1] - points[0][1], 1), "samples": len(points),
                        "restarts": restarted.get(name, 0)}
    return {"from_sample": warm, "from_t_s": kept[0]["t_s"] if kept else None, "processes": report}


def structures(redis_url: str, nats_url: str, job_id: str, steps: int, max_lineage: int,
               capacity: int, keep: int) -> dict[str, Any]:
    """Sizes of the job's dedup and lineage structures, each with its bound."""
    p, ledger = replay_prefix(job_id), f"{LEDGER_PREFIX}{job_id}:"
    with redis.Redis.from_url(redis_url, socket_timeout=10) as r:
        published = int(r.scard(ledger + "pub"))
        sizes = {
            "replay_seen": (int(r.scard(p + "seen")), published, "tasks published"),
            "replay_lineage": (int(r.hlen(p + "lin")), max_lineage, "replay max_lineage_records"),
            "replay_stored_groups": (int(r.hlen(p + "data")), capacity, "table capacity_groups"),
            "replay_committed_leases": (int(r.zcard(p + "done")), None, "commits of the last 7 days"),
            "ledger_published": (published, published, "tasks published"),
            "ledger_fates": (int(r.hlen(ledger + "fate")), published, "tasks published"),
            "ledger_steps": (int(r.hlen(ledger + "steps")), steps + 1,
                             "steps reported, + 1: a step is recorded in the ledger before it is reported"),
        }
        redis_mb = int(r.info("memory")["used_memory"]) / 1e6
    out: dict[str, Any] = {name: {"size": size, "bound": bound, "bound_is": what,
                                  "within": bound is None or size <= bound}
                           for name, (size, bound, what) in sizes.items()}
    out.update(asyncio.run(stream_sizes(nats_url, job_id, keep)))
    out["redis_used_mb"] = round(redis_mb, 1)
    return out


async def stream_sizes(nats_url: str, job_id: str, keep: int) -> dict[str, Any]:
    nc = await bus.connect(nats_url, "bench.soak")
    try:
        js = bus.jetstream(nc)
        in_stream = len(await bus.job_tasks_in_stream(js, job_id))
        bound = PPS * (STALENESS + 1)
        weights = await js.stream_info(f"OBJ_{bus.weights_bucket(job_id)}")
        return {
            "task_stream_messages": {"size": in_stream, "bound": bound, "within": in_stream <= bound,
                                     "bound_is": "the feeder's in-flight bound: prompts_per_step x "
                                                 "(max_staleness + 1)"},
            "weight_objects_bytes": {"size": weights.state.bytes, "bound_is": f"about {keep} snapshots",
                                     "messages": weights.state.messages},
        }
    finally:
        await nc.close()


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        run_dir = Path(tmp)
        prompts = prompts_file(run_dir / "prompts.jsonl", args.prompts)
        env = {**QUIET, "FLEETRL_ACTOR_BACKEND": "fixed", "FLEETRL_ACTOR_FIXED_LATENCY_S": str(args.latency_s),
               "FLEETRL_ACTOR_TORCH_THREADS": "1", "FLEETRL_LEARNER_TORCH_THREADS": "1",
               "FLEETRL_ACTOR_POLL_INTERVAL_S": "0.5", "FLEETRL_LEARNER_SAMPLE_WAIT_S": "0.5",
               "FLEETRL_LEARNER_CLAIM_POLL_S": "0.5"}
        fleet = Fleet(FleetOptions(run_dir=run_dir, actors=args.actors, metrics=False, extra_env=env))
        stop = threading.Event()
        try:
            layout = fleet.start()
            threading.Thread(target=fleet.serve, args=(stop,), name="fleet-serve", daemon=True).start()
            with Client(layout.addresses["gateway"]) as client:
                return soak(fleet, client, prompts, args, layout.redis_url, layout.nats_url)
        finally:
            stop.set()
            fleet.stop()


def soak(fleet: Fleet, client: Client, prompts: Path, args: argparse.Namespace, redis_url: str,
         nats_url: str) -> dict[str, Any]:
    duration_s = args.minutes * 60
    interval_s = args.interval_s or min(60.0, duration_s / 10)
    run = client.create_run("tiny-llama", prompts, reward_builtin="numeric_match", name="soak", seed=3,
                            learning_rate=1e-4, prompts_per_step=PPS, samples_per_prompt=SAMPLES,
                            max_new_tokens=8, max_steps=10_000_000, max_staleness=STALENESS,
                            checkpoint_interval=20)
    started = time.monotonic()
    samples: list[dict[str, Any]] = []
    while True:
        samples.append(take_sample(fleet, client, run, started))
        if run.status().done:
            break
        if time.monotonic() - started >= duration_s:
            break
        time.sleep(max(0.0, started + len(samples) * interval_s - time.monotonic()))
    info = run.status()
    final = client.accounting(run.job_id)
    steps = info.last.step if info.last else 0
    spec = client.get_job(run.job_id).spec
    sizes = structures(redis_url, nats_url, run.job_id, steps, args.max_lineage_records,
                       int(spec["replay"]["capacity_groups"]), int(spec["train"]["keep_weight_versions"]))
    if not info.done:
        run.cancel("soak over")
    wall_s = time.monotonic() - started
    restarted = {name: child.restarts for name, child in fleet.supervisor.children.items()}
    return {
        "minutes": args.minutes, "interval_s": interval_s, "actors": args.actors, "prompts": args.prompts,
        "latency_s": args.latency_s, "job_id": run.job_id, "job_state_at_end": info.state, "steps": steps,
        "wall_s": round(wall_s, 1), "steps_per_min": round(steps / (wall_s / 60), 2),
        "memory": memory_report(samples, restarted),
        "structures": sizes,
        "ledger": {"counts": final.counts, "balanced": final.balanced,
                   "lost_per_sample": [s["ledger"].get("lost") for s in samples],
                   "duplicated_per_sample": [s["ledger"].get("duplicated") for s in samples]},
        "samples": samples,
    }


def take_sample(fleet: Fleet, client: Client, run: Run, started: float) -> dict[str, Any]:
    info = run.status()
    try:
        counts = client.accounting(run.job_id).counts
    except Exception as error:  # a sample, not the verdict: the final accounting below must answer
        counts = {"error": str(error)}  # type: ignore[dict-item]
    return {"t_s": round(time.monotonic() - started, 1), "step": info.last.step if info.last else 0,
            "rss_mb": {k: None if v is None else round(v, 1) for k, v in sample_rss(service_pids(fleet)).items()},
            "ledger": counts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the job runs (default 30)")
    parser.add_argument("--interval-s", type=float, default=0.0,
                        help="seconds between samples (default 60, or a tenth of a run under 10 minutes)")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=10_000)
    parser.add_argument("--latency-s", type=float, default=0.05, help="the fixed backend's seconds per group")
    parser.add_argument("--max-lineage-records", type=int, default=1_000_000,
                        help="replay's max_lineage_records (its default), the lineage bound reported")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run_soak(args)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
