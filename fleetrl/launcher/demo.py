"""`fleetrl demo`: train SmolLM2-135M on two-digit addition end to end, then write a report.

One command on a fresh machine: start a local fleet (or use the one recorded in the run
directory, or `--gateway`), submit `examples/addition/job.toml` through the Python client,
show each step live, wait for the job, download the trained model, stop the fleet it started,
and write the report of `fleetrl.launcher.report` into the run directory.

`--warm-start SFT_TOML` trains an sft job first, on the same fleet, and submits the job with
`model = "job:<the sft job>"`: the RL job starts from the sft model, and the report evaluates the
base, the sft and the trained model on the same held-out problems.

Design choice: the demo is a client of the fleet like any user script. It submits the job
TOML through the gateway, reads metrics only from `WatchJob` and gets the model only through
`DownloadModel`, so it works the same against a remote gateway. The evaluation runs here after
the fleet has stopped, on the whole machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fleetrl.errors import ConfigError, FieldViolation, FleetError, InvalidArgument, NotFound
from fleetrl.launcher.cli import add_placement_flags
from fleetrl.launcher.fleet import Fleet, FleetLayout, FleetOptions, model_admission
from fleetrl.launcher.report import EVAL_SAMPLES, Trained
from fleetrl.policy.models import JOB_MODEL_PREFIX
from fleetrl.sdk.client import Client, Run, load_job_file
from fleetrl.sdk.records import JobInfo, StepInfo
from fleetrl.spec.config import JobSpec, parse_job_spec, read_bytes
from fleetrl.spec.prompts import read_prompts

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT = 0, 1, 2
BAD_INPUT = (ConfigError, InvalidArgument, NotFound)
EXAMPLES = Path(str(resources.files("fleetrl.launcher") / "examples"))
"""The example jobs, package data of `fleetrl.launcher` (so a wheel has them; a checkout links ./examples here)."""
DEFAULT_JOB = EXAMPLES / "addition" / "job.toml"
DEFAULT_EVAL = EXAMPLES / "addition" / "eval.jsonl"
SUPERVISE_S = 0.25
COMPONENT_LABELS = {"reward/correct": "acc"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleetrl demo", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--dir", type=Path, default=Path("runs/demo"), help="run directory (default runs/demo)")
    p.add_argument("--actors", type=int, default=1, help="actors of a fleet the demo starts (default 1)")
    p.add_argument("--model", help="model to train (default: the job's, smollm2-135m); tiny-* for a quick check")
    p.add_argument("--max-steps", type=int, help="optimizer steps (default: the job's)")
    p.add_argument("--eval-problems", type=int, default=100, help="held-out problems evaluated (default 100)")
    p.add_argument("--eval-samples", type=int, default=EVAL_SAMPLES,
                   help=f"sampled completions a problem for pass@1 and pass@k (default {EVAL_SAMPLES}; 0: greedy only)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a job spec field")
    p.add_argument("--job", type=Path, default=DEFAULT_JOB, help="job TOML (default examples/addition/job.toml)")
    p.add_argument("--warm-start", type=Path, metavar="SFT_TOML",
                   help="an sft job to train first; the job then starts from its model, and the report evaluates "
                        "it too (--model applies to it, --set and --max-steps do not)")
    p.add_argument("--eval-file", type=Path, help="held-out prompts JSONL with answers (default: the job's directory's "
                                                  "eval.jsonl if it has one, else examples/addition/eval.jsonl)")
    p.add_argument("--gateway", help="use the fleet behind this gateway address instead of a local one")
    p.add_argument("--token", help="bearer token for --gateway (env FLEETRL_TOKEN)")
    add_placement_flags(p)
    return p


def main(argv: list[str]) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    out = Console(soft_wrap=True, highlight=False)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        return run(args, out)
    except BAD_INPUT as error:
        _report_error(error, out)
        return EXIT_BAD_INPUT
    except FleetError as error:
        _report_error(error, out)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        out.print("interrupted")
        return EXIT_FAILURE


def _interrupt(signum: int, _frame: object) -> None:
    """SIGTERM (`kill`, a container stop) ends the demo as Ctrl-C does: the job is cancelled and the fleet
    and its servers are stopped on the way out; without this handler the interpreter would exit at once
    and leave them running, holding their ports."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _report_error(error: FleetError, out: Console) -> None:
    out.print(f"[bold red]error:[/] {type(error).__name__}: {error}")
    for violation in getattr(error, "violations", []):
        out.print(f"  {violation.field}: {violation.description}", markup=False)


