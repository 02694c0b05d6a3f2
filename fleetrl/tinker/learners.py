"""Tinker training on the fleet's learners (`training = "fleet"`): each training run lives on one learner,
which holds its adapter and AdamW state on its shared base; the tinker service drives it over NATS.

The learner's side, `TrainingHost` (a learner with `tinker_models`): it answers placements of runs of those
bases (`bus.train_place_subject`, one queue group over every such learner: one of them takes each) while it
has fewer than `max_runs`, creates the run (`TrainingRun`, its base taken from the learner's `SharedBases`, the
one its LoRA jobs use) and then runs the run's calls sent to its own subject (`bus.train_host_subject`) on the
learner's compute thread, where its jobs' steps take turns with them. Every call carries an id (the service's
request name); the answers of a run's last `REMEMBERED_CALLS` are kept, so a call sent again after a lost
answer gets the first answer and runs nothing twice. Pings are answered on their own subject, on the event
loop, while a call computes. A run idle for `idle_s` is dropped (its service lost it and restored it
elsewhere, or ended). A learner holding `max_runs` leaves the placement queue groups until a run leaves, so
placements go to learners with room; one that fills while a placement is on its way answers "full", and the
service asks again (`PLACE_TRIES`).

The tinker service's side, `LearnerTraining`: `create(...)` places a run and returns a `RemoteRun`, which the
service uses as it uses a local `TrainingRun`, from its work thread. While a call waits for its answer the
run's learner is pinged every `PING_S`; no subscriber on its subject (NATS answers "no responders" at once:
the learner's process is gone), no answer by `timeout_s`, or an answer that it holds no such run (it restarted
under its id) means the learner is lost. The run is then
restored on any learner from its newest `save_state` checkpoint (adapter, optimizer and step count, as
`load_state` with the optimizer restores them), and the call fails with `Unavailable` saying so: the
gradients and steps since that checkpoint are gone, nothing was applied to other weights, and every call of
the run sent before the loss was known fails the same way (`generation`). A run with no `save_state` has
nothing to restore: it fails every later call (FailedPrecondition). The old learner, if it was only slow,
keeps a copy that no call reaches (its placement id is retired) until its idle timeout.

Wire format: a body is a dict of tensors, lists and plain values, written with `torch.save` and read with
`torch.load(weights_only=True)` (no pickled code runs). A body over `INLINE_BYTES` (a large chunk, a
run's state, an adapter) goes through the weight store's transport under the service's exchange namespace
(`exchange_namespace`), named in the `Fleet-Blob` header, and its reader deletes it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import io
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import nats.errors
import torch
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from fleetrl.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    FieldViolation,
    FleetError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from fleetrl.policy.lora import SharedBases
from fleetrl.runtime import background
from fleetrl.spec.config import LoraSpec
from fleetrl.tasks import bus
from fleetrl.tinker.fleet import SamplerVersions, run_job_id
from fleetrl.tinker.sampling import SamplerWeights
from fleetrl.tinker.training import TrainingRun
from fleetrl.tinker.types import AdamParams, Datum, ForwardResult
from fleetrl.weights.channel import WeightPointer
from fleetrl.weights.transport import Transport

log = logging.getLogger(__name__)

INLINE_BYTES = 512 * 1024
"""Bodies up to this size travel in the NATS message (NATS's default max_payload is 1 MiB); larger ones
through the weight store's transport."""
BLOB_HEADER = "Fleet-Blob"
EXCHANGE_HEADER = "Fleet-Exchange"
PING_S = 2.0
"""How often a waiting call pings its learner, and how long a ping may take."""
PLACE_TRIES = 8
"""Placements tried before a create fails: the queue group hands each to one learner, which may be full."""
REMEMBERED_CALLS = 32
"""Answers a learner keeps per run, by call id, for a call sent again."""
ERRORS: dict[str, type[FleetError]] = {cls.__name__: cls for cls in (
    InvalidArgument, NotFound, FailedPrecondition, ResourceExhausted, Unavailable, DeadlineExceeded)}
"""Errors a learner's answer carries by name and the service raises again; any other becomes Unavailable."""


def encode(body: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(body, buffer)
    return buffer.getvalue()


def decode(data: bytes | memoryview) -> dict[str, Any]:
    body: dict[str, Any] = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    return body


def exchange_namespace(service_id: str) -> str:
    """Where a tinker service's large bodies, and its learners' large answers, wait to be read."""
    return bus.check_job_id(f"tkx-{service_id}"[:64])


async def _send(nc: NATS, transport: Transport, namespace: str, subject: str, body: dict[str, Any],
                timeout_s: float | None = None) -> Msg | None:
    """Publish body to subject (a request when timeout_s is given: its answer), large bodies by reference."""
    data, headers = encode(body), {EXCHANGE_HEADER: namespace}
    if len(data) > INLINE_BYTES:
        name = f"b-{uuid.uuid4().hex}"
        await transport.put(namespace, name, data)
        data, headers[BLOB_HEADER] = b"", name
    if timeout_s is None:
        await nc.publish(subject, data, headers=headers)
        return None
    return await nc.request(subject, data, timeout=timeout_s, headers=headers)


async def _read(transport: Transport, msg: Msg) -> dict[str, Any]:
    """A message's body, read from the transport (and deleted there) when it came by reference."""
    name = (msg.headers or {}).get(BLOB_HEADER)
    if not name:
        return decode(msg.data)
    namespace = (msg.headers or {})[EXCHANGE_HEADER]
    fetched = await transport.get(namespace, name, None)
    await transport.delete(namespace, name)
    return decode(fetched.payload)


async def _unsubscribe(sub: Subscription) -> None:
    try:
        await sub.unsubscribe()
    except Exception as error:  # the connection is closing anyway
        log.debug("unsubscribing failed: %s", error)


def _error_body(error: Exception) -> dict[str, Any]:
    return {"error": str(error), "type": type(error).__name__}


def _raised(body: dict[str, Any], where: str) -> dict[str, Any]:
    """An answer's result, or its error raised again with its type (Unavailable for an unknown one)."""
    if "error" not in body:
        return body
    error_type = ERRORS.get(body["type"], Unavailable)
    message = body["error"] if body["type"] in ERRORS else f"{body['type']}: {body['error']}"
    raise error_type(f"{where}: {message}")


# ---------------------------------------------------------------------------------------------- learner side


@dataclass
class _Hosted:
    run: TrainingRun
    answers: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)
    last_call: float = field(default_factory=time.monotonic)


class TrainingHost:
    """A learner's Tinker training runs: placed here by the service, driven by its calls."""

    learner_id: str
    models: tuple[str, ...]
    max_runs: int
    idle_s: float
    _runs: dict[str, _Hosted]
    """By placement id."""
    _reserved: int
    """Placements accepted whose run is still being created."""
    _subs: list[Subscription]
    _placing: list[Subscription]
    """The placement subscriptions, held while the learner has room: a full learner leaves the queue group, so
    placements go to the others at once (and rejoins when a run leaves)."""

    def __init__(self, nc: NATS, transport: Transport, learner_id: str, models: list[str], *, max_runs: int,
                 idle_s: float, compute: concurrent.futures.Executor | None, bases: SharedBases,
                 versions: SamplerVersions | None = None) -> None:
        self.learner_id, self.models, self.max_runs, self.idle_s = learner_id, tuple(models), max_runs, idle_s
        self._nc, self._transport, self._compute, self._bases = nc, transport, compute, bases
        self._versions = versions
        self._runs, self._reserved, self._subs, self._placing = {}, 0, [], []
        self._placements: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        subject = bus.train_host_subject(self.learner_id)
        self._subs.append(await self._nc.subscribe(subject, cb=self._on_call))
        self._subs.append(await self._nc.subscribe(f"{subject}.ping", cb=self._on_ping))
        await self._take_placements()
        log.info("hosting tinker training runs of %s (at most %d)", ", ".join(self.models), self.max_runs)

    def _has_room(self) -> bool:
        return len(self._runs) + self._reserved < self.max_runs

    async def _take_placements(self) -> None:
        """Join (or leave) the placement queue groups as the learner has room (or not)."""
        room = self._has_room()
        if room and not self._placing:
            for model in self.models:
                self._placing.append(await self._nc.subscribe(bus.train_place_subject(model), queue=bus.TRAIN_HOSTS,
                                                              cb=self._on_place))
        elif not room and self._placing:
            placing, self._placing = self._placing, []
            for sub in placing:
                await _unsubscribe(sub)

    async def close(self) -> None:
        for placing in list(self._placements):
            await background.stop(placing)
        for sub in [*self._subs, *self._placing]:
            await _unsubscribe(sub)
        for hosted in self._runs.values():
            hosted.run.close()
        self._runs.clear()

    async def drop_idle(self, now: float | None = None) -> list[str]:
        """Drop the runs no call reached for `idle_s`; their placement ids."""
        now = time.monotonic() if now is None else now
        idle = [pid for pid, hosted in self._runs.items() if now - hosted.last_call > self.idle_s]
        for pid in idle:
            self._runs.pop(pid).run.close()
            log.info("dropped tinker training run %s: no call for %.0f s", pid, self.idle_s)
        await self._take_placements()
        return idle

    async def _on_ping(self, msg: Msg) -> None:
        await msg.respond(b"")

    async def _answer(self, msg: Msg, namespace: str, body: dict[str, Any]) -> None:
        if msg.reply:
            await _send(self._nc, self._transport, namespace, msg.reply, body)

    async def _on_place(self, msg: Msg) -> None:
        """A placement: answered "full" at once, or taken (its run created in a task of its own: the callback
        must return before the learner may leave the queue group, which ends the subscription's task)."""
        namespace = (msg.headers or {}).get(EXCHANGE_HEADER, "")
        if not self._has_room():
            await self._answer(msg, namespace, {"full": True, "learner": self.learner_id})
            return
        self._reserved += 1
        placing = asyncio.create_task(self._place(msg, namespace))
        self._placements.add(placing)
        placing.add_done_callback(self._placements.discard)

    async def _place(self, msg: Msg, namespace: str) -> None:
        try:
            await self._take_placements()  # full now: leave the queue group
            body = await _read(self._transport, msg)
            pid = f"{body['model_id']}@{uuid.uuid4().hex[:12]}"
            lora = LoraSpec.model_validate(body["lora"])
            run = await asyncio.get_running_loop().run_in_executor(
                self._compute, TrainingRun.create, body["model_id"], body["tenant"], body["base_model"], lora,
                body["seed"], self._bases)
            hosted = _Hosted(run)
            if body.get("state") is not None:
                await asyncio.get_running_loop().run_in_executor(
                    self._compute, run.load_state, body["state"], bool(body["with_optimizer"]))
            self._runs[pid] = hosted
            log.info("tinker training run %s placed here (%d held)", pid, len(self._runs))
            answer = {"learner": self.learner_id, "placement": pid, "vocab_size": run.vocab_size, "arch": run.arch,
                      "tokenizer_id": run.tokenizer_id, **self._progress(run)}
        except Exception as error:
            log.warning("placing a tinker training run failed: %s: %s", type(error).__name__, error)
            answer = _error_body(error)
        finally:
            self._reserved -= 1
        await self._take_placements()
        await self._answer(msg, namespace, answer)

    async def _on_call(self, msg: Msg) -> None:
        namespace = (msg.headers or {}).get(EXCHANGE_HEADER, "")
        try:
            body = await _read(self._transport, msg)
            hosted = self._runs.get(body["placement"])
            if hosted is None:  # this learner restarted under its id since, or dropped the run as idle
                await self._answer(msg, namespace, {"gone": f"learner {self.learner_id} holds no training run "
                                                            f"{body['placement']} (restarted, or the run was idle)"})
                return
            hosted.last_call = time.monotonic()
            answer = hosted.answers.get(body["call"])
            if answer is None:  # a call sent again after a lost answer runs nothing twice
                answer = await self._computed(hosted, body)
                hosted.answers[body["call"]] = answer
                while len(hosted.answers) > REMEMBERED_CALLS:
                    hosted.answers.popitem(last=False)
            if body["op"] == "close":
                self._runs.pop(body["placement"], None)
                if self._versions is not None:
                    self._versions.drop(run_job_id(hosted.run.model_id))
                await self._take_placements()
        except Exception as error:
            answer = _error_body(error)
        await self._answer(msg, namespace, answer)

    async def _computed(self, hosted: _Hosted, body: dict[str, Any]) -> dict[str, Any]:
        """A call's answer: on the compute thread, and a sampler version's publish on the event loop after it."""
        loop = asyncio.get_running_loop()
        if body["op"] != "publish_sampler":
            return await loop.run_in_executor(self._compute, self._run, hosted, body)
        run = hosted.run
        try:
            if self._versions is None:
                raise FailedPrecondition(f"learner {self.learner_id} has no weight store to publish sampler versions")
            tensors = await loop.run_in_executor(self._compute, run.sampler_tensors)
            weights = await self._versions.publish(
                body["job_id"], SamplerWeights(body["version"], run.base_model, run.lora, tensors), keep=body["keep"],
                epoch=body["epoch"])
            assert weights.pointer is not None
            return {"result": {"pointer": weights.pointer.to_json().decode()}, **self._progress(run)}
        except Exception as error:  # NATS unreachable past its retries, the store full: the service's error
            log.warning("publishing a sampler version of %s failed: %s: %s", run.model_id, type(error).__name__, error)
            return _error_body(error)

    def _run(self, hosted: _Hosted, body: dict[str, Any]) -> dict[str, Any]:
        """One call on the compute thread: its result, or its error as an answer."""
        run, op = hosted.run, body["op"]
        try:
            if op == "forward_backward":
                data = [Datum([int(t) for t in d["tokens"].tolist()], {k: v.numpy() for k, v in d["inputs"].items()})
                        for d in body["data"]]
                result = run.forward_backward(data, body["loss_fn"], body["settings"], backward=body["backward"])
                out: Any = {"logprobs": [torch.from_numpy(lp) for lp in result.logprobs], "metrics": result.metrics}
            elif op == "optim_step":
                out = run.optim_step(AdamParams(**body["adam"]))
            elif op == "sampler_tensors":
                out = run.sampler_tensors()
            elif op == "state":
                out = run.state(body["with_optimizer"])
            elif op == "load_state":
                run.load_state(body["state"], body["with_optimizer"])
                out = None
            elif op == "close":
                run.close()
                out = None
            else:
                raise InvalidArgument(f"unknown call {op!r}", [FieldViolation("op", "unknown")])
        except Exception as error:
            if not isinstance(error, FleetError):
                log.exception("tinker call %s of %s failed", op, run.model_id)
            return _error_body(error)
        return {"result": out, **self._progress(run)}

    @staticmethod
    def _progress(run: TrainingRun) -> dict[str, Any]:
        return {"steps": run.steps, "pending_chunks": run.pending_chunks, "own_bytes": run.own_bytes()}


# ---------------------------------------------------------------------------------------------- service side


class LearnerLost(Exception):
    """The learner holding a run stopped answering (or is gone)."""


@dataclass(frozen=True)
class Restorable:
    """A run's newest save_state checkpoint, as the service reads it from its store."""

    path: str
    steps: int
    state: dict[str, Any]
    """`TrainingRun.state()`'s shape: adapter, steps, optimizer when saved with it."""


class LearnerTraining:
    """The tinker service's link to the learners hosting its training runs."""

    timeout_s: float
    loop: asyncio.AbstractEventLoop
    namespace: str
    _nc: NATS
    _transport: Transport

    def __init__(self, nc: NATS, transport: Transport, loop: asyncio.AbstractEventLoop, service_id: str, *,
                 timeout_s: float) -> None:
        self._nc, self._transport, self.loop, self.timeout_s = nc, transport, loop, timeout_s
        self.namespace = exchange_namespace(service_id)

    def create(self, model_id: str, tenant: str, base_model: str, lora: LoraSpec, seed: int,
               last_state: Callable[[], Restorable | None]) -> RemoteRun:
        """A new run on a learner serving base_model (from the work thread); `last_state` reads its newest
        save_state checkpoint when its learner is lost."""
        run = RemoteRun(self, model_id, tenant, base_model, lora, seed, last_state)
        run.place(None)
        return run

    def blocking(self, coroutine: Any) -> Any:
        """Run a coroutine on the service's event loop from the work thread (bounded by its own deadlines)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    async def place(self, body: dict[str, Any]) -> dict[str, Any]:
        """Ask the learners serving body's base to take the run: the first that has room."""
        model = body["base_model"]
        for _ in range(PLACE_TRIES):
            try:
                msg = await _send(self._nc, self._transport, self.namespace, bus.train_place_subject(model), body,
                                  self.timeout_s)
            except nats.errors.NoRespondersError:
                raise Unavailable(f"no learner has room for a Tinker training run of {model}: none hosts it (a "
                                  "learner with it among its tinker_models), or each holds its tinker_max_runs"
                                  ) from None
            except TimeoutError:
                raise DeadlineExceeded(f"no learner took a training run of {model} within {self.timeout_s:g} s "
                                       "(train_timeout_s)") from None
            assert msg is not None
            answer = _raised(await _read(self._transport, msg), f"placing {body['model_id']}")
            if not answer.get("full"):
                return answer
        raise ResourceExhausted(f"no learner hosting {model} had room for another training run in {PLACE_TRIES} "
                                "tries (each holds at most its tinker_max_runs)")

    async def call(self, learner_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """A call to the learner holding a run, its answer. A call whose answer does not come within timeout_s is
        sent again, once, while the learner answers pings (its answer was lost, say in a NATS restart: the
        learner answers the resend from what it remembers, running nothing twice); LearnerLost when the learner
        is gone, does not answer pings either, or no longer holds the run (it restarted under its id)."""
        subject = bus.train_host_subject(learner_id)
        for sent in range(2):
            try:
                msg = await self._ask(subject, body)
                answer = await _read(self._transport, msg)
                if "gone" in answer:
                    raise LearnerLost(answer["gone"])
                return answer
            except nats.errors.NoRespondersError:
                raise LearnerLost(f"learner {learner_id} is gone (nothing subscribed to its subject)") from None
            except TimeoutError:
                if sent or not await self._alive(subject):
                    raise LearnerLost(f"learner {learner_id} did not answer within {self.timeout_s:g} s "
                                      "(train_timeout_s)") from None
                log.warning("learner %s did not answer %s within %g s but answers pings: sending it again",
                            learner_id, body["call"], self.timeout_s)
        raise AssertionError("unreachable")

    async def _ask(self, subject: str, body: dict[str, Any]) -> Msg:
        """Send a call and wait for its answer, pinging the learner every PING_S meanwhile: NoRespondersError
        as soon as nothing is subscribed to its subject (its process is gone), TimeoutError after timeout_s."""
        asked = asyncio.ensure_future(_send(self._nc, self._transport, self.namespace, subject, body,
                                            self.timeout_s))
        try:
            while True:
                done, _ = await asyncio.wait([asked], timeout=PING_S)
                if done:
                    msg = asked.result()
                    assert msg is not None
                    return msg
                try:
                    await self._ping(subject)
                except TimeoutError:  # stopped, or NATS slow: the call's own deadline decides
                    continue
        finally:
            asked.cancel()

    async def _ping(self, subject: str) -> None:
        """The learner's answer to a ping within PING_S: NoRespondersError when it is gone, TimeoutError when
        it does not answer."""
        await self._nc.request(f"{subject}.ping", b"", timeout=PING_S)

    async def _alive(self, subject: str) -> bool:
        try:
            await self._ping(subject)
        except (TimeoutError, nats.errors.NoRespondersError):
            return False
        return True

    async def purge(self) -> None:
        await self._transport.purge(self.namespace)


class RemoteRun:
    """A training run held by a learner, used by the service as a local `TrainingRun` (from its work thread)."""

    model_id: str
    tenant: str
    base_model: str
    lora: LoraSpec
    steps: int
    pending_chunks: int
    vocab_size: int
    arch: str
    tokenizer_id: str
    generation: int
    """Incremented each time the run is restored on another learner: calls sent before fail (`restored`)."""
    restored: str
    """Why the run was restored, and from what: the error of every call sent before it."""
    learner_id: str | None
    """Where it is held; None while it is not placed (lost, and not restored yet)."""
    _placement: str
    _own_bytes: int
    _dead: str
    """Set when the run cannot be restored: every call fails with it."""

    def __init__(self, link: LearnerTraining, model_id: str, tenant: str, base_model: str, lora: LoraSpec,
                 seed: int, last_state: Callable[[], Restorable | None]) -> None:
        self._link, self._seed, self._last_state = link, seed, last_state
        self.model_id, self.tenant, self.base_model, self.lora = model_id, tenant, base_model, lora
        self.steps = self.pending_chunks = self.vocab_size = self.generation = self._own_bytes = 0
        self.restored = self._dead = self._placement = self.arch = self.tokenizer_id = ""
        self.learner_id = None
        self._calls = 0

    def place(self, restorable: Restorable | None) -> None:
        """Put the run on a learner, fresh or from a checkpoint's state (with its optimizer)."""
        body = {"model_id": self.model_id, "tenant": self.tenant, "base_model": self.base_model,
                "lora": self.lora.model_dump(mode="json"), "seed": self._seed,
                "state": restorable.state if restorable is not None else None, "with_optimizer": True}
        answer = self._link.blocking(self._link.place(body))
        self.learner_id, self._placement = answer["learner"], answer["placement"]
        self.vocab_size, self.arch, self.tokenizer_id = answer["vocab_size"], answer["arch"], answer["tokenizer_id"]
        self._progress(answer)
        log.info("training run %s on learner %s (%s)", self.model_id, self.learner_id, self._placement)

    def _progress(self, answer: dict[str, Any]) -> None:
        self.steps, self.pending_chunks = answer["steps"], answer["pending_chunks"]
        self._own_bytes = answer["own_bytes"]

    def _next_call(self, op: str, **body: Any) -> dict[str, Any]:
        """A call's body, named by the placement and a counter (the learner's memory of answers keys on it)."""
        self._calls += 1
        return {"op": op, "placement": self._placement, "call": f"{self._placement}/{self._calls}", **body}

    def _call(self, op: str, **body: Any) -> Any:
        if self._dead:
            raise FailedPrecondition(self._dead)
        if self.learner_id is None:
            self._restore(f"its learner was lost before {op}")
        try:
            answer = self._link.blocking(self._link.call(self.learner_id, self._next_call(op, **body)))
        except LearnerLost as lost:
            self._restore(f"{lost}, during {op}")
        answer = _raised(answer, f"{op} of {self.model_id} on learner {self.learner_id}")
        self._progress(answer)
        return answer["result"]

    def _restore(self, why: str) -> NoReturn:
        """The run's learner is lost: restore the run from its newest save_state on any learner, and raise the
        error every call sent before now gets."""
        lost_on, self.learner_id = self.learner_id, None
        self.generation += 1
        restorable = self._last_state()
        if restorable is None:
            self._dead = (f"training run {self.model_id} was lost with its learner ({why}) and has no save_state "
                          "checkpoint to resume from: create a new training client")
            raise FailedPrecondition(self._dead)
        try:
            self.place(restorable)
        except FleetError as error:
            self.restored = (f"training run {self.model_id} was lost with learner {lost_on} ({why}); restoring it "
                             f"from {restorable.path} failed ({error}), and is tried again at its next call")
            raise Unavailable(self.restored) from None
        self.restored = (f"training run {self.model_id} was lost with learner {lost_on} ({why}): it was restored "
                         f"on learner {self.learner_id} from its save_state {restorable.path} (step "
                         f"{restorable.steps}); the gradients and steps since were lost and this call was not "
                         "applied, nor is any call sent before this error")
        log.warning("%s", self.restored)
        raise Unavailable(self.restored)

    def forward_backward(self, data: list[Datum], loss_fn: str, settings: dict[str, float],
                         backward: bool) -> ForwardResult:
        wire = [{"tokens": torch.tensor(d.tokens, dtype=torch.long),
                 "inputs": {k: torch.tensor(v) for k, v in d.inputs.items()}} for d in data]
        out = self._call("forward_backward", data=wire, loss_fn=loss_fn, settings=dict(settings), backward=backward)
        return ForwardResult([lp.numpy() for lp in out["logprobs"]], dict(out["metrics"]))

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        metrics: dict[str, float] = self._call("optim_step", adam=dataclasses.asdict(adam))
        return metrics

    def sampler_tensors(self) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = self._call("sampler_tensors")
        return tensors

    def published_sampler(self, job_id: str, version: str, keep: int) -> SamplerWeights:
        """The run's adapter as a sampler version in the weight store under job_id, published by its learner (the
        tensors never come here), fenced with the run's generation."""
        out = self._call("publish_sampler", job_id=job_id, version=version, keep=keep, epoch=self.generation)
        pointer = WeightPointer.from_json(out["pointer"].encode())
        return SamplerWeights(version, self.base_model, self.lora, None, job_id, pointer)

    def state(self, with_optimizer: bool = True) -> dict[str, Any]:
        state: dict[str, Any] = self._call("state", with_optimizer=with_optimizer)
        return state

    def load_state(self, state: dict[str, Any], with_optimizer: bool) -> None:
        self._call("load_state", state=state, with_optimizer=with_optimizer)

    def own_bytes(self) -> int:
        return self._own_bytes

    def close(self) -> None:
        """Free the run on its learner, in the background (from any thread, the event loop's too: a session's end
        closes its runs there); a lost learner holds nothing to free, and a failure is logged."""
        learner_id, self.learner_id = self.learner_id, None
        if learner_id is None or self._dead:
            return
        closing = asyncio.run_coroutine_threadsafe(self._link.call(learner_id, self._next_call("close")),
                                                   self._link.loop)

        def logged(done: concurrent.futures.Future[dict[str, Any]]) -> None:
            error = None if done.cancelled() else done.exception()
            if error is None and not done.cancelled():
                error = _error_of(done.result())
            if error is not None:
                log.warning("closing training run %s on learner %s failed: %s", self.model_id, learner_id, error)

        closing.add_done_callback(logged)


def _error_of(answer: dict[str, Any]) -> Exception | None:
    try:
        _raised(answer, "close")
    except FleetError as error:
        return error
    return None
