"""The Tinker API's domain: sessions, training runs, sampling sessions and their requests, per tenant.

`TinkerService` is what services/tinker's HTTP handlers call, after converting the SDK's bodies
into `fleetrl.tinker.types`. A call checks its input and its tenant at once (InvalidArgument,
NotFound), then queues its work in the `RequestLog` and returns the request; the work (loading a
model, forward_backward, optim_step, saving, sampling) runs on the log's one thread in arrival order.

Tenancy: every session, training run, sampling session, request and checkpoint records its tenant,
and every lookup takes the caller's tenant, so another tenant's ids read as unknown (NotFound). A
tenant holds at most `max_sessions_per_tenant` live sessions and `max_training_runs_per_tenant`
training runs (held or queued for creation; each holds a copy of its base model in this process);
one more is refused ResourceExhausted, naming the setting, so one tenant cannot take the process's
memory from the others.
Models come from the operator's allow-list (`policy.models.allow_list_problem`, the gateway's rule).

The training runs' adapters and optimizers run in the tinker service process. Samples run here too
(`Samplers`, the actors' backend; sampler versions live in this process, and on disk when named) unless
the service was given a `FleetSampling` (`sampling = "fleet"`): then each sampler version's adapter is
published to the weight store and every sample request is served by an actor (`fleetrl.tinker.fleet`),
its work awaited on the event loop, not on the work thread. Checkpoints go to disk (`CheckpointStore`)
and survive a restart.
"""

from __future__ import annotations

import contextlib
import secrets
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetrl.errors import FieldViolation, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from fleetrl.policy.lora import SharedBases
from fleetrl.policy.models import allow_list_problem
from fleetrl.spec.config import LoraSpec
from fleetrl.tinker.checkpoints import SCHEME, CheckpointPath, CheckpointStore, Listed, check_name, parse
from fleetrl.tinker.checks import check_adam, check_loss, check_sample, check_token_ids
from fleetrl.tinker.fleet import FleetSampling, path_job_id, run_job_id
from fleetrl.tinker.learners import LearnerTraining, RemoteRun, Restorable
from fleetrl.tinker.requests import Key, Request, RequestLog
from fleetrl.tinker.sampling import Samplers, SamplerWeights
from fleetrl.tinker.training import TrainingRun, lora_spec
from fleetrl.tinker.types import (
    AdamParams,
    Datum,
    LoraRequest,
    SampleParams,
    SampleResult,
    SessionSummary,
    TenantLoad,
)

Run = TrainingRun | RemoteRun
"""A training run held in this process, or on a learner (`training = "fleet"`)."""


@dataclass(frozen=True)
class Limits:
    """The operator's settings the service enforces (services/tinker's settings, as plain values)."""

    allowed_models: tuple[str, ...]
    allowed_model_roots: tuple[Path, ...]
    run_dir: Path
    max_lora_rank: int
    max_sample_tokens: int
    max_num_samples: int
    max_sessions_per_tenant: int
    max_training_runs_per_tenant: int


@dataclass
class Session:
    """A ServiceClient's session."""

    id: str
    tenant: str
    finished: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    """When it was created or last sent a heartbeat (time.monotonic)."""
    last_request: float = field(default_factory=time.monotonic)
    """When it was created or last sent a request naming it, one of its training runs or sampling sessions
    (time.monotonic; heartbeats and future polls do not count): `fleetrl top`'s last request."""


@dataclass
class SamplingSession:
    """A SamplingClient: the sampler version it samples from."""

    id: str
    tenant: str
    session_id: str
    """The session that made it; closing that session frees it."""
    weights: SamplerWeights
    model_path: str | None = None


@dataclass(frozen=True)
class RunInfo:
    """A training run as the SDK's RestClient reads it (`get_training_run`, `list_checkpoints`): live in this
    process, or known only by its checkpoints on disk (its session ended, or the server restarted)."""

    model_id: str
    tenant: str
    base_model: str
    lora_rank: int
    last_request_at: float
    """Seconds since the epoch: its session's last request, or, for a run known by its checkpoints, the newest
    one's writing."""
    checkpoints: tuple[Listed, ...]
    """Oldest first."""


@dataclass
class _State:
    sessions: dict[str, Session] = field(default_factory=dict)
    runs: dict[str, Run] = field(default_factory=dict)
    creating: dict[str, str] = field(default_factory=dict)
    """Training runs queued for creation, not yet in `runs`: model id -> tenant (they count to its quota)."""
    samplers: dict[str, SamplingSession] = field(default_factory=dict)