def run(args: argparse.Namespace, out: Console) -> int:
    """Check the inputs, train, report; exit 0 only when the job succeeded and the report is written."""
    overrides = job_overrides(args)
    payload = load_job_file(args.job, overrides)
    spec = parse_job_spec(payload.spec, "json")  # fail before starting anything
    sft_overrides = model_override(args)
    if args.warm_start:
        check_warm_start(parse_job_spec(load_job_file(args.warm_start, sft_overrides).spec, "json"), spec)
    problems = eval_problems(args.eval_file or eval_file_of(args.job), args.eval_problems)
    if args.eval_samples < 0:
        raise ConfigError("bad option", [FieldViolation("--eval-samples", "must be >= 0")])
    if not args.gateway:  # a local fleet loads the model on this machine: is it installed?
        from fleetrl.policy import models

        models.check_available(spec.model)
    run_dir = args.dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # the actors load a LoRA job's base before it is submitted (nothing to preload for a warm start: the RL
    # job trains the sft job's model, not spec.model)
    preload = spec.model if spec.train.lora is not None and not args.warm_start else None
    with fleet_address(args, run_dir, out, spec.model, preload) as address, Client(address, token=args.token) as client:
        warm = train(client, args.warm_start, sft_overrides, run_dir / "sft-model", out) if args.warm_start else None
        if warm is not None and warm.job.state != "succeeded":
            return EXIT_FAILURE
        start_from = [f"model={json.dumps(JOB_MODEL_PREFIX + warm.job.job_id)}"] if warm else []
        trained = train(client, args.job, overrides + start_from, run_dir / "model", out)
    from fleetrl.launcher import report  # torch and matplotlib only once there is something to report

    summary = report.write(run_dir, spec, trained.job, trained.steps, trained.model_dir, problems,
                           train_wall_s=trained.train_wall_s, out=out, samples=args.eval_samples,
                           environment_file=payload.environment_file, warm_start=warm)
    summary["wall_s"] = time.monotonic() - started
    (run_dir / report.REPORT_JSON).write_text(json.dumps(summary, indent=2) + "\n")
    report.print_summary(summary, out)
    return EXIT_OK if trained.job.state == "succeeded" else EXIT_FAILURE


def job_overrides(args: argparse.Namespace) -> list[str]:
    """`--set` overrides, with --model and --max-steps folded in."""
    if args.max_steps is not None and args.max_steps < 1:
        raise ConfigError("bad option", [FieldViolation("--max-steps", "must be >= 1")])
    overrides = list(args.set) + model_override(args)
    if args.max_steps is not None:
        overrides.append(f"train.max_steps={args.max_steps}")
    return overrides


def model_override(args: argparse.Namespace) -> list[str]:
    """--model as an override (none without it): the one that applies to a warm start's sft job too."""
    if not args.model:
        return []
    model = str(Path(args.model).resolve()) if Path(args.model).is_dir() else args.model  # the gateway wants /...
    return [f"model={json.dumps(model)}"]


def check_warm_start(sft: JobSpec, spec: JobSpec) -> None:
    """A warm start is an sft job of the model the job names (which is then the report's base model)."""
    problems = []
    if sft.algorithm.name != "sft":
        problems.append(FieldViolation("--warm-start", f"must be an sft job (algorithm.name = \"sft\"), not "
                                                       f"{sft.algorithm.name}"))
    if sft.model != spec.model:
        problems.append(FieldViolation("--warm-start", f"trains {sft.model}, but the job's model is {spec.model}"))
    if problems:
        raise ConfigError("bad option", problems)


def eval_file_of(job: Path) -> Path:
    """The held-out prompts beside a job file, or the addition task's."""
    beside = job.parent / "eval.jsonl"
    return beside if beside.is_file() else DEFAULT_EVAL


def eval_problems(path: Path, count: int) -> list[dict[str, Any]]:
    """The first `count` held-out problems (each with "prompt" and "answer", and any other fields: a
    multi-turn job's environment gets the whole line as its task)."""
    if count < 1:
        raise ConfigError("bad option", [FieldViolation("--eval-problems", "must be >= 1")])
    rows = read_prompts(read_bytes(path, "--eval-file"), "--eval-file")
    if len(rows) < count or not all("prompt" in r and "answer" in r for r in rows[:count]):
        raise ConfigError("bad eval file", [FieldViolation(
            "--eval-file", f"{path}: needs {count} lines with prompt and answer (has {len(rows)} lines)")])
    return [{**r, "prompt": str(r["prompt"]), "answer": str(r["answer"])} for r in rows[:count]]


# ----------------------------------------------------------------------------- the fleet


