"""Tinker sampling on the fleet's actors (`sampling = "fleet"`): sampler versions through the weight store,
sample requests through JetStream (`fleetrl.tasks.samples`), any actor serving the base answering.

The tinker service's side, `FleetSampling`:
- `publish(job_id, weights)`: a sampler version's adapter (the float32 tensors the local path samples
  from) goes to the weight store under a namespace of its own, a pseudo job id (`run_job_id`: `tk-<session>-<run>`
  for a training run's versions, `path_job_id` for a named checkpoint loaded by path), through the learner's
  `WeightPublisher`: an adapter pointer (kind "adapter", its base named), its sha256, moved only forward,
  the last `keep` versions kept. A payload equal to the namespace's newest version is not published again.
  A training run's namespace is deleted when its session ends (`forget`); a checkpoint's when the checkpoint
  is deleted (`TinkerService.delete_checkpoint`).
- `sample(weights, params)`: the request (base, LoRA shape, namespace and pointer, prompt and sampling
  parameters, seed drawn here when the client gave none, so a redelivery samples the same) to
  `SampleRequester`, within `timeout_s`; an actor's error comes back as FailedPrecondition (the caller's)
  or Unavailable (the server's), a missing answer as DeadlineExceeded: the SDK's failed future.

The actor's side, `ActorSampling`: `serve(payload)` pulls the version by its pointer (`WeightChannel.pull`:
the digest checked; an older version, pruned, is a clear error) unless cached (the last `adapters_cached`
versions), copies it into the namespace's adapter on the actor's shared base (`SharedBaseBackend`: the base
its LoRA jobs use, held once; the last `adapters_cached` namespaces keep theirs) and samples with the local
path's `sample_with`. The adapter is applied unmerged, as the trainer's PEFT layers apply it; the local path
merges it into its weights: the same function, rounded differently.
`run(queue, stop)` serves one base's requests until stop, taking up to `batch` (`tinker_sample_batch`) of those
waiting at once. Those that can share a batch (each namespace at one version, since its adapter holds one at a
time; no stop tokens of their own) are decoded together: one `RoundBatch` of the job rounds' kind, whose
`generate_together` mixes their adapters on the shared base (`shared_base.generate_mixed`), each request's rows
through its own adapter and drawn from its own seed; the rest one at a time. Errors that a later delivery may
not meet (NATS unreachable, a pull past its deadline) are raised to the queue, which releases the request for
redelivery; any other is answered as an error result at once.

Wire format: JSON (`encode_request`, `encode_result`); prompt log-probs' leading NaN travels as `NaN`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import random
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from nats.aio.msg import Msg

from fleetrl.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from fleetrl.policy.shared_base import SharedBaseBackend
from fleetrl.rollout.batching import RoundBatch
from fleetrl.spec.config import LoraSpec
from fleetrl.tasks import bus
from fleetrl.tasks.samples import SampleQueue, SampleRequester
from fleetrl.tinker.sampling import SamplerWeights, batchable, group_request, sample_with, sequence_of
from fleetrl.tinker.types import SampleParams, SampleResult, Sequence
from fleetrl.weights.channel import WeightChannel, WeightPointer, decode_safetensors, encode_safetensors
from fleetrl.weights.publish import WeightPublisher

log = logging.getLogger(__name__)
DTYPE = "float32"
"""Sampler versions travel as the local path holds them, so both paths sample from the same weights."""
FETCH_S = 1.0
"""How long an actor's sample loop waits for a request before it looks at its stop event again."""
LINGER_FETCH_S = 0.01
"""The fetch after a linger takes what is waiting: it waits no longer than this for more."""
USER_ERRORS = (InvalidArgument, NotFound, FailedPrecondition)
RETRIED: tuple[type[Exception], ...] = (*bus.NATS_UNREACHABLE, Unavailable, DeadlineExceeded)
"""An actor's errors that another delivery may not meet: released for redelivery, not answered."""


def run_job_id(model_id: str) -> str:
    """A training run's sampler namespace: `session-<hex>:train:<n>` -> `tk-<hex>-<n>`."""
    session, _, seq = model_id.partition(":train:")
    return bus.check_job_id(f"tk-{session.removeprefix('session-')}-{seq}")