class TinkerService:
    """Sessions, training runs and samplers of every tenant; their work through one RequestLog."""

    limits: Limits
    log: RequestLog
    checkpoints: CheckpointStore
    _samplers: Samplers
    _state: _State
    _bases: SharedBases
    """The base models of the training runs, each held once for all runs on it."""
    _fleet: FleetSampling | None
    """Where samples run when not here: the fleet's actors (`sampling = "fleet"`)."""
    _learners: LearnerTraining | None
    """Where training runs live when not here: the fleet's learners (`training = "fleet"`)."""

    def __init__(self, limits: Limits, log: RequestLog, fleet: FleetSampling | None = None,
                 learners: LearnerTraining | None = None) -> None:
        self.limits = limits
        self.log = log
        self._fleet = fleet
        self._learners = learners
        self.checkpoints = CheckpointStore(limits.run_dir / "tinker")
        self._samplers = Samplers()
        self._state = _State()
        self._bases = SharedBases()

    # ------------------------------------------------------------------ sessions

    def create_session(self, tenant: str) -> str:
        held = self._live_sessions()[tenant]
        _check_quota(tenant, "sessions", held, self.limits.max_sessions_per_tenant, "max_sessions_per_tenant")
        session = Session(f"session-{uuid.uuid4().hex}", tenant)
        self._state.sessions[session.id] = session
        return session.id

    def session(self, tenant: str, session_id: str) -> Session:
        found = self._state.sessions.get(session_id)
        if found is None or found.tenant != tenant:
            raise NotFound(f"session {session_id!r} not found")
        return found

    def _requested(self, tenant: str, session_id: str) -> Session:
        """The tenant's session, a request of which just arrived."""
        session = self.session(tenant, session_id)
        session.last_request = time.monotonic()
        return session

    def sessions(self, tenant: str | None, now: float | None = None) -> list[SessionSummary]:
        """The tenant's live sessions, newest request first; never another tenant's, unless the caller is an
        operator listing every tenant's (tenant None)."""
        now = time.monotonic() if now is None else now
        live = [s for s in list(self._state.sessions.values())
                if (tenant is None or s.tenant == tenant) and not s.finished]
        return sorted((self._summary(s, now) for s in live), key=lambda s: (s.last_request_age_s, s.session_id))

    def _summary(self, session: Session, now: float) -> SessionSummary:
        # list(...) first: the work thread adds runs and samplers while this (the event loop) reads them
        runs = [r for m, r in list(self._state.runs.items()) if m.startswith(f"{session.id}:")]
        samplers = [s for s in list(self._state.samplers.values()) if s.session_id == session.id]
        scopes = [f"create_model:{session.id}", *(r.model_id for r in runs), *(s.id for s in samplers)]
        working = any(self.log.unfinished(scope) for scope in scopes)
        return SessionSummary(
            session.id, session.tenant, "working" if working else "idle",
            tuple(sorted({r.base_model for r in runs} | {s.weights.base_model for s in samplers})),
            tuple(sorted({r.lora.rank for r in runs})), len(runs), len(samplers), sum(r.steps for r in runs),
            round(now - session.last_request, 3))

    def tenants(self, known: Iterable[str] = (), now: float | None = None) -> list[TenantLoad]:
        """What each tenant holds, for the operator only: every tenant in `known` (the token table's, so one
        holding nothing reads as zeros) and every one holding anything, by name."""
        now = time.monotonic() if now is None else now
        sessions, runs, in_flight = self._live_sessions(), self._held_runs(), self.log.in_flight()
        samplers = list(self._state.samplers.values())
        created = list(self._state.runs.values())
        last: dict[str, float] = {}
        for s in list(self._state.sessions.values()):
            if not s.finished:
                last[s.tenant] = max(last.get(s.tenant, s.last_request), s.last_request)
        loads: list[TenantLoad] = []
        for tenant in sorted(set(known) | set(sessions) | set(runs) | set(in_flight)):
            queued, running = in_flight.get(tenant, (0, 0))
            mine = [r for r in created if r.tenant == tenant]
            sampler_bytes = sum(_bytes(s.weights) for s in samplers if s.tenant == tenant)
            loads.append(TenantLoad(
                tenant, sessions[tenant], runs[tenant], sum(1 for s in samplers if s.tenant == tenant), queued,
                running, sum(r.steps for r in mine), sum(r.own_bytes() for r in mine) + sampler_bytes,
                round(now - last[tenant], 3) if tenant in last else None))
        return loads

    def heartbeat(self, tenant: str, session_id: str) -> Session:
        session = self.session(tenant, session_id)
        session.last_seen = time.monotonic()
        return session

    def finish_session(self, tenant: str, session_id: str) -> None:
        """Mark the session finished and free its training runs and sampling sessions (checkpoints stay on disk)."""
        self.session(tenant, session_id).finished = True
        # list(...) first: the work thread may add runs or samplers while this (the event loop) iterates
        for model_id in [m for m in list(self._state.runs) if m.startswith(f"{session_id}:")]:
            self._state.runs.pop(model_id).close()
            self.log.forget(model_id)
            if self._fleet is not None:
                self._fleet.forget(run_job_id(model_id))
        for sampler_id in [i for i, s in list(self._state.samplers.items()) if s.session_id == session_id]:
            del self._state.samplers[sampler_id]
            self.log.forget(sampler_id)
        self.log.forget(f"create_model:{session_id}")
        self.log.end_lanes(f"{session_id}:")

    def reap(self, idle_s: float, now: float | None = None) -> list[str]:
        """Finish every session silent for more than idle_s (no heartbeat: its client is gone); their ids."""
        now = time.monotonic() if now is None else now
        idle = [s for s in self._state.sessions.values() if not s.finished and now - s.last_seen > idle_s]
        for session in idle:
            self.finish_session(session.tenant, session.id)
        return [session.id for session in idle]

    # ------------------------------------------------------------------ training runs

    def check_model(self, base_model: str, field_name: str = "base_model") -> str:
        problem = allow_list_problem(base_model, self.limits.allowed_models, self.limits.allowed_model_roots,
                                     self.limits.run_dir)
        if problem is not None:
            raise InvalidArgument(f"{field_name} {base_model!r}: {problem}", [FieldViolation(field_name, problem)])
        return base_model

    def create_model(self, tenant: str, session_id: str, model_seq_id: int, base_model: str,
                     lora: LoraRequest) -> Request:
        """Queue the creation of a training run; the request's `model_id` is known at once."""
        self._requested(tenant, session_id)
        self.check_model(base_model)
        if not 1 <= lora.rank <= self.limits.max_lora_rank:
            raise InvalidArgument(f"lora_config.rank {lora.rank} is outside 1..{self.limits.max_lora_rank}",
                                  [FieldViolation("lora_config.rank", f"1..{self.limits.max_lora_rank}")])
        spec = lora_spec(lora)
        model_id = model_id_of(session_id, model_seq_id)
        seed = lora.seed if lora.seed is not None else secrets.randbelow(2**31)
        key = (f"create_model:{session_id}", model_seq_id)
        self._reserve_run(tenant, model_id, key)

        def work() -> dict[str, Any]:
            with self._creating(model_id):
                self._state.runs[model_id] = self._new_run(model_id, tenant, base_model, spec, seed)
            return {"model_id": model_id}

        return self.log.submit(tenant, key, "CreateModel", work, {"model_id": model_id}, self._lane(model_id))

    def _reserve_run(self, tenant: str, model_id: str, key: Key) -> None:
        """Count a training run about to be queued against its tenant's quota; a request the log answers
        without queuing work (a retry or replay of a name it knows, or one too old to run) counts nothing."""
        if not self.log.queues(key):
            return
        held = self._held_runs()[tenant]
        _check_quota(tenant, "training runs", held, self.limits.max_training_runs_per_tenant,
                     "max_training_runs_per_tenant")
        self._state.creating[model_id] = tenant

    def _live_sessions(self) -> Counter[str]:
        """Live sessions by tenant: what `max_sessions_per_tenant` counts."""
        return Counter(s.tenant for s in list(self._state.sessions.values()) if not s.finished)

    def _held_runs(self) -> Counter[str]:
        """Training runs created or queued for creation, by tenant: what `max_training_runs_per_tenant` counts."""
        # list(...) first: the work thread adds and removes runs while this (the event loop) counts
        return Counter([r.tenant for r in list(self._state.runs.values())] + list(self._state.creating.values()))

    @contextlib.contextmanager
    def _creating(self, model_id: str) -> Iterator[None]:
        """The queued creation of a training run: its reservation ends with it, created or failed."""
        try:
            yield
        finally:
            self._state.creating.pop(model_id, None)

    def _new_run(self, model_id: str, tenant: str, base_model: str, lora: LoraSpec, seed: int) -> Run:
        """A training run here, on the base shared by this process's runs, or on a learner (from the work thread)."""
        if self._learners is None:
            return TrainingRun.create(model_id, tenant, base_model, lora, seed, self._bases)
        return self._learners.create(model_id, tenant, base_model, lora, seed,
                                     lambda: self._last_state(tenant, model_id))

    def _lane(self, model_id: str) -> str | None:
        """Where a training run's work runs: its own thread when a learner holds the run (the work waits on it),
        else the process's one work thread (the work computes here)."""
        return model_id if self._learners is not None else None

    def _last_state(self, tenant: str, model_id: str) -> Restorable | None:
        """The newest save_state checkpoint of a run, which its restore on another learner starts from."""
        saved = [c for c in self.checkpoints.listed(tenant, model_id) if c.path.kind == "weights"]
        if not saved:
            return None
        checkpoint = self.checkpoints.load(tenant, saved[-1].path)
        state: dict[str, Any] = {"adapter": checkpoint.adapter, "steps": checkpoint.steps}
        if checkpoint.optimizer is not None:
            state["optimizer"] = checkpoint.optimizer
        return Restorable(str(saved[-1].path), checkpoint.steps, state)

    def run(self, tenant: str, model_id: str) -> Run:
        """The tenant's training run `model_id`, a request of which just arrived."""
        found = self._state.runs.get(model_id)
        if found is None or found.tenant != tenant:
            raise NotFound(f"model {model_id!r} not found")
        self._requested(tenant, model_id.partition(":")[0])
        return found

    def forward_backward(self, tenant: str, model_id: str, seq_id: int, data: list[Datum], loss_fn: str,
                         settings: dict[str, float], forward_only: bool) -> Request:
        run = self.run(tenant, model_id)
        check_loss(loss_fn, settings, data)
        check_token_ids(data, run.vocab_size)
        kind, generation = "Forward" if forward_only else "ForwardBackward", run.generation
        return self.log.submit(tenant, (model_id, seq_id), kind, lambda: _same(run, generation).forward_backward(
            data, loss_fn, settings, backward=not forward_only), lane=self._lane(model_id))

    def optim_step(self, tenant: str, model_id: str, seq_id: int, adam: AdamParams) -> Request:
        run = self.run(tenant, model_id)
        check_adam(adam)
        generation = run.generation
        return self.log.submit(tenant, (model_id, seq_id), "OptimStep",
                               lambda: {"metrics": _same(run, generation).optim_step(adam)}, lane=self._lane(model_id))

    def save_state(self, tenant: str, model_id: str, seq_id: int, name: str | None) -> Request:
        run = self.run(tenant, model_id)
        path = CheckpointPath(model_id, "weights", check_name(name) if name else f"state-{uuid.uuid4().hex[:8]}")
        generation = run.generation

        def work() -> dict[str, Any]:
            self.checkpoints.save(tenant, path, run.base_model, run.lora, _same(run, generation).state())
            return {"path": str(path), "type": "save_weights"}

        return self.log.submit(tenant, (model_id, seq_id), "SaveWeights", work, lane=self._lane(model_id))

    def load_state(self, tenant: str, model_id: str, seq_id: int, path: str, optimizer: bool) -> Request:
        """load_state into an existing run, from one of the tenant's training checkpoints."""
        run = self.run(tenant, model_id)
        where = self._training_checkpoint(path)
        generation = run.generation

        def work() -> dict[str, Any]:
            checkpoint = self.checkpoints.load(tenant, where)
            _same(run, generation)
            if (checkpoint.base_model, checkpoint.lora) != (run.base_model, run.lora):
                raise InvalidArgument(f"checkpoint {where} is of {checkpoint.base_model} with LoRA rank "
                                      f"{checkpoint.lora.rank}; model {model_id} is of {run.base_model} with rank "
                                      f"{run.lora.rank}", [FieldViolation("path", "another model's shape")])
            run.load_state({"adapter": checkpoint.adapter, "steps": checkpoint.steps,
                            **({"optimizer": checkpoint.optimizer} if checkpoint.optimizer else {})}, optimizer)
            return {"path": path, "model_id": model_id, "type": "load_weights"}

        return self.log.submit(tenant, (model_id, seq_id), "LoadWeights", work, lane=self._lane(model_id))

    def create_from_state(self, tenant: str, session_id: str, model_seq_id: int, path: str,
                          optimizer: bool) -> Request:
        """A new training run from a training checkpoint (create_training_client_from_state[_with_optimizer]),
        which may have been saved by an earlier server process."""
        self._requested(tenant, session_id)
        where = self._training_checkpoint(path)
        model_id = model_id_of(session_id, model_seq_id)
        key = (f"create_model:{session_id}", model_seq_id)
        self._reserve_run(tenant, model_id, key)

        def work() -> dict[str, Any]:
            with self._creating(model_id):
                checkpoint = self.checkpoints.load(tenant, where)
                self.check_model(checkpoint.base_model)
                run = self._new_run(model_id, tenant, checkpoint.base_model, checkpoint.lora, 0)
                try:
                    run.load_state({"adapter": checkpoint.adapter, "steps": checkpoint.steps,
                                    **({"optimizer": checkpoint.optimizer} if checkpoint.optimizer else {})}, optimizer)
                except BaseException:
                    run.close()
                    raise
                self._state.runs[model_id] = run
            return {"path": path, "model_id": model_id, "type": "load_weights"}

        return self.log.submit(tenant, key, "LoadWeights", work, {"model_id": model_id}, self._lane(model_id))

    @staticmethod
    def _training_checkpoint(path: str) -> CheckpointPath:
        where = parse(path)
        if where.kind != "weights":
            raise InvalidArgument(f"path {path!r} is a sampler checkpoint; load_state needs a save_state one",
                                  [FieldViolation("path", "not a training checkpoint")])
        return where

    def model_info(self, tenant: str, model_id: str) -> Run:
        return self.run(tenant, model_id)

    def run_info(self, tenant: str, model_id: str) -> RunInfo:
        """The tenant's training run `model_id` with its checkpoints, live or known by its checkpoints on disk;
        NotFound for any other (another tenant's reads as unknown). Reads the disk: not for the event loop."""
        listed = tuple(self.checkpoints.listed(tenant, model_id))
        run = self._state.runs.get(model_id)
        if run is not None and run.tenant == tenant:
            session = self._state.sessions.get(model_id.partition(":")[0])
            idle_s = time.monotonic() - session.last_request if session is not None else 0.0
            return RunInfo(model_id, tenant, run.base_model, run.lora.rank, time.time() - idle_s, listed)
        if not listed:
            raise NotFound(f"training run {model_id!r} not found")
        newest = listed[-1]
        return RunInfo(model_id, tenant, newest.base_model, newest.lora_rank, newest.written_at, listed)

    def delete_checkpoint(self, tenant: str, model_id: str, checkpoint_id: str) -> None:
        """Delete one of the tenant's checkpoints (`weights/<name>` or `sampler_weights/<name>` of `model_id`)
        from disk and, on the fleet, a sampler checkpoint's versions from the weight store: a sampling client
        made from it then fails its next sample, naming the version gone (a local one keeps its copy)."""
        path = parse(f"{SCHEME}{model_id}/{checkpoint_id}", "checkpoint_id")
        self.checkpoints.delete(tenant, path)
        if path.kind == "sampler_weights" and self._fleet is not None:
            self._fleet.forget(path_job_id(tenant, str(path)))

    # ------------------------------------------------------------------ sampler versions

    def save_for_sampler(self, tenant: str, model_id: str, seq_id: int, name: str | None) -> Request:
        """Capture the run's adapter as a sampler version: a named one on disk (answering its path), an
        unnamed one as a new sampling session (answering its id)."""
        run = self.run(tenant, model_id)
        path = CheckpointPath(model_id, "sampler_weights", check_name(name)) if name else None
        generation = run.generation

        def work() -> dict[str, Any]:
            version = str(path) if path else f"{model_id}@{uuid.uuid4().hex}"
            if path is None and self._fleet is not None and isinstance(run, RemoteRun):  # the learner publishes it
                _same(run, generation)
                published = run.published_sampler(run_job_id(model_id), version, self._fleet.keep)
                session = self._new_sampler(tenant, model_id.partition(":")[0], published, None)
                return {"sampling_session_id": session.id, "type": "save_weights_for_sampler"}
            tensors = _same(run, generation).sampler_tensors()
            weights = SamplerWeights(version, run.base_model, run.lora, tensors)
            if path is not None:
                self.checkpoints.save(tenant, path, run.base_model, run.lora, {"adapter": tensors, "steps": run.steps})
                return {"path": str(path), "type": "save_weights_for_sampler"}
            if self._fleet is not None:
                weights = self._fleet.published(run_job_id(model_id), weights)
            session = self._new_sampler(tenant, model_id.partition(":")[0], weights, None)
            return {"sampling_session_id": session.id, "type": "save_weights_for_sampler"}

        return self.log.submit(tenant, (model_id, seq_id), "SaveWeightsForSampler", work, lane=self._lane(model_id))

    def create_sampling_session(self, tenant: str, session_id: str, base_model: str | None,
                                model_path: str | None) -> SamplingSession:
        """A sampling session on a base model, or on a named sampler checkpoint of the tenant's."""
        self._requested(tenant, session_id)
        if model_path:
            where = parse(model_path, "model_path")
            if where.kind != "sampler_weights":
                raise InvalidArgument(f"model_path {model_path!r} is a training checkpoint; sample from a "
                                      "save_weights_for_sampler path",
                                      [FieldViolation("model_path", "not a sampler path")])
            checkpoint = self.checkpoints.load(tenant, where)
            weights = SamplerWeights(model_path, checkpoint.base_model, checkpoint.lora, checkpoint.adapter)
            if self._fleet is not None:
                weights = self._fleet.published(path_job_id(tenant, model_path), weights)
            return self._new_sampler(tenant, session_id, weights, model_path)
        if not base_model:
            raise InvalidArgument("give base_model or model_path", [FieldViolation("base_model", "missing")])
        weights = SamplerWeights(f"base:{base_model}", self.check_model(base_model))
        return self._new_sampler(tenant, session_id, weights, None)

    def _new_sampler(self, tenant: str, session_id: str, weights: SamplerWeights,
                     model_path: str | None) -> SamplingSession:
        session = SamplingSession(f"sampler-{uuid.uuid4().hex}", tenant, session_id, weights, model_path)
        self._state.samplers[session.id] = session
        return session

    def sampler(self, tenant: str, sampling_session_id: str) -> SamplingSession:
        """The tenant's sampling session, a request of which just arrived."""
        found = self._state.samplers.get(sampling_session_id)
        if found is None or found.tenant != tenant:
            raise NotFound(f"sampling session {sampling_session_id!r} not found")
        self._requested(tenant, found.session_id)
        return found

    def sample(self, tenant: str, sampling_session_id: str, seq_id: int, params: SampleParams) -> Request:
        session = self.sampler(tenant, sampling_session_id)
        check_sample(params, self.limits.max_num_samples, self.limits.max_sample_tokens)
        ids = [f"{sampling_session_id}/{seq_id}/{i}" for i in range(params.num_samples)]
        key, extra = (sampling_session_id, seq_id), {"sample_sequence_ids": ids}
        fleet = self._fleet
        if fleet is not None:
            async def on_fleet() -> SampleResult:
                self._check_source(session)
                return await fleet.sample(session.weights, params)

            return self.log.submit_async(tenant, key, "Sample", on_fleet, fleet.loop, extra)

        def here() -> SampleResult:
            self._check_source(session)
            return self._samplers.sample(session.weights, params)

        return self.log.submit(tenant, key, "Sample", here, extra)

    def _check_source(self, session: SamplingSession) -> None:
        """A sampling client made from a checkpoint samples only while the checkpoint exists: on the fleet its
        versions go with it, so here too (the same answer wherever it runs)."""
        if session.model_path is not None and not self.checkpoints.exists(session.tenant, parse(session.model_path)):
            raise NotFound(f"checkpoint {session.model_path} was deleted: make a sampling client from another one")

    def capabilities(self) -> tuple[str, ...]:
        return self.limits.allowed_models


def _same(run: Run, generation: int) -> Run:
    """The run, unless it was restored on another learner since the request was sent: then the request fails
    as the one that found its learner lost did (`RemoteRun.restored`), and nothing runs."""
    if run.generation != generation:
        raise Unavailable(run.restored)
    return run


def _bytes(weights: SamplerWeights) -> int:
    return sum(t.numel() * t.element_size() for t in (weights.tensors or {}).values())


def _check_quota(tenant: str, what: str, held: int, most: int, setting: str) -> None:
    """Refuse one more of `what` to a tenant holding `most` already (ResourceExhausted: HTTP 429, not retried)."""
    if held >= most:
        raise ResourceExhausted(f"tenant {tenant!r} holds {held} {what}, the most the server allows ({setting} = "
                                f"{most}); close a ServiceClient (its session's runs and samplers are freed) first")


def model_id_of(session_id: str, model_seq_id: int) -> str:
    """A training run's id: the SDK derives it the same way for a run created from a checkpoint."""
    return f"{session_id}:train:{model_seq_id}"
