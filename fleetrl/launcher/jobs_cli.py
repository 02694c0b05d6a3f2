"""`fleetrl submit|status|watch|cancel|delete|jobs|download|sweep`: the job commands, over the Python client.

`fleetrl jobs account JOB [--tasks]` prints a job's end-to-end ledger (GetJobAccounting) and exits
1 unless it balances.

Human output (rich tables and a live progress bar) by default, `--json` for scripts: `submit`,
`status JOB`, `cancel` and `download` print one JSON object, `jobs` and `status` without a job one
JSON array, `watch` one JSON object per line per event; an error is one JSON object on stderr,
`{"error", "code", "violations"}`. Exit codes: 0 ok; 2 bad input (invalid spec or override,
unreadable job file or CA file, malformed or unknown job id, a download directory that cannot be
written: ConfigError / InvalidArgument / NotFound); 1 any other failure (gateway unreachable,
authentication, ...). `watch` (and `submit --watch`) also exit 1 when the job ends failed or
cancelled, so a script can chain on it. `sweep` submits one job per combination of its `--grid`
axes, waits for all, and prints a comparison (`--json`: one object with every row); it exits 1
unless every job succeeded, and Ctrl-C cancels the sweep's unfinished jobs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fleetrl.errors import ConfigError, FleetError, InvalidArgument, NotFound, grpc_code
from fleetrl.sdk import sweep
from fleetrl.sdk.client import Client
from fleetrl.sdk.records import AccountingInfo, JobInfo, StepInfo

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT = 0, 1, 2
BAD_INPUT = (ConfigError, InvalidArgument, NotFound)


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--gateway", help="gateway address host:port (env FLEETRL_GATEWAY)")
    common.add_argument("--token", help="bearer token (env FLEETRL_TOKEN)")
    common.add_argument("--ca-file", help="PEM CA certificate of a TLS gateway (env FLEETRL_CA_FILE)")
    common.add_argument("--tls", action="store_true", default=None,
                        help="TLS with gRPC's default root CAs, when no --ca-file is given (env FLEETRL_TLS=1)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    top = argparse.ArgumentParser(prog="fleetrl", description="Submit and follow fleetrl jobs.")
    sub = top.add_subparsers(dest="command", required=True)
    p = sub.add_parser("submit", parents=[common], help="submit a job TOML")
    p.add_argument("job_file", type=Path)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    p.add_argument("--idempotency-key", default="", help="resubmitting with the same key returns the same job")
    p.add_argument("--watch", action="store_true", help="watch the job after submitting it")
    p = sub.add_parser("status", parents=[common], help="one job, or a table of your jobs")
    p.add_argument("job_id", nargs="?")
    p = sub.add_parser("jobs", parents=[common], help="table of your jobs, or `jobs account JOB`: a job's ledger")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("action", nargs="?", choices=["account"],
                   help="account: what became of every task the job published")
    p.add_argument("job_id", nargs="?")
    p.add_argument("--tasks", action="store_true", help="with account: list every task, not only the counts")
    sub.add_parser("watch", parents=[common], help="follow a job until it ends").add_argument("job_id")
    p = sub.add_parser("cancel", parents=[common], help="cancel a job")
    p.add_argument("job_id")
    p.add_argument("--reason", default="")
    p = sub.add_parser("delete", parents=[common], help="delete a finished job's data from every store")
    p.add_argument("job_id")
    p = sub.add_parser("sweep", parents=[common], help="submit a grid of jobs and compare them when they end")
    p.add_argument("job_file", type=Path)
    p.add_argument("--grid", action="append", required=True, metavar="KEY=[V1,V2,...]",
                   help="an axis of the grid (repeat for more axes)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    p.add_argument("--name", help="name prefix of the sweep's jobs")
    p.add_argument("--plot", type=Path, help="write reward curves of every combination to this PNG")
    p.add_argument("--timeout", type=float, default=None, help="give up waiting after this many seconds")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between status polls")
    p = sub.add_parser("download", parents=[common], help="download a succeeded job's model (a LoRA job's adapters)")
    p.add_argument("job_id")
    p.add_argument("dir", type=Path)
    p.add_argument("--merged", action="store_true",
                   help="a LoRA job's merged full HF model instead of its PEFT adapter directory")
    return top


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    out = Console(soft_wrap=True)
    try:
        with Client(args.gateway, token=args.token, ca_file=args.ca_file, tls=args.tls) as client:
            return COMMANDS[args.command](client, args, out)
    except BAD_INPUT as error:
        report(error, args.json)
        return EXIT_BAD_INPUT
    except FleetError as error:
        report(error, args.json)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_FAILURE


def report(error: FleetError, as_json: bool) -> None:
    """The error on stderr: a message and one line per bad field, or one JSON object."""
    if as_json:
        print(json.dumps({"error": str(error), "code": grpc_code(error).name,
                          "violations": [{"field": f, "description": d} for f, d in _violations(error)]}),
              file=sys.stderr)
        return
    err = Console(stderr=True, soft_wrap=True)
    message = str(error).split(": ")[0] if _violations(error) else str(error)
    err.print(f"[bold red]error:[/] {type(error).__name__}: {message}", highlight=False)
    for field, description in _violations(error):
        err.print(f"  {field}: {description}", highlight=False, markup=False)


def _violations(error: FleetError) -> list[tuple[str, str]]:
    return [(v.field, v.description) for v in getattr(error, "violations", [])]


# ----------------------------------------------------------------------------- commands

def cmd_submit(client: Client, args: argparse.Namespace, out: Console) -> int:
    job = client.submit_file(args.job_file, args.set, idempotency_key=args.idempotency_key)
    if args.json:
        print(job.to_json())
    else:
        out.print(f"submitted [bold]{job.job_id}[/] ({job.name}), {job.state}", highlight=False)
    return watch_job(client, job.job_id, args.json, out) if args.watch else EXIT_OK


def cmd_status(client: Client, args: argparse.Namespace, out: Console) -> int:
    if args.job_id is None:
        return cmd_jobs(client, args, out)
    job = client.get_job(args.job_id)
    if args.json:
        print(job.to_json())
    else:
        out.print(job_detail(job))
    return EXIT_OK


def cmd_jobs(client: Client, args: argparse.Namespace, out: Console) -> int:
    if getattr(args, "action", None) == "account":
        return cmd_account(client, args, out)
    jobs = client.list_jobs(getattr(args, "limit", 50))
    if args.json:
        print(json.dumps([asdict(j) for j in jobs]))
    else:
        out.print(jobs_table(jobs))
    return EXIT_OK


def cmd_account(client: Client, args: argparse.Namespace, out: Console) -> int:
    """`fleetrl jobs account JOB`: exit 0 when the ledger balances (nothing lost or trained twice), else 1."""
    if not args.job_id:
        raise InvalidArgument("jobs account: which job? (fleetrl jobs account JOB)")
    accounting = client.accounting(args.job_id, include_tasks=args.tasks)
    if args.json:
        print(json.dumps(accounting.to_dict()))
    else:
        out.print(accounting_table(accounting))
    return EXIT_OK if accounting.balanced else EXIT_FAILURE


def cmd_watch(client: Client, args: argparse.Namespace, out: Console) -> int:
    return watch_job(client, args.job_id, args.json, out)


def cmd_cancel(client: Client, args: argparse.Namespace, out: Console) -> int:
    job = client.cancel_job(args.job_id, args.reason)
    if args.json:
        print(job.to_json())
    else:
        out.print(f"{job.job_id}: {job.state}{f' ({job.reason})' if job.reason else ''}", highlight=False)
    return EXIT_OK


def cmd_delete(client: Client, args: argparse.Namespace, out: Console) -> int:
    held = client.delete_job(args.job_id)
    if args.json:
        print(json.dumps({"job_id": args.job_id, **asdict(held)}))
    else:
        out.print(f"{args.job_id}: deleted {held.redis_keys} Redis keys ({held.redis_bytes} bytes), "
                  f"{held.nats_messages} NATS messages ({held.nats_bytes} bytes), {held.disk_files} files "
                  f"({held.disk_bytes} bytes)", highlight=False)
    return EXIT_OK


def cmd_download(client: Client, args: argparse.Namespace, out: Console) -> int:
    path = client.download_model(args.job_id, args.dir, merged=args.merged)
    files = sorted(p for p in path.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in files)
    if args.json:
        print(json.dumps({"job_id": args.job_id, "dir": str(path), "files": len(files), "bytes": size}))
    else:
        out.print(f"{args.job_id}: {len(files)} files, {size / 1e6:.1f} MB in {path}", highlight=False)
    return EXIT_OK


def cmd_sweep(client: Client, args: argparse.Namespace, out: Console) -> int:
    """Submit the grid, follow it (a line per change), then print the comparison; Ctrl-C cancels it."""
    grid = sweep.parse_grid(args.grid)
    run = client.sweep(grid, args.job_file, overrides=args.set, name=args.name)
    if not args.json:
        out.print(f"sweep: {len(run.rows)} jobs submitted: {' '.join(run.job_ids)}", highlight=False)
    progress = None if args.json else (lambda s: out.print(sweep_progress(s), highlight=False))
    try:
        rows = run.wait(args.timeout, args.poll, on_change=progress)
    except BaseException:
        run.cancel("sweep interrupted")
        raise
    if args.plot is not None:
        sweep.plot(args.plot, rows)
    if args.json:
        print(json.dumps({"grid": grid, "rows": [r.to_dict() for r in rows]}))
    else:
        out.print(sweep_table(rows))
        if args.plot is not None:
            out.print(f"reward curves: {args.plot}", highlight=False)
    return EXIT_OK if all(r.state == "succeeded" for r in rows) else EXIT_FAILURE


COMMANDS: dict[str, Callable[[Client, argparse.Namespace, Console], int]] = {
    "submit": cmd_submit, "status": cmd_status, "jobs": cmd_jobs, "watch": cmd_watch,
    "cancel": cmd_cancel, "delete": cmd_delete, "download": cmd_download, "sweep": cmd_sweep,
}


def sweep_progress(run: sweep.Sweep) -> str:
    counts: dict[str, int] = {}
    for row in run.rows:
        counts[row.state] = counts.get(row.state, 0) + 1
    return "sweep: " + ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))


def sweep_table(rows: list[sweep.SweepRow]) -> Table:
    """Best final reward first; a job without steps or eval shows a dash."""
    table = Table(title=f"sweep of {len(rows)} jobs (final reward: mean of the last {sweep.FINAL_STEPS} steps)")
    for column in ("params", "job", "state", "steps", "final reward", "held-out pass@1", "wall s"):
        table.add_column(column, justify="left" if column in ("params", "job", "state") else "right")

    def cell(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for row in sorted(rows, key=lambda r: (r.final_reward is None, -(r.final_reward or 0.0))):
        table.add_row(sweep.label(row.params), row.job_id, row.state + (f" ({row.reason})" if row.reason else ""),
                      str(row.steps), cell(row.final_reward, ".3f"), cell(row.pass_at_1, ".3f"),
                      cell(row.wall_s, ".0f"))
    return table


# ----------------------------------------------------------------------------- watch

def watch_job(client: Client, job_id: str, as_json: bool, out: Console) -> int:
    """Follow the job to its end (progress bar or JSON lines); exit 0 only if it succeeded."""
    steps: list[StepInfo] = []
    final: JobInfo | None = None
    started = time.monotonic()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[metrics]}"), TimeElapsedColumn(), console=out,
                  disable=as_json, transient=False) as bar:
        task = bar.add_task(job_id, total=None, metrics="")
        for event in client.watch_job(job_id):
            final = event.job
            if as_json:
                print(json.dumps({"job_id": job_id, "state": event.state,
                                  "step": asdict(event.step) if event.step else None}), flush=True)
            if event.step is not None:
                steps.append(event.step)
            bar.update(task, total=event.job.max_steps or None, completed=steps[-1].step if steps else 0,
                       description=f"{job_id} {event.job.state}", metrics=step_line(steps[-1]) if steps else "")
    if final is None:
        return EXIT_FAILURE
    if not as_json:
        out.print(summary_table(final, steps, time.monotonic() - started))
    return EXIT_OK if final.state == "succeeded" else EXIT_FAILURE


def step_line(step: StepInfo) -> str:
    parts = [f"{label} {step.values[key]:.3g}" for key, label in
             (("reward_mean", "reward"), ("kl", "KL"), ("tokens_per_s", "tok/s")) if key in step.values]
    return "  ".join(parts)


def summary_table(job: JobInfo, steps: list[StepInfo], elapsed_s: float) -> Table:
    table = Table(title=f"{job.job_id} ({job.name}): {job.state}" + (f" - {job.reason}" if job.reason else ""))
    for column in ("metric", "first", "last", "min", "max"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    keys = sorted({k for s in steps for k in s.values})
    for key in keys:
        series = [s.values[key] for s in steps if key in s.values]
        table.add_row(key, *(f"{v:.4g}" for v in (series[0], series[-1], min(series), max(series))))
    table.caption = f"{len(steps)} steps watched in {elapsed_s:.1f}s" + (
        f"; model at {job.model_uri}" if job.model_uri else "")
    return table


def accounting_table(accounting: AccountingInfo) -> Table:
    """Counts, then (when asked for) one row per task that was not simply trained once."""
    table = Table(title=f"ledger of {accounting.job_id}: " + ("balanced" if accounting.balanced else "NOT balanced"))
    for column in ("task", "fate", "steps", "reason"):
        table.add_column(column)
    for task in accounting.tasks:
        if task.fate != "trained" or len(task.steps) > 1:
            table.add_row(task.task_id, task.fate, ",".join(map(str, task.steps)), task.reason)
    table.caption = "  ".join(f"{name} {count}" for name, count in accounting.counts.items())
    return table


def job_detail(job: JobInfo) -> Table:
    table = Table(show_header=False, title=f"job {job.job_id}")
    rows: list[tuple[str, Any]] = [
        ("name", job.name), ("tenant", job.tenant), ("state", job.state), ("reason", job.reason),
        ("model", job.spec.get("model", "")), ("step", f"{job.last.step if job.last else 0}/{job.max_steps}"),
        ("created", _when(job.created_unix_ms)), ("updated", _when(job.updated_unix_ms)),
        ("model_uri", job.model_uri),
        ("sandbox", job.sandbox + (" (the operator's weaker legacy mode)" if job.sandbox.startswith("mode legacy")
                                   else "")),
    ]
    if job.last is not None:
        rows.append(("last metrics", step_line(job.last)))
    for key, value in rows:
        if value:
            table.add_row(key, str(value))
    return table


def jobs_table(jobs: list[JobInfo]) -> Table:
    table = Table(title=f"{len(jobs)} jobs")
    for column in ("job", "name", "state", "step", "reward", "created"):
        table.add_column(column)
    for job in jobs:
        reward = job.last.values.get("reward_mean") if job.last else None
        table.add_row(job.job_id, job.name, job.state, f"{job.last.step if job.last else 0}/{job.max_steps}",
                      "" if reward is None else f"{reward:.3g}", _when(job.created_unix_ms))
    return table


def _when(unix_ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_ms / 1000)) if unix_ms else ""


if __name__ == "__main__":
    sys.exit(main())