def path_job_id(tenant: str, path: str) -> str:
    """The sampler namespace of a named checkpoint (`tinker://.../sampler_weights/<name>`) of a tenant."""
    digest = hashlib.sha256(f"{tenant}/{path}".encode()).hexdigest()
    return bus.check_job_id(f"tk-p-{digest[:40]}")


class SamplerVersions:
    """Sampler versions published to the weight store, by namespace: the tinker service's (`FleetSampling`), or a
    learner's for the runs it holds (`fleetrl.tinker.learners`: the adapter goes from the learner to the store,
    not through the service). `epoch` is the pointer's fence: a learner holding a run restored elsewhere
    publishes with the run's higher generation, so the learner it was lost on can no longer move the pointer."""

    _store: WeightChannel
    _publishers: dict[tuple[str, int], WeightPublisher]
    _publishing: asyncio.Lock

    def __init__(self, store: WeightChannel) -> None:
        self._store = store
        self._publishers = {}
        self._publishing = asyncio.Lock()

    async def publish(self, job_id: str, weights: SamplerWeights, *, keep: int, epoch: int = 0) -> SamplerWeights:
        """The version with its adapter in the weight store under job_id (tensors dropped here); the base as it is.
        A payload equal to the namespace's newest version is not published again."""
        if weights.tensors is None:
            return weights
        tensors = {name: t.to(torch.float32).contiguous() for name, t in weights.tensors.items()}
        sha256 = hashlib.sha256(encode_safetensors(tensors)).hexdigest()
        async with self._publishing:
            publisher = self._publishers.get((job_id, epoch))
            if publisher is None:
                publisher = WeightPublisher(self._store, job_id, DTYPE, interval=1, keep=keep, lease_epoch=epoch,
                                            adapter_of=weights.base_model)
                await publisher.sync()
                self._publishers[(job_id, epoch)] = publisher
            latest = await self._store.latest(job_id)
            if latest is not None and latest.sha256 == sha256:
                pointer = latest
            else:
                pointer = await publisher.publish_tensors(tensors, publisher.published_version + 1)
        log.info("sampler version %s published as %s v%d", weights.version, job_id, pointer.version)
        return dataclasses.replace(weights, tensors=None, job_id=job_id, pointer=pointer)

    def drop(self, job_id: str) -> None:
        """Forget the namespace's publishers (its run is gone from here)."""
        for key in [key for key in self._publishers if key[0] == job_id]:
            del self._publishers[key]


class FleetSampling:
    """The tinker service's sampler versions in the weight store, and its sample requests to the actors."""

    keep: int
    timeout_s: float
    _store: WeightChannel
    _requester: SampleRequester
    loop: asyncio.AbstractEventLoop
    """The service's event loop, where requests wait for their results."""
    versions: SamplerVersions

    def __init__(self, store: WeightChannel, requester: SampleRequester, loop: asyncio.AbstractEventLoop, *,
                 keep: int, timeout_s: float) -> None:
        self.keep, self.timeout_s = keep, timeout_s
        self._store, self._requester, self.loop = store, requester, loop
        self.versions = SamplerVersions(store)

    def published(self, job_id: str, weights: SamplerWeights) -> SamplerWeights:
        """`publish`, from a thread other than the event loop's (the service's work thread), within a deadline."""
        future: Future[SamplerWeights] = asyncio.run_coroutine_threadsafe(self.publish(job_id, weights), self.loop)
        return future.result(timeout=bus.OUTAGE_RETRY_S + bus.REQUEST_TIMEOUT_S)

    async def publish(self, job_id: str, weights: SamplerWeights) -> SamplerWeights:
        return await self.versions.publish(job_id, weights, keep=self.keep)

    def forget(self, job_id: str) -> None:
        """A training run is gone (its session ended): delete its sampler versions from the weight store
        (`Transport.purge`, as `fleetrl delete` does a job's), in the background (a failure is logged; the
        namespace is then left)."""
        self.versions.drop(job_id)
        deleting = asyncio.run_coroutine_threadsafe(self._store.transport.purge(job_id), self.loop)

        def logged(done: Future[None]) -> None:
            if not done.cancelled() and done.exception() is not None:
                log.warning("deleting the sampler versions of %s failed: %s", job_id, done.exception())

        deleting.add_done_callback(logged)

    async def sample(self, weights: SamplerWeights, params: SampleParams) -> SampleResult:
        if params.seed is None:
            params = dataclasses.replace(params, seed=random.getrandbits(62))
        answer = await self._requester.request(weights.base_model, encode_request(weights, params), self.timeout_s)
        return decode_result(answer)


