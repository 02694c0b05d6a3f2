"""One job's policy on this actor: the backend and the weight version it holds, moved only forward.

A background watch of the job's weight pointer records the newest announced version; the task loop
applies it between rounds of tasks and each task of a round before its generate step (`refresh`, one
at a time), never while a generation runs (a round's batched generation starts once none of its tasks
is still refreshing: `fleetrl.rollout.batching`), so a generation always sees one version, the one
recorded in its group. Pulls go through the weight channel (`WeightSource`; the actor wires it over NATS)
and its sha256 check; a corrupt or vanished object is rejected, counted, and the pointer re-read and pulled
again, a bounded number of times. The held version never decreases. A pointer read that fails because NATS
is unreachable leaves the held version in place (the next refresh reads it again): it must not end
the actor's task loop, which calls `refresh` outside any task (a NATS restart crashed actors so).

For a job that publishes deltas (`train.full_publish_interval` > 1) the policy keeps the payload of
the version it loaded, in the published dtype, so the next pull reads only the deltas after it
(`WeightChannel.update`); each pull that fell back to the full snapshot is counted by its reason.
A LoRA job's versions (pointer kind "adapter") are adapter tensors, which the backend applies to the
base it loaded (`Backend.load_adapter`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

from fleetrl.errors import DeadlineExceeded, NotFound, Unavailable, WeightsCorrupt
from fleetrl.policy.backends import Backend
from fleetrl.rollout import metrics
from fleetrl.runtime import telemetry
from fleetrl.tasks import bus
from fleetrl.weights.channel import HeldWeights, Pulled, WeightPointer, decode_safetensors

log = logging.getLogger(__name__)
RETRY_DELAY_S = 0.5
WATCH_RESTART_S = 1.0
_TRACER = telemetry.tracer("fleetrl.actor")


class WeightSource(Protocol):
    """The reading side of a job's weights (`fleetrl.weights.channel.WeightChannel`, over any transport)."""

    async def latest(self, job_id: str) -> WeightPointer | None: ...

    async def update(self, job_id: str, pointer: WeightPointer, held: HeldWeights | None) -> Pulled: ...

    def watch(self, job_id: str) -> AsyncIterator[WeightPointer]: ...


class JobPolicy:
    """The backend of one job plus the version loaded into it (-1: none yet)."""

    job_id: str
    backend: Backend
    version: int
    announced: int
    pull_attempts: int
    keep_payload: bool
    _held: HeldWeights | None

    def __init__(self, job_id: str, backend: Backend, source: WeightSource, *, pull_attempts: int = 5,
                 keep_payload: bool = False) -> None:
        """`keep_payload`: hold the loaded version's payload, the base of the job's deltas."""
        self.job_id = job_id
        self.keep_payload = keep_payload
        self._held = None
        self.backend = backend
        self.version = -1
        self.announced = -1
        self.pull_attempts = pull_attempts
        self._source = source
        self._changed = asyncio.Event()
        self._loading = asyncio.Lock()
        """Held by the refresh that pulls and loads: the tasks of a round refresh concurrently."""
        self._watch: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Begin watching the pointer in the background."""
        self._watch = asyncio.create_task(self._watch_pointer(), name=f"weights-watch-{self.job_id}")

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch

    async def refresh(self) -> bool:
        """Load the newest published weights if they are newer than ours; whether a version is held."""
        if self.announced > self.version or self.version < 0:
            async with self._loading:  # a refresh that waited here finds the version loaded, or loads a newer one
                await self._load_latest()
        return self.version >= 0

    async def ensure(self, min_version: int, wait_s: float) -> bool:
        """Hold weights of at least min_version, waiting up to wait_s for them to be published."""
        deadline = time.monotonic() + wait_s
        while True:
            await self.refresh()
            if self.version >= min_version:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))

    async def _load_latest(self) -> None:
        """Pull and load the pointer's object; re-read the pointer after a corrupt or missing object
        or a lost connection (the chunk reader does not reconnect: the next attempt connects anew)."""
        for attempt in range(1, self.pull_attempts + 1):
            try:
                pointer = await self._source.latest(self.job_id)
            except bus.NATS_UNREACHABLE as error:  # NATS restarting: keep what we hold, read it next time
                log.warning("job %s: reading the weights pointer failed: %r", self.job_id, error)
                return
            if pointer is None or pointer.version <= self.version:
                return
            try:
                await self._apply(pointer)
                return
            except WeightsCorrupt as error:
                metrics.WEIGHTS_CORRUPT.labels(self.job_id).inc()
                log.warning("job %s: rejected weights v%d (attempt %d): %s", self.job_id, pointer.version,
                            attempt, error)
            except (NotFound, DeadlineExceeded, Unavailable) as error:  # Unavailable: NATS restarting
                log.warning("job %s: pull of v%d failed (attempt %d): %s", self.job_id, pointer.version,
                            attempt, error)
            await asyncio.sleep(RETRY_DELAY_S * attempt)

    async def _apply(self, pointer: WeightPointer) -> None:
        with _TRACER.start_as_current_span("actor.weights_pull", attributes={
                "fleetrl.job_id": self.job_id, "fleetrl.policy_version": pointer.version}):
            started = time.monotonic()
            held, self._held = self._held, None  # an update that raises leaves it half-applied
            pulled = await self._source.update(self.job_id, pointer, held)
            metrics.WEIGHT_PULL_SECONDS.labels(self.job_id).observe(time.monotonic() - started)
            metrics.WEIGHT_PULL_BYTES.labels(self.job_id).inc(pulled.pulled_bytes)
            if pulled.fallback is not None:
                metrics.WEIGHTS_FULL_FALLBACKS.labels(self.job_id, pulled.fallback).inc()
            await self._load(pointer, pulled.payload)
            if self.keep_payload:
                self._held = HeldWeights(pointer, pulled.payload)

    async def _load(self, pointer: WeightPointer, payload: memoryview) -> None:
        tensors = await asyncio.to_thread(decode_safetensors, payload)
        load = self.backend.load_adapter if pointer.kind == "adapter" else self.backend.load_weights
        await asyncio.to_thread(load, tensors)
        self.version = pointer.version
        self.announced = max(self.announced, pointer.version)
        metrics.WEIGHT_LOADS.labels(self.job_id).inc()
        metrics.POLICY_VERSION.labels(self.job_id).set(pointer.version)
        log.info("job %s: loaded weights v%d (%d bytes, %s, %s)", self.job_id, pointer.version, pointer.size_bytes,
                 pointer.dtype, pointer.kind)

    async def _watch_pointer(self) -> None:
        """Record announced versions; a broken watch (NATS reconnect) is restarted."""
        while True:
            try:
                async for pointer in self._source.watch(self.job_id):
                    if pointer.version > self.announced:
                        self.announced = pointer.version
                        self._changed.set()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the watch is an accelerator; ensure() also polls latest()
                log.warning("job %s: weights watch failed, restarting: %s", self.job_id, error)
            await asyncio.sleep(WATCH_RESTART_S)