@contextlib.contextmanager
def fleet_address(args: argparse.Namespace, run_dir: Path, out: Console, model: str,
                  preload: str | None = None) -> Iterator[str]:
    """The gateway to use: --gateway, a fleet already running in run_dir, or a new one (stopped after)
    whose gateway allows `model` and whose actors preload `preload` (`ActorSettings.preload_models`)."""
    if args.gateway:
        yield args.gateway
        return
    layout = FleetLayout.read(run_dir)
    if layout is not None:
        out.print(f"using the fleet running in {run_dir} (gateway {layout.addresses['gateway']})")
        yield layout.addresses["gateway"]
        return
    if args.actors < 1:
        raise ConfigError("bad option", [FieldViolation("--actors", "must be >= 1")])
    allowed_models, model_roots = model_admission(model)
    options = FleetOptions(run_dir=run_dir, actors=args.actors, cores=args.cores,
                           learner_threads=args.learner_threads, actor_threads=args.actor_threads,
                           cores_mode=args.cores_mode, gpus=args.gpus, allowed_models=allowed_models,
                           model_roots=model_roots,
                           extra_env={"FLEETRL_ACTOR_PRELOAD_MODELS": json.dumps([preload])} if preload else {})
    with started_fleet(options, out) as layout:
        yield layout.addresses["gateway"]


@contextlib.contextmanager
def started_fleet(options: FleetOptions, out: Console) -> Iterator[FleetLayout]:
    """A fleet supervised from a background thread (crashed children restart) until the block ends."""
    fleet = Fleet(options)
    stop = threading.Event()
    supervising = threading.Thread(target=_supervise, args=(fleet, stop), name="fleet-supervisor", daemon=True)
    try:
        out.print(f"starting a fleet with {options.actors} actor(s) in {options.run_dir} ...")
        layout = fleet.start()
        supervising.start()
        out.print(f"fleet up: gateway {layout.addresses['gateway']}, logs in {layout.log_dir}")
        out.print("compute threads: " + ", ".join(f"{name} {n}" for name, n in layout.threads.items()))
        yield layout
    finally:
        stop.set()
        if supervising.is_alive():
            supervising.join()
        fleet.stop()
        out.print("fleet stopped")


def _supervise(fleet: Fleet, stop: threading.Event) -> None:
    while not stop.wait(SUPERVISE_S):
        for name in fleet.supervisor.poll():
            print(f"fleet: restarted {name}", flush=True)


# ----------------------------------------------------------------------------- training


def train(client: Client, job_file: Path, overrides: list[str], model_dir: Path, out: Console) -> Trained:
    """Submit the job, follow it to its end, and download its model into model_dir if it succeeded."""
    job = client.submit_file(job_file, overrides)
    out.print(f"submitted [bold]{job.job_id}[/] ({job.name}): {job.spec.get('model')}, {job.max_steps} steps")
    handle = Run(client, job.job_id)
    started = time.monotonic()
    try:
        final, steps = follow(handle, out)
    except KeyboardInterrupt:
        handle.cancel("demo interrupted")
        raise
    wall_s = time.monotonic() - started
    if final.state != "succeeded":
        out.print(f"[bold red]job {final.job_id} ended {final.state}[/]: {final.reason}")
        return Trained(final, steps, None, wall_s)
    out.print(f"job {final.job_id} succeeded in {wall_s:.0f}s; downloading the model ...")
    # merged: the report evaluates a whole model, also for a LoRA job (whose default download is its adapters)
    return Trained(final, steps, handle.download_model(model_dir, merged=True), wall_s)


def follow(handle: Run, out: Console) -> tuple[JobInfo, list[StepInfo]]:
    """Print each step (and a live bar on a terminal) until the job ends; its final state and steps."""
    steps: dict[int, StepInfo] = {}
    final = handle.status()
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=out, disable=not out.is_terminal) as bar:
        task = bar.add_task(handle.job_id, total=final.max_steps)
        for event in handle.events():
            final = event.job
            if event.state is not None:
                out.print(f"job {handle.job_id}: {event.state}")
            if event.step is not None and event.step.step not in steps:
                steps[event.step.step] = event.step
                out.print(step_line(event.step, final.max_steps))
                bar.update(task, completed=event.step.step)
    return final, [steps[k] for k in sorted(steps)]


def step_line(step: StepInfo, max_steps: int) -> str:
    """`step 3/40  reward 0.41  acc 0.22  format 0.38  exact 0.09  KL 0.002  tok/s 9  s/step 24.1`:
    the mean reward, each reward component (`correct` shown as acc), KL and throughput; an sft job's
    step shows its loss instead of a reward."""
    values = step.values
    parts = ([f"reward {values['reward_mean']:.3f}"] if "reward_mean" in values
             else [f"loss {values['loss']:.3f}"] if "loss" in values else [])
    parts += [f"{COMPONENT_LABELS.get(key, key[7:])} {values[key]:.2f}" for key in sorted(values)
              if key.startswith("reward/")]
    parts += [f"{label} {fmt.format(values[key])}" for key, label, fmt in
              (("kl", "KL", "{:.4f}"), ("tokens_per_s", "tok/s", "{:.0f}"), ("step_time_s", "s/step", "{:.1f}"))
              if key in values]
    return f"step {step.step}/{max_steps}  " + "  ".join(parts)