@dataclass
class _Adapter:
    """A namespace's adapter on the actor's shared base, its bytes, and the version copied into it (-1: none,
    B = 0)."""

    backend: SharedBaseBackend
    bytes: int
    version: int = -1


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _unbounded(held: int) -> bool:
    return True


class ActorSampling:
    """An actor's Tinker sampler: each namespace one adapter of the actor's shared base (the jobs' own,
    `fleetrl.policy.shared_base`), versions pulled from the weight store by pointer."""

    adapters_cached: int
    dtype: str
    device: str
    _store: WeightChannel
    _adapters: OrderedDict[str, _Adapter]
    """By namespace (a base-only sampler's: `base_key`), least recently used first."""
    _tensors: OrderedDict[tuple[str, int], dict[str, torch.Tensor]]
    batch: int
    """Sample requests taken at once (`tinker_sample_batch`) and decoded in one batch."""
    linger_s: float
    """How long a batch short of `batch` waits for more requests to join (`tinker_sample_linger_s`)."""
    _sampling: asyncio.Lock
    """One batch of Tinker samples at a time on this actor (its adapters change between them)."""
    _loading: asyncio.Lock
    """One batch member's adapter set up at a time."""
    account: Callable[[int], bool]
    """Told the bytes the samplers hold after every change (their adapters on the base, and the versions
    cached); answers whether the actor's memory budget still holds them (`MemoryBudget.samplers`). While it
    does not, the least recently used cached versions, then adapters, other than the sample's own are dropped."""

    def __init__(self, store: WeightChannel, adapters_cached: int, *, dtype: str, device: str,
                 account: Callable[[int], bool] = _unbounded, batch: int = 1, linger_s: float = 0.0) -> None:
        self.adapters_cached, self.dtype, self.device, self.batch = adapters_cached, dtype, device, batch
        self.linger_s = linger_s
        self._store = store
        self._adapters = OrderedDict()
        self._tensors = OrderedDict()
        self._sampling, self._loading = asyncio.Lock(), asyncio.Lock()
        self.account = account

    def held_bytes(self) -> int:
        return sum(a.bytes for a in self._adapters.values()) + sum(map(_nbytes, self._tensors.values()))

    async def run(self, queue: SampleQueue, stop: asyncio.Event) -> None:
        """Serve the queue's base until stop, up to `batch` requests at a time; a failed fetch (NATS restarting)
        is tried again."""
        log.info("serving tinker samples of %s", queue.model)
        while not stop.is_set():
            try:
                msgs = await queue.fetch(self.batch, FETCH_S)
            except Exception as error:  # NATS restarting: fetch again after a pause
                log.warning("fetching tinker samples of %s failed: %s", queue.model, error)
                await asyncio.sleep(FETCH_S)
                continue
            if msgs and len(msgs) < self.batch and self.linger_s > 0:  # its siblings may be a moment behind
                await asyncio.sleep(self.linger_s)
                with contextlib.suppress(Exception):  # NATS restarting: serve what was taken
                    msgs += await queue.fetch(self.batch - len(msgs), LINGER_FETCH_S)
            for wave, in_use in self._waves(msgs):
                async with self._sampling:
                    if len(wave) == 1:
                        await queue.handle(wave[0], self.serve)
                    else:
                        log.info("%d tinker samples of %s decoded in one batch", len(wave), queue.model)
                        together = RoundBatch("tinker", len(wave))
                        await asyncio.gather(*(self._handle_in(queue, together, in_use, msg) for msg in wave))

    def _waves(self, msgs: list[Msg]) -> list[tuple[list[Msg], set[str]]]:
        """The deliveries in batches that can be decoded together, in order, each with its namespaces: each
        namespace at one version (its adapter holds one at a time), at most `adapters_cached` namespaces; a
        request that cannot share a batch (stop tokens of its own, or one that does not parse) alone, with none."""
        waves: list[tuple[list[Msg], dict[str, int]]] = []  # the version of each namespace of a wave; {}: alone
        for msg in msgs:
            try:
                weights, params = decode_request(msg.data)
            except Exception:  # answered with its error by `serve`, alone
                waves.append(([msg], {}))
                continue
            if not batchable(params):
                waves.append(([msg], {}))
                continue
            key, version = self._key(weights), weights.pointer.version if weights.pointer else -1
            joins = next(((wave, held) for wave, held in waves if held and held.get(key, version) == version
                          and (key in held or len(held) < self.adapters_cached)), None)
            if joins is None:
                waves.append(([msg], {key: version}))
            else:
                joins[0].append(msg)
                joins[1][key] = version
        return [(wave, set(held)) for wave, held in waves]

    async def serve(self, payload: bytes) -> bytes:
        """A request's result, or its error as a result; RETRIED errors are raised (redelivery)."""
        return await self._answered(self._sampled(payload))

    async def _handle_in(self, queue: SampleQueue, together: RoundBatch, in_use: set[str], msg: Msg) -> None:
        """One delivery of the batch `together` (whose namespaces are `in_use`): served in it, or, when the queue
        serves it not (past its deadline), absent from it, so the others do not wait for it."""
        served = False

        async def serve(payload: bytes) -> bytes:
            nonlocal served
            served = True
            return await self._answered(self._sampled_in(together, in_use, payload))

        try:
            await queue.handle(msg, serve)
        finally:
            if not served:
                together.absent()

    async def _answered(self, sampled: Coroutine[Any, Any, SampleResult]) -> bytes:
        try:
            return encode_result(await sampled)
        except RETRIED:
            raise
        except Exception as error:  # answered at once: a second delivery would fail the same way
            log.warning("tinker sample failed: %s: %s", type(error).__name__, error)
            return json.dumps({"error": f"{type(error).__name__}: {error}",
                               "user": isinstance(error, USER_ERRORS)}).encode()

    async def _sampled(self, payload: bytes) -> SampleResult:
        weights, params = decode_request(payload)
        tensors = await self._pulled(weights)
        backend = await self._backend(weights, tensors)
        await self._fit({self._key(weights)})
        return await asyncio.to_thread(sample_with, backend, params)

    async def _sampled_in(self, together: RoundBatch, in_use: set[str], payload: bytes) -> SampleResult:
        seat = None
        try:
            weights, params = decode_request(payload)
            tensors = await self._pulled(weights)
            async with self._loading:
                backend = await self._backend(weights, tensors)
                await self._fit(in_use | {self._key(weights)})
            seat = together.seat(backend, lambda: 0)
            completions, _ = await seat.generate(group_request(params))
            prompt_logprobs = (await asyncio.to_thread(backend.prompt_logprobs, params.prompt)
                               if params.prompt_logprobs else None)
            return SampleResult([sequence_of(c) for c in completions], prompt_logprobs)
        finally:
            if seat is None:
                together.absent()
            else:
                seat.leave()  # nothing once it asked

    async def close(self) -> None:
        while self._adapters:
            await asyncio.to_thread(self._adapters.popitem()[1].backend.close)
        self._tensors.clear()
        self.account(0)

    @staticmethod
    def _key(weights: SamplerWeights) -> str:
        return weights.job_id or base_key(weights.base_model)

    async def _fit(self, in_use: set[str]) -> None:
        """Drop what the budget cannot hold: cached versions first (pulled again when asked for), then adapters,
        least recently used first, never an adapter in use (the batch's). A batch whose own adapters are over the
        budget still runs (it is logged): the budget bounds what is kept between batches."""
        while not self.account(self.held_bytes()):
            if self._tensors:
                self._tensors.popitem(last=False)
                continue
            spare = next((key for key in self._adapters if key not in in_use), None)
            if spare is None:
                log.warning("tinker samplers %s alone hold %d MiB, over the actor's memory budget", sorted(in_use),
                            self.held_bytes() >> 20)
                return
            await asyncio.to_thread(self._adapters.pop(spare).backend.close)

    async def _backend(self, weights: SamplerWeights, tensors: dict[str, torch.Tensor] | None) -> SharedBaseBackend:
        """The namespace's adapter on the shared base with the version asked for copied in (a base-only
        sampler: a fresh adapter, B = 0, which adds nothing); the least recently used beyond
        `adapters_cached` are removed from the base."""
        key = self._key(weights)
        held = self._adapters.get(key)
        if held is None:
            backend = await asyncio.to_thread(SharedBaseBackend, weights.base_model, dtype=self.dtype,
                                              device=self.device, lora=weights.lora or LoraSpec(), job_id=key)
            held = self._adapters[key] = _Adapter(backend, backend.adapter_bytes())
            while len(self._adapters) > self.adapters_cached:
                await asyncio.to_thread(self._adapters.popitem(last=False)[1].backend.close)
        self._adapters.move_to_end(key)
        version = weights.pointer.version if weights.pointer is not None else -1
        if tensors is not None and held.version != version:
            await asyncio.to_thread(held.backend.load_adapter, tensors)
            held.version = version
        return held.backend

    async def _pulled(self, weights: SamplerWeights) -> dict[str, torch.Tensor] | None:
        """The version's adapter tensors: cached, or pulled by its pointer (adapters only, digest checked)."""
        pointer = weights.pointer
        if pointer is None:
            return None
        if pointer.kind != "adapter" or pointer.base != weights.base_model:
            raise InvalidArgument(f"{weights.job_id} v{pointer.version} is not an adapter of {weights.base_model}",
                                  [FieldViolation("pointer", "adapters only")])
        key = (weights.job_id, pointer.version)
        tensors = self._tensors.get(key)
        if tensors is None:
            try:
                payload = await self._store.pull(weights.job_id, pointer)
            except NotFound as error:
                raise NotFound(f"sampler version {pointer.version} of {weights.job_id} is no longer in the weight "
                               f"store (the service keeps its newest few: sampler_versions_kept): {error}") from error
            tensors = await asyncio.to_thread(decode_safetensors, payload)
            self._tensors[key] = tensors
            while len(self._tensors) > self.adapters_cached:
                self._tensors.popitem(last=False)
        self._tensors.move_to_end(key)
        return tensors


