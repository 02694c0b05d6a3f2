"""One job, start to finish: the learner's main loop.

Reads top to bottom like torchtitan's `Trainer.train`: `setup` (model, replay table, task consumer,
resume, publish the current weights, start the feeder), then per step `wait_for_data -> train -> publish
-> feed -> checkpoint -> report`, then `finish` (final checkpoint, export, SUCCEEDED). Components
(Feeder, Policy, WeightPublisher, LeaseBook, MetricsLog, StepObserver, FullStoreWait) do not know each
other; JobRun wires them. A checkpoint or metrics write, task publish or weight publish that a full disk
or JetStream refuses, or that NATS does not answer past `full_stores.OUTAGE_RETRY_BEFORE_PAUSE_S`, is
waited out with the job paused (`full_stores`); so is NATS not answering the set-up's calls (the job's streams
and consumer, the pointer's fence), so a learner that claims a job while cut off from NATS keeps it, paused,
instead of failing it. Replay leases are committed only after the checkpoint
that includes their steps is complete (see `leases` for the exactly-once argument). Policy version ==
optimizer steps applied: step s trains at version s - 1 on groups of version >= s - 1 - max_staleness and
produces version s.
Fencing: every write for the job carries the claim's `lease_epoch` (ledger records, hence task
publishes; the weights pointer; replay's ConfigureTable and Commit; step metrics; the final state),
and checkpoints check it in Redis before they are written and again before they are made complete.
A refused write raises `Fenced`: another learner claimed the job after this one stopped renewing.
A step whose loss or gradient is not finite applies no update (`optim.train_step`) but is otherwise a
step: its groups are consumed and recorded in the ledger as trained in it, and its metrics line says
`nonfinite_steps` 1. After `train.max_nonfinite_steps_in_a_row` such steps in a row (counted from 0 by
each learner that runs the job) the job fails with `NonFiniteSteps`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from peft import PeftModel

from fleetrl.errors import Cancelled, DeadlineExceeded, FailedPrecondition, Fenced, FleetError, NotFound
from fleetrl.eval.heldout import HeldOutEval, parse_eval_prompts
from fleetrl.jobs.store import JobRecord, JobState, JobStore, job_dir
from fleetrl.policy.lora import SharedBases
from fleetrl.policy.models import resolve_device
from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.replay.client import ReplayClient
from fleetrl.replay.samplers import SAMPLERS
from fleetrl.reward.client import RewardClient
from fleetrl.spec.config import JobSpec
from fleetrl.tasks import ledger
from fleetrl.tasks.bus import NatsUnreachable
from fleetrl.tasks.feeder import Feeder, FeederCursor, parse_prompts, sample_min_version
from fleetrl.tasks.jobbus import JobBus
from fleetrl.tasks.ledger import Ledger
from fleetrl.train import checkpoint as ckpt
from fleetrl.train.batch import component_means, episode_metrics
from fleetrl.train.export import MetricsLog, export_adapter, export_model
from fleetrl.train.full_stores import OUTAGE_RETRY_BEFORE_PAUSE_S, FullStoreWait
from fleetrl.train.leases import LeaseBook, LeaseRecord
from fleetrl.train.observability import StepObserver
from fleetrl.train.settings import LearnerSettings
from fleetrl.train.status import JobStatus, StepRecord
from fleetrl.train.trained_policy import Followers, Policy
from fleetrl.weights.channel import WeightChannel
from fleetrl.weights.publish import WeightPublisher

log = logging.getLogger(__name__)
T = TypeVar("T")


class LeaseLost(FleetError):
    """Another learner may own the job now: stop at once, commit nothing."""


class NonFiniteSteps(FleetError, FloatingPointError):
    """train.max_nonfinite_steps_in_a_row steps in a row had a non-finite loss or gradient: the job fails."""


@dataclass
class Deps:
    """What a job run needs: the process's connections, compute and bases (owned by the service, shared by
    its runs), and the run's own status and lease-lost event."""

    settings: LearnerSettings
    jobs: JobStore
    nc: NATS
    js: JetStreamContext
    replay: ReplayClient
    weights: WeightChannel
    board: JobStatus
    """This run's status, read by the learner's status service and heartbeat."""
    stop: asyncio.Event
    """Set by SIGTERM: finish the step, checkpoint, hand the job back."""
    lease_lost: asyncio.Event = field(default_factory=asyncio.Event)
    """This run's: set when its job lease may be another learner's."""
    reward: RewardClient | None = None
    """Scores held-out evaluations (eval.interval); None: jobs that ask for one fail at setup."""
    compute: Executor | None = None
    """Runs building the model and training steps (`compute_executor`); None: asyncio's default executor.
    The runs of one learner share it: their steps take turns."""
    bases: SharedBases | None = None
    """The base models held for the LoRA jobs this learner trains at once (one copy per base); None: each
    job loads its own."""


