"""Weight publishing: the policy's tensors as safetensors in the job's object store.

Design choice: policy version == optimizer steps applied, so the weights after step s are
version s. The weight store only moves its pointer forward; a learner that resumed from a
checkpoint at step c while the store already holds versions above c (published by the
incarnation that died) does not publish those versions again: fixed seeds make the resumed
run reproduce them, and actors keep the ones they hold. Publishing resumes above the pointer.
Every publish carries the job-lease epoch, and `sync` stamps the pointer with it first, so a learner
of an older epoch (stopped past its lease) can no longer move the pointer (`Fenced`).
"""

from __future__ import annotations

import logging

import torch

from services.common import models
from services.common.weights import WeightPointer, WeightStore, encode_safetensors

log = logging.getLogger(__name__)


class WeightPublisher:
    """Publishes one job's weights every `interval` steps, never below the store's pointer."""

    job_id: str
    dtype: str
    interval: int
    keep: int
    published_version: int
    """Newest version in the store (by us or a previous incarnation); -1 before any."""
    lease_epoch: int
    _store: WeightStore

    def __init__(self, store: WeightStore, job_id: str, dtype: str, interval: int, keep: int,
                 lease_epoch: int) -> None:
        self._store = store
        self.lease_epoch = lease_epoch
        self.job_id = job_id
        self.dtype = dtype
        self.interval = interval
        self.keep = keep
        self.published_version = -1

    async def sync(self) -> int:
        """Fence the pointer with our epoch and read its version (after a resume); returns it (-1: none)."""
        latest = await self._store.fence(self.job_id, self.lease_epoch)
        self.published_version = latest.version if latest else -1
        return self.published_version

    def due(self, step: int, final: bool) -> bool:
        return step % self.interval == 0 or final

    async def publish(self, model: torch.nn.Module, version: int) -> WeightPointer | None:
        """Publish `version` unless the store already has it or a newer one."""
        if version <= self.published_version:
            log.info("job %s: version %d already published (store at %d)", self.job_id, version,
                     self.published_version)
            return None
        payload = encode_safetensors(models.state_dict_for_publish(model, self.dtype))
        pointer = await self._store.publish(self.job_id, version, payload, self.dtype, keep=self.keep,
                                            lease_epoch=self.lease_epoch)
        self.published_version = version
        return pointer
