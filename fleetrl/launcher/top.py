"""`fleetrl top`: a live terminal view of a running fleet, over the gateway's API only.

Each refresh (every second by default, on a fixed cadence: the calls' own time is not added to the
period) makes two calls: GetFleet (live actors and learners from their heartbeats, the task queue of
each of the caller's active jobs) and ListJobs (each job's last step: reward, staleness, tokens/s).
One frame shows actors (state, job, policy version, tokens/s, busy), learners (phase, job, step),
jobs (state, step, reward, staleness, queue) and tenants: the caller's share of the actors' time over
the last ~30 s against its fair share, and every other tenant's together (never their names).
With a Tinker API to ask, a third call (its `GET /api/v1/sessions`, with the same token) adds the
caller's live Tinker sessions: base model, LoRA rank, training runs, sampling sessions, optimizer steps,
age of the last request and state, read from the Tinker service's own session records.
`--once` prints one frame and exits (scripts, tests); `--json` prints the frame's data as one JSON
object per refresh instead. The gateway is `--gateway`,
else the one a local fleet recorded in `<--dir>/fleet.json`, else FLEETRL_GATEWAY, else 127.0.0.1:50051;
the Tinker API is `--tinker`, else the local fleet's (`fleetrl up --tinker`), else FLEETRL_TINKER_URL, else none.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from fleetrl.errors import FleetError
from fleetrl.launcher.fleet import FleetLayout
from fleetrl.sdk.client import ENV_TOKEN, Client
from fleetrl.sdk.records import FleetInfo, JobInfo, MemberInfo, QueueInfo, ShareInfo
from fleetrl.services.tinker.client import ENV_URL, TinkerClient
from fleetrl.tinker.types import SessionSummary

EXIT_OK, EXIT_FAILURE = 0, 1
JOBS_SHOWN = 10
SESSIONS_SHOWN = 50


@dataclass(frozen=True)
class Frame:
    """Everything one refresh shows."""

    gateway: str
    fleet: FleetInfo
    jobs: list[JobInfo]
    tinker: str | None = None
    """The Tinker API asked for sessions; None: none known (no sessions table)."""
    sessions: list[SessionSummary] | None = None
    all_tenants: bool = False
    """An operator's view: every tenant's jobs, shares and sessions, by name."""

    def to_dict(self) -> dict[str, Any]:
        jobs = [{"job_id": j.job_id, "tenant": j.tenant, "name": j.name, "state": j.state, "max_steps": j.max_steps,
                 "last": asdict(j.last) if j.last else None} for j in self.jobs]
        sessions = None if self.sessions is None else [asdict(s) for s in self.sessions]
        return {"gateway": self.gateway, **self.fleet.to_dict(), "jobs": jobs, "tinker": self.tinker,
                "sessions": sessions}


def parser(prog: str = "fleetrl top") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="live view of a running fleet (over the gateway)")
    p.add_argument("--gateway", help="gateway address host:port (env FLEETRL_GATEWAY)")
    p.add_argument("--dir", type=Path, help="run directory of a local fleet (`fleetrl up --dir`): its gateway")
    p.add_argument("--tinker", help="Tinker API address host:port or URL, for its sessions (env FLEETRL_TINKER_URL; "
                   "with --dir, the fleet's own when it runs one)")
    p.add_argument("--token", help="bearer token, also the Tinker API key (env FLEETRL_TOKEN)")
    p.add_argument("--all-tenants", action="store_true",
                   help="every tenant's jobs, shares and sessions (a token of a tenant in the services' operators)")
    p.add_argument("--interval", type=_seconds, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--json", action="store_true", help="JSON instead of tables (one object per refresh)")
    return p


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def gateway_address(args: argparse.Namespace) -> str | None:
    """--gateway, else the gateway of the fleet running in --dir, else None (the client's default)."""
    if args.gateway:
        return str(args.gateway)
    if args.dir is None:
        return None
    layout = FleetLayout.read(args.dir)
    if layout is None:
        raise FleetError(f"no running fleet recorded in {args.dir} (start one with `fleetrl up --dir {args.dir}`)")
    return layout.addresses["gateway"]


def tinker_client(args: argparse.Namespace) -> TinkerClient | None:
    """--tinker, else the Tinker API of the fleet running in --dir, else FLEETRL_TINKER_URL, else None."""
    address = args.tinker
    if address is None and args.dir is not None:
        layout = FleetLayout.read(args.dir)
        address = layout.addresses.get("tinker") if layout else None
    address = address or os.environ.get(ENV_URL)
    return TinkerClient(address, args.token or os.environ.get(ENV_TOKEN)) if address else None


def snapshot(client: Client, tinker: TinkerClient | None = None, all_tenants: bool = False) -> Frame:
    fleet = client.fleet(all_tenants=all_tenants)
    jobs = client.list_jobs(JOBS_SHOWN, all_tenants=all_tenants)
    if tinker is None:
        return Frame(client.address, fleet, jobs, all_tenants=all_tenants)
    return Frame(client.address, fleet, jobs, tinker.url, tinker.sessions(SESSIONS_SHOWN, all_tenants), all_tenants)


# ----------------------------------------------------------------------------- rendering


def render(frame: Frame) -> Group:
    actors = [m for m in frame.fleet.members if m.kind == "actor"]
    learners = [m for m in frame.fleet.members if m.kind == "learner"]
    when = time.strftime("%H:%M:%S", time.localtime(frame.fleet.unix_ms / 1000))
    tokens = sum(m.tokens_per_s for m in actors)
    head = Text(f"fleetrl top - gateway {frame.gateway} - {when} - {len(actors)} actors, "
                f"{len(learners)} learners, {tokens:.1f} generated tok/s", style="bold")
    sandbox = Text(f"reward sandbox: {frame.fleet.reward_sandbox or 'unknown'}",
                   style="bold red" if not frame.fleet.reward_sandbox.startswith("mode jail") else "")
    tables = [actors_table(actors), learners_table(learners),
              jobs_table(frame.jobs, frame.fleet.queues, with_tenant=frame.all_tenants),
              shares_table(frame.fleet.shares)]
    if frame.sessions is not None:
        tables.append(sessions_table(frame.sessions))
    return Group(head, sandbox, *tables)


def actors_table(actors: list[MemberInfo]) -> Table:
    table = Table(title="actors", title_justify="left", expand=True)
    for column in ("actor", "state", "job", "policy", "tok/s", "busy"):
        table.add_column(column, justify="right" if column in ("policy", "tok/s", "busy") else "left", no_wrap=True)
    for m in actors:
        table.add_row(m.member_id, m.state, m.job_id or "-", f"v{m.policy_version}" if m.job_id else "-",
                      f"{m.tokens_per_s:.1f}", f"{m.busy_fraction:.0%}")
    return table


def learners_table(learners: list[MemberInfo]) -> Table:
    table = Table(title="learners", title_justify="left", expand=True)
    for column in ("learner", "phase", "job", "step", "tok/s"):
        table.add_column(column, justify="right" if column in ("step", "tok/s") else "left", no_wrap=True)
    for m in learners:
        table.add_row(m.member_id, m.state, m.job_id or "-", str(m.policy_version) if m.job_id else "-",
                      f"{m.tokens_per_s:.1f}")
    return table


def jobs_table(jobs: list[JobInfo], queues: list[QueueInfo], with_tenant: bool = False) -> Table:
    by_job = {q.job_id: q for q in queues}
    table = Table(title="jobs (queue: queued / in flight / redelivered / dead-lettered tasks)", title_justify="left",
                  expand=True)
    table.add_column("job", no_wrap=True, min_width=14)
    if with_tenant:
        table.add_column("tenant", no_wrap=True)
    table.add_column("state")
    for column in ("step", "reward", "stale", "queue"):
        table.add_column(column, justify="right", no_wrap=True)
    for job in jobs:
        values = job.last.values if job.last else {}
        queue = by_job.get(job.job_id)
        counts = f"{queue.pending}/{queue.in_flight}/{queue.redelivered}/{queue.dead_lettered}" if queue else "-"
        owner = [job.tenant] if with_tenant else []
        table.add_row(job.job_id, *owner, job.state, f"{job.last.step if job.last else 0}/{job.max_steps}",
                      _number(values.get("reward_mean")), _number(values.get("staleness_mean")), counts)
    return table


def shares_table(shares: list[ShareInfo]) -> Table:
    """Your tenant's share of the actors' time over the last ~30 s against its fair share (its weight over
    the weights of every tenant with an active job), and every other tenant's together."""
    table = Table(title="tenants (actor time over the last ~30 s)", title_justify="left", expand=True)
    table.add_column("tenant", no_wrap=True)
    for column in ("jobs", "weight", "actor s", "share", "fair share"):
        table.add_column(column, justify="right", no_wrap=True)
    for s in shares:
        table.add_row(s.tenant or "(other tenants)", str(s.jobs), f"{s.weight:g}", f"{s.served_s:.1f}",
                      f"{s.share:.0%}", f"{s.fair_share:.0%}")
    return table


def sessions_table(sessions: list[SessionSummary]) -> Table:
    """Your live Tinker sessions: what they train, how far, and how long since their last request."""
    table = Table(title="tinker sessions", title_justify="left", expand=True)
    for column in ("session", "tenant", "state", "base model"):
        table.add_column(column, no_wrap=True)
    for column in ("rank", "runs", "samplers", "steps", "last request"):
        table.add_column(column, justify="right", no_wrap=True)
    for s in sessions:
        table.add_row(s.session_id, s.tenant, s.state, ", ".join(s.base_models) or "-",
                      ", ".join(map(str, s.lora_ranks)) or "-", str(s.training_runs), str(s.sampling_sessions),
                      str(s.optim_steps), f"{_age(s.last_request_age_s)} ago")
    return table


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    return f"{seconds / 60:.0f}m" if seconds < 7200 else f"{seconds / 3600:.1f}h"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


# ----------------------------------------------------------------------------- main


def show(frame: Frame, as_json: bool, out: Console) -> None:
    if as_json:
        print(json.dumps(frame.to_dict()), flush=True)
    else:
        out.print(render(frame))


def every(interval_s: float, clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> Iterator[None]:
    """Yield at a fixed cadence, t0, t0 + interval_s, ..., however long the caller's work takes; a tick
    that passed during the work (it took longer than interval_s) is skipped, not made up in a burst."""
    due = clock()
    while True:
        yield
        due += interval_s
        now = clock()
        if due < now:
            due += math.ceil((now - due) / interval_s) * interval_s
        sleep(due - now)


def live(client: Client, tinker: TinkerClient | None, args: argparse.Namespace, out: Console) -> int:
    """Redraw every interval until Ctrl-C; a failed refresh shows its error and the next one retries."""
    with Live(Text("connecting..."), console=out, auto_refresh=False) as view:
        for _ in every(args.interval):
            try:
                view.update(render(snapshot(client, tinker, args.all_tenants)), refresh=True)
            except FleetError as error:
                view.update(Text(f"gateway {client.address}: {error}", style="red"), refresh=True)
    return EXIT_OK


def stream_json(client: Client, tinker: TinkerClient | None, args: argparse.Namespace) -> int:
    """One JSON object per interval until Ctrl-C; a failed refresh prints {"gateway", "error"}."""
    for _ in every(args.interval):
        try:
            print(json.dumps(snapshot(client, tinker, args.all_tenants).to_dict()), flush=True)
        except FleetError as error:
            print(json.dumps({"gateway": client.address, "error": str(error)}), flush=True)
    return EXIT_OK


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv[1:] if argv[:1] == ["top"] else argv)
    out = Console()
    try:
        client = Client(gateway_address(args), token=args.token)
        tinker = tinker_client(args)
    except FleetError as error:
        out.print(f"[red]fleetrl top: {error}[/red]")
        return EXIT_FAILURE
    with client:
        if args.once:
            try:
                show(snapshot(client, tinker, args.all_tenants), args.json, out)
            except FleetError as error:
                out.print(f"[red]fleetrl top: gateway {client.address}: {error}[/red]")
                return EXIT_FAILURE
            return EXIT_OK
        try:
            return stream_json(client, tinker, args) if args.json else live(client, tinker, args, out)
        except KeyboardInterrupt:
            return EXIT_OK