def base_key(model: str) -> str:
    """The adapter name of a base-only sampler of `model` on an actor's shared base."""
    return f"tk-base-{bus.base_token(model)}"


def encode_request(weights: SamplerWeights, params: SampleParams) -> bytes:
    return json.dumps({
        "base_model": weights.base_model, "lora": weights.lora.model_dump(mode="json") if weights.lora else None,
        "job_id": weights.job_id, "pointer": weights.pointer.to_json().decode() if weights.pointer else None,
        "params": {**dataclasses.asdict(params), "stop_tokens": None if params.stop_tokens is None
                   else sorted(params.stop_tokens)},
    }).encode()


def decode_request(payload: bytes) -> tuple[SamplerWeights, SampleParams]:
    body: dict[str, Any] = json.loads(payload)
    pointer = WeightPointer.from_json(body["pointer"].encode()) if body["pointer"] else None
    lora = LoraSpec.model_validate(body["lora"]) if body["lora"] else None
    raw = body["params"]
    stop_tokens = None if raw["stop_tokens"] is None else frozenset(raw["stop_tokens"])
    params = SampleParams(**{**raw, "stop_tokens": stop_tokens})
    version = f"{body['job_id']}@v{pointer.version}" if pointer else f"base:{body['base_model']}"
    return SamplerWeights(version, body["base_model"], lora, None, body["job_id"], pointer), params


def encode_result(result: SampleResult) -> bytes:
    return json.dumps({"sequences": [dataclasses.asdict(s) for s in result.sequences],
                       "prompt_logprobs": result.prompt_logprobs}).encode()


def decode_result(payload: bytes) -> SampleResult:
    body: dict[str, Any] = json.loads(payload)
    if "error" in body:
        error_type = FailedPrecondition if body["user"] else Unavailable
        raise error_type(f"an actor could not sample: {body['error']}")
    return SampleResult([Sequence(**s) for s in body["sequences"]], body["prompt_logprobs"])