def compute_executor(nice: int) -> ThreadPoolExecutor:
    """The one thread that builds models and trains, at niceness `nice` before it runs anything, so the
    OpenMP threads its first parallel op starts inherit that priority (Linux niceness is per thread)."""
    return ThreadPoolExecutor(1, thread_name_prefix="learner-compute", initializer=_lower_priority, initargs=(nice,))


def _lower_priority(nice: int) -> None:
    thread = threading.get_native_id()
    if nice > os.getpriority(os.PRIO_PROCESS, thread):  # only ever raise niceness: lowering it needs privilege
        os.setpriority(os.PRIO_PROCESS, thread, nice)


@dataclass
class StepData:
    groups: list[common_pb2.Group] = field(default_factory=list)
    leases: list[LeaseRecord] = field(default_factory=list)
    stale_dropped: int = 0
    copies_skipped: int = 0


class JobRun:
    """Trains one claimed job; `run()` returns when it ends, is cancelled or is handed back."""

    deps: Deps
    record: JobRecord
    spec: JobSpec
    root: Path
    step: int
    policy: Policy
    feeder: Feeder
    job_bus: JobBus
    ledger: Ledger
    epoch: int
    """The job lease's epoch (fencing token) of this run's claim."""
    publisher: WeightPublisher
    full_stores: FullStoreWait
    """Waits out a full checkpoint disk or JetStream with the job paused."""
    book: LeaseBook
    metrics: MetricsLog
    obs: StepObserver
    held_out: HeldOutEval | None
    checkpoint_step: int
    nonfinite_in_a_row: int
    """Steps in a row, up to the last one, whose update was skipped as not finite."""
    _policy: Policy | None
    """The policy a test gave, used as it is."""
    _built: Policy | None
    """The policy this run built (`load_policy`), closed with the run."""

    def __init__(self, deps: Deps, record: JobRecord, policy: Policy | None = None) -> None:
        self.deps = deps
        self.record = record
        self.spec = record.spec
        self.root = ckpt.checkpoint_root(deps.settings.run_dir, record.job_id)
        self.metrics = MetricsLog(job_dir(deps.settings.run_dir, record.job_id) / "metrics.jsonl")
        self.obs = StepObserver(record.job_id)
        self.step = self.checkpoint_step = self.nonfinite_in_a_row = 0
        self.held_out = None
        self.book = LeaseBook(not SAMPLERS[self.spec.replay.sampler].reuses)
        self.job_bus = JobBus(deps.nc, record.job_id, OUTAGE_RETRY_BEFORE_PAUSE_S)
        self.ledger = Ledger(deps.jobs.redis)
        self.epoch = record.lease_epoch
        self.full_stores = FullStoreWait(deps.jobs, deps.board, record.job_id, self.epoch,
                                         wait_s=deps.settings.store_full_wait_s,
                                         retry_s=deps.settings.store_full_retry_s, check=self.check_lease,
                                         stop=deps.stop)
        self._policy, self._built = policy, None

    @property
    def job_id(self) -> str:
        return self.record.job_id

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        await self.setup()
        while self.step < self.spec.train.max_steps:
            if await self.should_stop():
                return
            with self.obs.step(self.step + 1):
                stepped = await self.run_step()
            if not stepped:
                await self.hand_back()
                return
        await self.finish()

    async def run_step(self) -> bool:
        """One step's stages, each timed and traced; False when SIGTERM came before its data."""
        data = await self.next_data()
        if data is None:
            return False
        values = await self.obs.timed("train", self.train(data))
        values["wait_for_data_s"] = self.obs.seconds("wait_for_data")  # the learner's idle time this step
        self.obs.consumed(data.groups, self.step, values)
        if self.held_out is not None and self.held_out.due(self.step):
            values.update(await self.obs.timed("eval", self.held_out.run(self.policy)))
        await self.obs.timed("publish", self.publish())
        await self.top_up()
        await self.obs.timed("checkpoint", self.checkpoint_if_due())
        await self.report(values, data)
        self.fail_after_nonfinite_steps()
        return True

    # ------------------------------------------------------------------ setup

    async def setup(self) -> None:
        self.phase("starting")
        prompts_bytes, reward_file = await self.deps.jobs.files(self.job_id)
        prompts = parse_prompts(prompts_bytes)
        self.held_out = await self.held_out_eval(reward_file)
        await self.load_policy()
        await self.fenced_replay(self.deps.replay.configure(self.job_id, self.spec.replay, self.epoch))
        await self.full_stores.call(lambda: self.job_bus.prepare(self.spec))
        cursor = await self.resume()
        self.feeder = Feeder(self.job_bus, self.ledger, self.epoch, self.spec, prompts, cursor)
        await self.start_publisher()
        await self.top_up()

    async def load_policy(self) -> None:
        """The job's policy: the one given (tests), else built on the compute thread (a LoRA job's on the
        learner's shared base, given back by `close`)."""
        if self._policy is not None:
            self.policy = self._policy
            return
        device = resolve_device(self.deps.settings.device)
        self.policy = self._built = await self.compute(Policy, self.spec, device, Followers.if_distributed(),
                                                       self.deps.bases)

    def close(self) -> None:
        """Give back what the run holds of the learner: the base its policy shares with other jobs."""
        if self._built is not None:
            self._built.close()

    async def start_publisher(self) -> None:
        """The job's weight publisher, and the current weights published (version 0 for a new job)."""
        self.publisher = WeightPublisher(self.deps.weights, self.job_id, self.spec.train.weights_dtype,
                                         self.spec.train.publish_interval, self.spec.train.keep_weight_versions,
                                         self.epoch, self.spec.train.full_publish_interval,
                                         adapter_of=self.spec.model if self.spec.train.lora is not None else "",
                                         outage_retry_s=OUTAGE_RETRY_BEFORE_PAUSE_S)
        await self.full_stores.call(self.publisher.sync)
        await self.full_stores.call(lambda: self.publisher.publish(self.policy.model, self.step))

    async def held_out_eval(self, reward_file: bytes | None) -> HeldOutEval | None:
        """The job's periodic evaluation, when its spec asks for one."""
        if self.spec.eval.interval == 0:
            return None
        data = await self.deps.jobs.eval_prompts(self.job_id)
        if data is None:
            raise NotFound(f"job {self.job_id} sets eval.interval but has no eval prompts stored")
        if self.deps.reward is None:
            raise FailedPrecondition("this learner has no reward service to score eval.interval with")
        problems = parse_eval_prompts(data, self.spec.eval.problems)
        return HeldOutEval(self.job_id, self.spec, problems, reward_file, self.deps.reward)

    async def resume(self) -> FeederCursor:
        """Restore the newest complete checkpoint (if any) and commit the leases it recorded."""
        saved = await self.restore_latest()
        await self.ledger.forget_steps_after(self.job_id, 0 if saved is None else saved.step, lease_epoch=self.epoch)
        if saved is None:
            return FeederCursor()
        self.book.restore(saved.state["leases"])
        await self.commit(self.book)
        return FeederCursor.from_dict(saved.state["cursor"], saved.step * self.spec.rollout.prompts_per_step)

    async def restore_latest(self) -> ckpt.Checkpoint | None:
        """Restore the newest complete checkpoint, if any: the policy (model, optimizer, scheduler, RNG) and the
        step; the metrics log is cut back to that step (0 without one)."""
        saved = await asyncio.to_thread(ckpt.load_latest, self.root)
        self.metrics.truncate_after(0 if saved is None else saved.step)
        if saved is not None:
            self.policy.restore(saved, self.root)
            self.step = self.checkpoint_step = self.deps.board.checkpoint_step = saved.step
            log.info("job %s resumed from step %d", self.job_id, saved.step)
        return saved

    # ------------------------------------------------------------------ per step

    async def should_stop(self) -> bool:
        """True when SIGTERM asked to hand the job back; Cancelled when it was cancelled."""
        self.check_lease()
        await self.check_cancelled()
        if self.deps.stop.is_set():
            await self.hand_back()
            return True
        return False

    async def hand_back(self) -> None:
        """SIGTERM: checkpoint what is trained so another learner resumes from here."""
        self.check_lease()
        await self.checkpoint()
        log.info("job %s handed back at step %d", self.job_id, self.step)

    async def check_cancelled(self) -> None:
        """Raise Cancelled (after purging the job's queued tasks) when the job was cancelled."""
        record = await self.deps.jobs.get(self.job_id)
        if record.state == JobState.CANCELLED:
            try:
                await self.job_bus.purge_tasks()
            except NatsUnreachable as error:  # the gateway's cancel purged them; actors drop a cancelled job's
                log.warning("job %s: its queued tasks not purged: %s", self.job_id, error)
            log.info("job %s cancelled at step %d", self.job_id, self.step)
            raise Cancelled(f"job {self.job_id} was cancelled")

    def check_lease(self) -> None:
        if self.deps.lease_lost.is_set():
            raise LeaseLost(f"lost the lease of job {self.job_id}")

    async def next_data(self) -> StepData | None:
        """The step's groups (`wait_for_data`, timed as a stage), or None if SIGTERM came first."""
        return await self.obs.timed("wait_for_data", self.wait_for_data())

    async def wait_for_data(self) -> StepData | None:
        """prompts_per_step fresh groups under leases, or None if SIGTERM came first.

        A cancel ends the wait within one sample_wait_s (with no actors left, the wait could
        otherwise last the whole train.timeout_per_step_s)."""
        self.phase("waiting_for_data")
        need, data = self.spec.rollout.prompts_per_step, StepData()
        min_version = sample_min_version(self.step, self.spec.train.max_staleness)
        deadline = time.monotonic() + self.spec.train.timeout_per_step_s
        while len(data.groups) < need:
            if self.deps.stop.is_set() or self.deps.lease_lost.is_set():
                await self.release(data)
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"step {self.step + 1}: {len(data.groups)} of {need} groups "
                                       f"after train.timeout_per_step_s={self.spec.train.timeout_per_step_s}s")
            wait_s = min(left, self.deps.settings.sample_wait_s)
            await self.sample_once(data, need - len(data.groups), min_version, wait_s)
            if len(data.groups) < need:
                await self.settle_stale()
                await self.replace_dead_lettered()
                # After a resume the cursor may hold room that no settle announced: tasks settled before this
                # incarnation published them again (deduplicated) are settled once, here or earlier.
                await self.top_up()
                await self.full_stores.call(self.publisher.repair_if_requested)
                try:
                    await self.check_cancelled()
                except Cancelled:
                    await self.release(data)
                    raise
        return data

    async def sample_once(self, data: StepData, want: int, min_version: int, wait_s: float) -> None:
        started_ns = time.time_ns()
        lease_id, groups, stale = await self.deps.replay.sample(self.job_id, want, min_version, wait_s)
        self.obs.sampled(groups, started_ns)
        if stale:
            data.stale_dropped += stale
            await self.settle_stale()
            await self.top_up()
        if not lease_id:
            return
        self.book.hold(lease_id)
        also = {t for r in data.leases for t in r.task_ids}
        fresh, copies = self.book.split(groups, also)
        data.leases.append(LeaseRecord(lease_id, tuple(g.task_id for g in groups)))
        data.groups.extend(fresh)
        data.copies_skipped += copies

    async def settle_stale(self) -> None:
        """Groups dropped as stale never come back: settle them by replay's count of them."""
        self.feeder.settle_stale((await self.deps.replay.stats(self.job_id)).stale_dropped)

    async def replace_dead_lettered(self) -> None:
        """Tasks dead-lettered by actors will never bring a group: settle them and publish others."""
        dead_lettered = await self.full_stores.call(self.job_bus.dead_lettered)
        if self.feeder.settle_dead_lettered(dead_lettered):
            log.warning("job %s: %d tasks dead-lettered so far; publishing replacements", self.job_id,
                        dead_lettered)
            await self.top_up()

    async def release(self, data: StepData) -> None:
        """Give back the leases of a step that will not be trained."""
        for record in data.leases:
            self.book.drop(record.lease_id)
            with contextlib.suppress(NotFound):  # expired already: its groups are back anyway
                await self.deps.replay.release(self.job_id, record.lease_id)

    async def train(self, data: StepData) -> dict[str, float]:
        staleness = [self.step - g.policy_version for g in data.groups]
        values = await self.optimizer_step(data.groups)
        await self.ledger.trained(self.job_id, self.step, [g.task_id for g in data.groups], lease_epoch=self.epoch)
        self.book.add(data.leases)
        self.feeder.settle(len(data.groups))
        values.update({
            "staleness_mean": sum(staleness) / len(staleness), "staleness_max": float(max(staleness)),
            "stale_dropped": float(data.stale_dropped), "copies_skipped": float(data.copies_skipped),
            **component_means(data.groups),
            **episode_metrics(data.groups),
        })
        return values

    async def optimizer_step(self, groups: list[common_pb2.Group]) -> dict[str, float]:
        """Train on groups (`Policy.step`, on the compute thread) and count the step: its metrics, with the
        non-finite run (`count_nonfinite`), `tokens_per_s` and `step_time_s`."""
        self.phase("training")
        started = time.monotonic()
        values = await self.compute(self.policy.step, groups)
        elapsed = time.monotonic() - started
        self.check_lease()
        self.count_nonfinite(values)
        self.step += 1
        values.update(tokens_per_s=values.get("tokens", 0.0) / max(elapsed, 1e-9), step_time_s=elapsed)
        return values

    def count_nonfinite(self, values: dict[str, float]) -> None:
        """Count the step just trained in the run of steps whose update was skipped as not finite."""
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if values["nonfinite_steps"] else 0
        values["nonfinite_steps_in_a_row"] = float(self.nonfinite_in_a_row)
        if self.nonfinite_in_a_row:
            log.warning("job %s: step %d had a non-finite loss or gradient (loss %s, grad_norm %s), its update "
                        "was skipped: %d in a row", self.job_id, self.step + 1, values["loss"], values["grad_norm"],
                        self.nonfinite_in_a_row)

    def fail_after_nonfinite_steps(self) -> None:
        """NonFiniteSteps once train.max_nonfinite_steps_in_a_row steps in a row skipped their update (the
        last of them is reported, its groups recorded, like any step's)."""
        limit = self.spec.train.max_nonfinite_steps_in_a_row
        if self.nonfinite_in_a_row >= limit:
            raise NonFiniteSteps(f"{limit} steps in a row had a non-finite loss or gradient (steps "
                                 f"{self.step - limit + 1} to {self.step}; train.max_nonfinite_steps_in_a_row="
                                 f"{limit})")

    async def publish(self) -> None:
        if self.publisher.due(self.step, self.step == self.spec.train.max_steps):
            self.phase("publishing")
            await self.full_stores.call(lambda: self.publisher.publish(self.policy.model, self.step))

    async def top_up(self) -> None:
        """The feeder's top-up for the published version, waiting out a full JetStream."""
        await self.full_stores.call(lambda: self.feeder.top_up(self.publisher.published_version))

    async def checkpoint_if_due(self) -> None:
        if self.step % self.spec.train.checkpoint_interval == 0 or self.step == self.spec.train.max_steps:
            await self.checkpoint()

    async def checkpoint(self) -> None:
        """Write the checkpoint of the current step, then commit the leases it includes."""
        if self.step == self.checkpoint_step and not self.book.pending:
            return
        self.check_lease()
        self.phase("checkpointing")
        saved = self.policy.state(self.step, self.checkpoint_state())
        what = f"checkpoint {self.step}"
        await self.deps.jobs.check_fence(self.job_id, self.epoch, what)
        tmp = await self.full_stores.call(lambda: asyncio.to_thread(
            ckpt.write, self.root, saved, delay_s=self.deps.settings.checkpoint_delay_s, lease_epoch=self.epoch))
        self.check_lease()
        await self.deps.jobs.check_fence(self.job_id, self.epoch, what)
        await asyncio.to_thread(ckpt.complete, self.root, tmp)
        self.checkpoint_step = self.deps.board.checkpoint_step = self.step
        await asyncio.to_thread(ckpt.prune, self.root, self.spec.train.keep_checkpoints)
        self.check_lease()
        await self.commit(self.book)

    def checkpoint_state(self) -> dict[str, object]:
        """What a checkpoint records besides the model's and optimizer's state (its `state.json`)."""
        return {"version": self.step, "cursor": self.feeder.cursor.to_dict(), "leases": self.book.to_state(),
                "lease_epoch": self.epoch}

    async def commit(self, book: LeaseBook) -> None:
        for record in book.take_pending():
            try:
                await self.fenced_replay(self.deps.replay.commit(self.job_id, record.lease_id, self.epoch))
            except NotFound:
                log.warning("job %s: lease %s expired before its commit; its %d groups will be skipped",
                            self.job_id, record.lease_id, len(record.task_ids))
                book.lost(record)

    async def report(self, values: dict[str, float], data: StepData) -> None:
        unix_ms = int(time.time() * 1000)
        record = {"step": self.step, "policy_version": self.step, "unix_ms": unix_ms, **values}
        await self.deps.jobs.append_step(self.job_id, record, lease_epoch=self.epoch)
        line = {**record, "task_ids": [g.task_id for g in data.groups]}
        await self.full_stores.call(lambda: asyncio.to_thread(self.metrics.append, line))
        await self.job_bus.event({"type": "step", **record})
        board = self.deps.board
        board.step, board.policy_version = self.step, self.step
        board.last = StepRecord(self.step, self.step, values, unix_ms)

    # ------------------------------------------------------------------ end

    async def finish(self) -> None:
        await self.checkpoint()
        self.phase("exporting")
        exported = await asyncio.to_thread(self.policy.exportable)
        run_dir, model = self.deps.settings.run_dir, self.policy.model
        path = await self.full_stores.call(lambda: asyncio.to_thread(
            export_model, exported, self.policy.tokenizer, run_dir, self.job_id))
        if isinstance(model, PeftModel):
            await self.full_stores.call(lambda: asyncio.to_thread(export_adapter, model, run_dir, self.job_id))
        self.check_lease()
        await self.deps.jobs.check_fence(self.job_id, self.epoch, "the job's end")
        await self.deps.jobs.set_model_uri(self.job_id, str(path.resolve()))
        await self.deps.jobs.set_state(self.job_id, JobState.SUCCEEDED)
        await self.job_bus.event({"type": "state", "state": "succeeded", "model_uri": str(path.resolve())})
        await self.report_ledger()
        self.phase("done")

    async def report_ledger(self) -> None:
        """The job's end-to-end accounting, logged and published as a `ledger` event. The job has
        succeeded already: a failure here is logged (`fleetrl jobs account` reads the ledger later)."""
        try:
            accounting = await self.ledger.account(self.deps.js, self.job_id, ledger.max_trainings(self.spec))
        except Exception as error:  # NATS or Redis unreachable at the very end: the ledger stays stored
            log.warning("job %s: no end-of-job accounting: %r", self.job_id, error)
            return
        log.log(logging.INFO if accounting.balanced else logging.ERROR, "job %s ledger: %s", self.job_id,
                accounting.counts)
        await self.job_bus.event({"type": "ledger", **accounting.counts})

    async def fenced_replay(self, call: Awaitable[T]) -> T:
        """A replay call that carries our epoch: its FAILED_PRECONDITION is a fencing refusal."""
        try:
            return await call
        except FailedPrecondition as error:
            raise Fenced(str(error)) from error

    def phase(self, name: str) -> None:
        self.deps.board.phase = name

    async def compute(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) on the learner's compute thread (see `compute_executor`)."""
        return await asyncio.get_running_loop().run_in_executor(self.deps.compute, fn, *args)
