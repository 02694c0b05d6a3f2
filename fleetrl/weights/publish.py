"""Weight publishing: the policy's tensors as safetensors in the job's object store.

Design choice: policy version == optimizer steps applied, so the weights after step s are
version s. The weight store only moves its pointer forward; a learner that resumed from a
checkpoint at step c while the store already holds versions above c (published by the
incarnation that died) does not publish those versions again: fixed seeds make the resumed
run reproduce them, and actors keep the ones they hold. Publishing resumes above the pointer.
Every publish carries the job-lease epoch, and `sync` stamps the pointer with it first, so a learner
of an older epoch (stopped past its lease) can no longer move the pointer (`Fenced`).

With `full_interval` > 1 the publisher keeps the payload it published last, the base of its next
delta; after a restart it holds none, so its first version is a full snapshot. While it waits for
data it rewrites its newest version as a full snapshot when an actor reported that version's chain
broken (`repair_if_requested`, fenced like a publish), so a job whose actors cannot apply a delta
does not wait for the next publish, which would need their groups.

A publish that fails in a NATS outage (a chunk's or the pointer's reply lost with a killed server, or no
answer at all across a partition) is tried again through `bus.retry_outage` for `outage_retry_s`, then raises
`bus.NatsUnreachable` (the learner pauses the job and calls `publish` again: `fleetrl.train.full_stores`); so
is `sync`'s fence. The store purges a failed write's chunks (at once, or, when NATS did not answer, by the
sweep that starts every write, which also purges what a killed learner's write left: safe because `sync`
fenced the pointer first) and deletes a half-written object of the version before writing it again, and a
try whose pointer move landed though its reply was lost counts as done, in this call or a later one.

A LoRA job (`adapter_of`, the base model's name) publishes its adapter tensors only
(`fleetrl.weights.adapters.adapter_tensors`), each version whole: actors load the base once and apply each
version's adapters to it.
"""

from __future__ import annotations

import hashlib
import logging

import torch
from peft import PeftModel

from fleetrl.policy import models
from fleetrl.tasks import bus
from fleetrl.weights.adapters import adapter_tensors
from fleetrl.weights.channel import HeldWeights, WeightChannel, WeightPointer, encode_safetensors

log = logging.getLogger(__name__)


class WeightPublisher:
    """Publishes one job's weights every `interval` steps, never below the store's pointer."""

    job_id: str
    dtype: str
    interval: int
    keep: int
    full_interval: int
    published_version: int
    """Newest version in the store (by us or a previous incarnation); -1 before any."""
    lease_epoch: int
    adapter_of: str
    """The base model of a LoRA job, whose versions are adapters; "" for full weights."""
    outage_retry_s: float
    """How long one `publish` tries again through a NATS outage before it raises NatsUnreachable."""
    _unsure: int
    """The version whose last try did not return (-1: none): its pointer move may have landed unseen."""
    _store: WeightChannel
    _base: HeldWeights | None
    """The newest version this publisher wrote, kept when deltas are on."""

    def __init__(self, store: WeightChannel, job_id: str, dtype: str, interval: int, keep: int,
                 lease_epoch: int, full_interval: int = 1, adapter_of: str = "",
                 outage_retry_s: float = bus.OUTAGE_RETRY_S) -> None:
        self._store = store
        self.outage_retry_s = outage_retry_s
        self._unsure = -1
        self.adapter_of = adapter_of
        self.lease_epoch = lease_epoch
        self.full_interval = full_interval
        self._base = None
        self.job_id = job_id
        self.dtype = dtype
        self.interval = interval
        self.keep = keep
        self.published_version = -1

    async def sync(self) -> int:
        """Fence the pointer with our epoch and read its version (after a resume); returns it (-1: none).
        Tried again through a NATS outage as a publish is (a fence whose reply was lost finds the pointer
        stamped already), then NatsUnreachable."""
        latest = await bus.retry_outage(lambda: self._store.fence(self.job_id, self.lease_epoch),
                                        what=f"job {self.job_id}: fencing of the weights pointer",
                                        deadline_s=self.outage_retry_s)
        self.published_version = latest.version if latest else -1
        return self.published_version

    def due(self, step: int, final: bool) -> bool:
        return step % self.interval == 0 or final

    async def publish(self, model: torch.nn.Module, version: int) -> WeightPointer | None:
        """Publish `version` unless the store already has it or a newer one (a LoRA model's adapters)."""
        if version <= self.published_version:
            log.info("job %s: version %d already published (store at %d)", self.job_id, version,
                     self.published_version)
            return None
        if self.adapter_of:
            assert isinstance(model, PeftModel), "adapter_of is set for LoRA jobs only"
            tensors = adapter_tensors(model, self.dtype)
        else:
            tensors = models.state_dict_for_publish(model, self.dtype)
        return await self.publish_tensors(tensors, version)

    async def publish_tensors(self, tensors: dict[str, torch.Tensor], version: int) -> WeightPointer:
        """Publish `version` holding these tensors, already in `dtype` (a LoRA model's adapters when
        `adapter_of` is set: what the Tinker API's sampler versions are); the rules of `publish`."""
        payload = encode_safetensors(tensors)

        async def attempt() -> WeightPointer:
            if self._unsure == version and (landed := await self._landed(version, payload)):
                return landed
            self._unsure = version
            return await self._store.publish(
                self.job_id, version, payload, self.dtype, keep=self.keep, base=self._base,
                full_interval=self.full_interval, lease_epoch=self.lease_epoch, adapter_of=self.adapter_of)

        pointer = await bus.retry_outage(attempt, what=f"job {self.job_id}: publish of weights v{version}",
                                         deadline_s=self.outage_retry_s)
        self.published_version, self._unsure = version, -1
        self._base = HeldWeights(pointer, memoryview(payload)) if self.full_interval > 1 else None
        return pointer

    async def _landed(self, version: int, payload: bytes) -> WeightPointer | None:
        """The pointer, if a try that failed (its reply lost in a NATS outage) had moved it to this payload."""
        pointer = await self._store.latest(self.job_id)
        if pointer is None or pointer.version != version or pointer.epoch != self.lease_epoch:
            return None
        return pointer if pointer.sha256 == hashlib.sha256(payload).hexdigest() else None

    async def repair_if_requested(self) -> None:
        """Rewrite the newest version as a full snapshot if an actor reported its chain broken; tried again
        through a NATS outage as a publish is (a try whose pointer move landed unseen leaves nothing to
        repair, and the next publish is a full snapshot), then NatsUnreachable."""
        if self._base is not None and self._base.pointer.chain:
            base = self._base
            repaired = await bus.retry_outage(lambda: self._store.repair(self.job_id, base, self.lease_epoch),
                                              what=f"job {self.job_id}: repair of the chain of v{base.pointer.version}",
                                              deadline_s=self.outage_retry_s)
            if repaired is not None:
                self._base = HeldWeights(repaired, self._base.payload)
