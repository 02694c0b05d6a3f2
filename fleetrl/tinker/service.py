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

In this landing everything runs in the tinker service process: the training runs' adapters and
optimizers, and the samplers (`Samplers`, the actors' backend). Sampler versions live in this process
(and on disk when named); checkpoints go to disk (`CheckpointStore`) and survive a restart.
"""

from __future__ import annotations

import contextlib
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fleetrl.errors import FieldViolation, InvalidArgument, NotFound, ResourceExhausted
from fleetrl.policy.models import allow_list_problem
from fleetrl.tinker.checkpoints import CheckpointPath, CheckpointStore, check_name, parse
from fleetrl.tinker.losses import LOSSES
from fleetrl.tinker.requests import Key, Request, RequestLog
from fleetrl.tinker.sampling import Samplers, SamplerWeights
from fleetrl.tinker.training import TrainingRun, lora_spec
from fleetrl.tinker.types import AdamParams, Datum, LoraRequest, SampleParams, SessionSummary


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


@dataclass
class _State:
    sessions: dict[str, Session] = field(default_factory=dict)
    runs: dict[str, TrainingRun] = field(default_factory=dict)
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

    def __init__(self, limits: Limits, log: RequestLog) -> None:
        self.limits = limits
        self.log = log
        self.checkpoints = CheckpointStore(limits.run_dir / "tinker")
        self._samplers = Samplers()
        self._state = _State()

    # ------------------------------------------------------------------ sessions

    def create_session(self, tenant: str) -> str:
        held = sum(1 for s in self._state.sessions.values() if s.tenant == tenant and not s.finished)
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

    def sessions(self, tenant: str, now: float | None = None) -> list[SessionSummary]:
        """The tenant's live sessions, newest request first; never another tenant's."""
        now = time.monotonic() if now is None else now
        live = [s for s in list(self._state.sessions.values()) if s.tenant == tenant and not s.finished]
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

    def heartbeat(self, tenant: str, session_id: str) -> Session:
        session = self.session(tenant, session_id)
        session.last_seen = time.monotonic()
        return session

    def finish_session(self, tenant: str, session_id: str) -> None:
        """Mark the session finished and free its training runs and sampling sessions (checkpoints stay on disk)."""
        self.session(tenant, session_id).finished = True
        # list(...) first: the work thread may add runs or samplers while this (the event loop) iterates
        for model_id in [m for m in list(self._state.runs) if m.startswith(f"{session_id}:")]:
            del self._state.runs[model_id]
            self.log.forget(model_id)
        for sampler_id in [i for i, s in list(self._state.samplers.items()) if s.session_id == session_id]:
            del self._state.samplers[sampler_id]
            self.log.forget(sampler_id)
        self.log.forget(f"create_model:{session_id}")

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
                self._state.runs[model_id] = TrainingRun.create(model_id, tenant, base_model, spec, seed)
            return {"model_id": model_id}

        return self.log.submit(tenant, key, "CreateModel", work, {"model_id": model_id})

    def _reserve_run(self, tenant: str, model_id: str, key: Key) -> None:
        """Count a training run about to be queued against its tenant's quota; a request the log answers
        without queuing work (a retry or replay of a name it knows, or one too old to run) counts nothing."""
        if not self.log.queues(key):
            return
        # list(...) first: the work thread adds and removes runs while this (the event loop) counts
        held = sum(1 for r in list(self._state.runs.values()) if r.tenant == tenant)
        held += sum(1 for owner in list(self._state.creating.values()) if owner == tenant)
        _check_quota(tenant, "training runs", held, self.limits.max_training_runs_per_tenant,
                     "max_training_runs_per_tenant")
        self._state.creating[model_id] = tenant

    @contextlib.contextmanager
    def _creating(self, model_id: str) -> Iterator[None]:
        """The queued creation of a training run: its reservation ends with it, created or failed."""
        try:
            yield
        finally:
            self._state.creating.pop(model_id, None)

    def run(self, tenant: str, model_id: str) -> TrainingRun:
        """The tenant's training run `model_id`, a request of which just arrived."""
        found = self._state.runs.get(model_id)
        if found is None or found.tenant != tenant:
            raise NotFound(f"model {model_id!r} not found")
        self._requested(tenant, model_id.partition(":")[0])
        return found

    def forward_backward(self, tenant: str, model_id: str, seq_id: int, data: list[Datum], loss_fn: str,
                         settings: dict[str, float], forward_only: bool) -> Request:
        run = self.run(tenant, model_id)
        _check_loss(loss_fn, settings, data)
        _check_token_ids(data, int(run.model.config.vocab_size))
        kind = "Forward" if forward_only else "ForwardBackward"
        return self.log.submit(tenant, (model_id, seq_id), kind,
                               lambda: run.forward_backward(data, loss_fn, settings, backward=not forward_only))

    def optim_step(self, tenant: str, model_id: str, seq_id: int, adam: AdamParams) -> Request:
        run = self.run(tenant, model_id)
        _check_adam(adam)
        return self.log.submit(tenant, (model_id, seq_id), "OptimStep", lambda: {"metrics": run.optim_step(adam)})

    def save_state(self, tenant: str, model_id: str, seq_id: int, name: str | None) -> Request:
        run = self.run(tenant, model_id)
        path = CheckpointPath(model_id, "weights", check_name(name) if name else f"state-{uuid.uuid4().hex[:8]}")

        def work() -> dict[str, Any]:
            self.checkpoints.save(tenant, path, run.base_model, run.lora, run.state())
            return {"path": str(path), "type": "save_weights"}

        return self.log.submit(tenant, (model_id, seq_id), "SaveWeights", work)

    def load_state(self, tenant: str, model_id: str, seq_id: int, path: str, optimizer: bool) -> Request:
        """load_state into an existing run, from one of the tenant's training checkpoints."""
        run = self.run(tenant, model_id)
        where = self._training_checkpoint(path)

        def work() -> dict[str, Any]:
            checkpoint = self.checkpoints.load(tenant, where)
            if (checkpoint.base_model, checkpoint.lora) != (run.base_model, run.lora):
                raise InvalidArgument(f"checkpoint {where} is of {checkpoint.base_model} with LoRA rank "
                                      f"{checkpoint.lora.rank}; model {model_id} is of {run.base_model} with rank "
                                      f"{run.lora.rank}", [FieldViolation("path", "another model's shape")])
            run.load_state({"adapter": checkpoint.adapter, "steps": checkpoint.steps,
                            **({"optimizer": checkpoint.optimizer} if checkpoint.optimizer else {})}, optimizer)
            return {"path": path, "model_id": model_id, "type": "load_weights"}

        return self.log.submit(tenant, (model_id, seq_id), "LoadWeights", work)

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
                run = TrainingRun.create(model_id, tenant, checkpoint.base_model, checkpoint.lora, seed=0)
                run.load_state({"adapter": checkpoint.adapter, "steps": checkpoint.steps,
                                **({"optimizer": checkpoint.optimizer} if checkpoint.optimizer else {})}, optimizer)
                self._state.runs[model_id] = run
            return {"path": path, "model_id": model_id, "type": "load_weights"}

        return self.log.submit(tenant, key, "LoadWeights", work, {"model_id": model_id})

    @staticmethod
    def _training_checkpoint(path: str) -> CheckpointPath:
        where = parse(path)
        if where.kind != "weights":
            raise InvalidArgument(f"path {path!r} is a sampler checkpoint; load_state needs a save_state one",
                                  [FieldViolation("path", "not a training checkpoint")])
        return where

    def model_info(self, tenant: str, model_id: str) -> TrainingRun:
        return self.run(tenant, model_id)

    # ------------------------------------------------------------------ sampler versions

    def save_for_sampler(self, tenant: str, model_id: str, seq_id: int, name: str | None) -> Request:
        """Capture the run's adapter as a sampler version: a named one on disk (answering its path), an
        unnamed one as a new sampling session (answering its id)."""
        run = self.run(tenant, model_id)
        path = CheckpointPath(model_id, "sampler_weights", check_name(name)) if name else None

        def work() -> dict[str, Any]:
            tensors = run.sampler_tensors()
            version = str(path) if path else f"{model_id}@{uuid.uuid4().hex}"
            weights = SamplerWeights(version, run.base_model, run.lora, tensors)
            if path is not None:
                self.checkpoints.save(tenant, path, run.base_model, run.lora, {"adapter": tensors, "steps": run.steps})
                return {"path": str(path), "type": "save_weights_for_sampler"}
            session = self._new_sampler(tenant, model_id.partition(":")[0], weights, None)
            return {"sampling_session_id": session.id, "type": "save_weights_for_sampler"}

        return self.log.submit(tenant, (model_id, seq_id), "SaveWeightsForSampler", work)

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
        self._check_sample(params)
        ids = [f"{sampling_session_id}/{seq_id}/{i}" for i in range(params.num_samples)]
        return self.log.submit(tenant, (sampling_session_id, seq_id), "Sample",
                               lambda: self._samplers.sample(session.weights, params), {"sample_sequence_ids": ids})

    def _check_sample(self, params: SampleParams) -> None:
        limits = self.limits
        problems = [FieldViolation(name, why) for name, bad, why in (
            ("num_samples", not 1 <= params.num_samples <= limits.max_num_samples, f"1..{limits.max_num_samples}"),
            ("sampling_params.max_tokens", not 1 <= params.max_tokens <= limits.max_sample_tokens,
             f"1..{limits.max_sample_tokens}"),
            ("sampling_params.temperature", not params.temperature > 0, "must be > 0 (no greedy decoding yet)"),
            ("sampling_params.top_p", not 0 < params.top_p <= 1, "in (0, 1]"),
            ("prompt", not params.prompt, "empty"),
        ) if bad]
        if problems:
            raise InvalidArgument("bad sample request: " + "; ".join(f"{p.field}: {p.description}" for p in problems),
                                  problems)

    def capabilities(self) -> tuple[str, ...]:
        return self.limits.allowed_models


def _check_quota(tenant: str, what: str, held: int, most: int, setting: str) -> None:
    """Refuse one more of `what` to a tenant holding `most` already (ResourceExhausted: HTTP 429, not retried)."""
    if held >= most:
        raise ResourceExhausted(f"tenant {tenant!r} holds {held} {what}, the most the server allows ({setting} = "
                                f"{most}); close a ServiceClient (its session's runs and samplers are freed) first")


def model_id_of(session_id: str, model_seq_id: int) -> str:
    """A training run's id: the SDK derives it the same way for a run created from a checkpoint."""
    return f"{session_id}:train:{model_seq_id}"


def _check_loss(loss_fn: str, settings: dict[str, float], data: list[Datum]) -> None:
    """InvalidArgument naming the field when the loss, its settings or a datum's inputs do not fit."""
    loss = LOSSES.get(loss_fn)
    if loss is None:
        raise InvalidArgument(f"loss_fn {loss_fn!r} is not supported; supported: {', '.join(LOSSES)}",
                              [FieldViolation("loss_fn", "unsupported")])
    unknown = sorted(set(settings) - set(loss.settings))
    if unknown:
        raise InvalidArgument(f"loss_fn_config {unknown} not accepted by {loss_fn} (accepts {sorted(loss.settings)})",
                              [FieldViolation("loss_fn_config", "unknown keys")])
    if not data:
        raise InvalidArgument("no datums", [FieldViolation("data", "empty")])
    for i, datum in enumerate(data):
        _check_datum(i, datum, loss_fn, ("target_tokens", *loss.required), loss.optional)


def _check_datum(i: int, datum: Datum, loss_fn: str, required: tuple[str, ...], optional: tuple[str, ...]) -> None:
    where = f"data[{i}].loss_fn_inputs"
    missing = [name for name in required if name not in datum.inputs]
    unknown = [name for name in datum.inputs if name not in required and name not in optional]
    if missing or unknown:
        raise InvalidArgument(f"{where}: {loss_fn} needs {list(required)}" + (f", may take {list(optional)}"
                              if optional else "") + f"; missing {missing}, unknown {unknown}",
                              [FieldViolation(where, "inputs do not fit the loss")])
    if not datum.tokens:
        raise InvalidArgument(f"data[{i}].model_input is empty", [FieldViolation(f"data[{i}].model_input", "empty")])
    for name, values in datum.inputs.items():
        if values.shape != (len(datum.tokens),):
            raise InvalidArgument(f"{where}.{name} has shape {list(values.shape)}; model_input has "
                                  f"{len(datum.tokens)} tokens, so it must be [{len(datum.tokens)}]",
                                  [FieldViolation(f"{where}.{name}", "shape does not match model_input")])
        if not np.isfinite(values).all():
            raise InvalidArgument(f"{where}.{name} holds a non-finite value",
                                  [FieldViolation(f"{where}.{name}", "not finite")])


def _check_token_ids(data: list[Datum], vocab_size: int) -> None:
    for i, datum in enumerate(data):
        for where, ids in ((f"data[{i}].model_input", np.asarray(datum.tokens)),
                           (f"data[{i}].loss_fn_inputs.target_tokens", datum.inputs["target_tokens"])):
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise InvalidArgument(f"{where} holds token ids outside the model's vocabulary [0, {vocab_size})",
                                      [FieldViolation(where, "token id out of range")])


def _check_adam(adam: AdamParams) -> None:
    checks: list[tuple[str, Callable[[float], bool], str]] = [
        ("learning_rate", lambda v: v >= 0, ">= 0"), ("beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
        ("beta2", lambda v: 0 <= v < 1, "in [0, 1)"), ("eps", lambda v: v > 0, "> 0"),
        ("weight_decay", lambda v: v >= 0, ">= 0"), ("grad_clip_norm", lambda v: v >= 0, ">= 0")]
    bad = [FieldViolation(f"adam_params.{name}", why) for name, ok, why in checks
           if not (np.isfinite(getattr(adam, name)) and ok(getattr(adam, name)))]
    if bad:
        raise InvalidArgument("bad adam_params: " + "; ".join(f"{v.field} {v.description}" for v in bad), bad)
