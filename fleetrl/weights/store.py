"""Weight store: the learner publishes policy weights, actors pull them, over NATS JetStream.

Layout (docs/ARCHITECTURE.md, data flow step 9): one object store bucket per job (`bus.weights_bucket`),
objects `v<version>` holding safetensors bytes (full snapshots) and `d<version>` holding deltas
(`fleetrl.weights.delta`: the changed words and their positions, zstd-compressed); a pointer in KV bucket
`bus.WEIGHTS_KV`,
key `<job>`, JSON {version, object, sha256, bytes, dtype, kind[, chain][, base]}, moved only forward by
compare-and-swap. A LoRA job's objects `v<version>` hold its adapter tensors only (kind "adapter",
`base` the model they apply to; `fleetrl.weights.adapters`): each is whole, never a delta. Key `<job>.resync`
is where a reader reports a chain it cannot apply.

Design choices:
- Objects are written in nats-py's object store layout (chunks on `$O.<bucket>.C.<nuid>`, one
  ObjectInfo JSON on `$O.<bucket>.M.<base64url(name)>`), so stock `ObjectStore.get` still reads
  them, but by a pipelined writer (a window of async JetStream publishes of large chunks) instead
  of `put()`'s one publish round trip per 128 KiB.
- Pulls read the chunk subject through an ephemeral push consumer whose messages a ChunkReader
  receives on a connection of its own, the kernel writing each payload straight into its place in
  one buffer of anonymous memory mapped up front (nats-py's client copies every payload about five
  times). A worker thread hashes the filled prefix meanwhile, and the verified buffer itself is
  returned (a memoryview), not a bytes copy of it. `ObjectStore.get` concatenates with `bytes +=`,
  quadratic in the chunk count (`python -m bench.weights` compares the two; figures measured on
  the development machine are in docs/ARCHITECTURE.md, "Figures measured on one machine").
- A publish whose version is not above the pointer's raises FailedPrecondition before anything
  is written: the object `v<version>` may be the one actors are pulling, so it is never
  overwritten. A learner that resumes asks `latest()` and publishes above it.
- Chains: a delta version's pointer lists its chain, the full snapshot it builds on and every
  version after it, so a reader holding any of them applies the deltas after it in order and one
  holding none (new, or behind the snapshot) pulls the snapshot first. The pointer's sha256 is
  always that of the full payload, and a reader hashes what it rebuilt, so a delta can never
  silently corrupt weights: a mismatch, a damaged or a missing delta sends the reader to the full
  snapshot; if the snapshot's own chain fails, the reader reports it (`request_full`) and the
  publisher's next publish, or `repair` of the current version, is a full snapshot. The publisher
  starts a new chain every `full_interval` versions and after each restart (it holds no base then).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import json
import logging
import mmap
import re
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

import nats.aio.client
import torch
from nats.js import JetStreamContext, api
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import MSG_ROLLUP_SUBJECT, KeyValue
from nats.js.object_store import ObjectStore
from safetensors.torch import save as st_save

from fleetrl.errors import DeadlineExceeded, FailedPrecondition, Fenced, NotFound, WeightsCorrupt
from fleetrl.tasks import bus
from fleetrl.weights import delta as weight_delta
from fleetrl.weights.chunk_reader import chunk_reader

log = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
"""Default chunk size (measured best in bench.weights); NATS' default max_payload is also 1 MiB."""
PUBLISH_WINDOW = 16
"""Chunk publishes awaiting their JetStream ack at once."""
MIN_PULL_TIMEOUT_S = 30.0
MIN_PULL_MB_S = 20.0
"""Default pull deadline: MIN_PULL_TIMEOUT_S plus the payload at MIN_PULL_MB_S."""
STALL_CHECK_S = 5.0
"""A pull that receives no chunk for this long checks that its object was not deleted."""
_OBJECT_RE = re.compile(r"^([vd])(\d+)$")
"""Weight objects: `v<n>` full snapshots, `d<n>` deltas."""
_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
}
"""safetensors dtype names fleetrl may publish."""


@dataclass(frozen=True)
class WeightPointer:
    """The KV value naming one published weight version.

    On the wire it is JSON {version, object, sha256, bytes, dtype, kind, epoch} (the design's pointer
    format plus `kind` and the fencing token), `chain` for a delta and `base` for an adapter: `object_name` travels as
    "object" and `size_bytes` as "bytes"; a pointer without "epoch" reads as epoch 0. `sha256` and
    `size_bytes` are always those of the version's full payload, the weights a reader ends up with,
    whichever object carries them."""

    version: int
    object_name: str
    """Name of the object in the job's weight bucket: `v<version>` (full) or `d<version>` (delta)."""
    sha256: str
    size_bytes: int
    """Size of the full safetensors payload."""
    dtype: str
    chain: tuple[int, ...] = ()
    """For a delta: the versions from the full snapshot it builds on (first) up to this one (last);
    each object `d<n>` turns the version before it in the chain into n. () for a full snapshot."""
    epoch: int = 0
    """Job-lease epoch of the learner that moved the pointer here: a lower epoch may not move it."""
    base: str = ""
    """For an adapter (a LoRA job): the base model the adapter applies to (the job's `model`); the
    payload then holds adapter tensors only. "" for full weights."""

    @property
    def kind(self) -> str:
        """"adapter" (LoRA tensors on `base`), "delta" (a chain's step) or "full" (every weight)."""
        if self.base:
            return "adapter"
        return "delta" if self.chain else "full"

    @property
    def full_version(self) -> int:
        """The version of the full snapshot this version is reconstructed from (itself when full)."""
        return self.chain[0] if self.chain else self.version

    def to_json(self) -> bytes:
        fields: dict[str, object] = {"version": self.version, "object": self.object_name, "sha256": self.sha256,
                                     "bytes": self.size_bytes, "dtype": self.dtype, "kind": self.kind,
                                     "epoch": self.epoch}
        if self.chain:
            fields["chain"] = list(self.chain)
        if self.base:
            fields["base"] = self.base
        return json.dumps(fields, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> WeightPointer:
        fields = json.loads(raw)
        return cls(
            version=int(fields["version"]), object_name=str(fields["object"]), sha256=str(fields["sha256"]),
            size_bytes=int(fields["bytes"]), dtype=str(fields["dtype"]),
            chain=tuple(int(v) for v in fields.get("chain", ())), epoch=int(fields.get("epoch", 0)),
            base=str(fields.get("base", "")),
        )


@dataclass(frozen=True)
class HeldWeights:
    """One version's full payload as a publisher or reader holds it: the base of the next delta."""

    pointer: WeightPointer
    payload: memoryview
    """The payload whose sha256 is pointer.sha256; a reader's is writable (deltas apply in place)."""


@dataclass(frozen=True)
class Pulled:
    """The result of `WeightStore.update`."""

    payload: memoryview
    """The full payload of the pointer's version, its sha256 checked against the pointer's."""
    pulled_bytes: int
    """Bytes of objects read (snapshot and deltas)."""
    fallback: str | None
    """Why a reader holding an older version pulled the full snapshot instead of deltas only:
    "behind" (it held no version of the pointer's chain), "delta_missing", "delta_corrupt"; None
    when it did not (or held nothing)."""


def encode_safetensors(tensors: dict[str, torch.Tensor]) -> bytes:
    """safetensors bytes of a state dict (tensors must be contiguous and unshared)."""
    return st_save(tensors)


def decode_safetensors(payload: memoryview) -> dict[str, torch.Tensor]:
    """The tensors of a pulled payload, each copied out once into its own storage, as safetensors'
    `load` would (which takes only bytes, and so would need one more copy of the whole payload).

    The format: an 8-byte little-endian header size, a JSON header {name: {dtype, shape,
    data_offsets}} (and an optional __metadata__), then the data, aligned for each dtype."""
    header_size = int.from_bytes(payload[:8], "little")
    header = json.loads(bytes(payload[8 : 8 + header_size]))
    data = torch.frombuffer(payload, dtype=torch.uint8)[8 + header_size :]
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name != "__metadata__":
            start, end = entry["data_offsets"]
            tensors[name] = data[start:end].view(_DTYPES[entry["dtype"]]).reshape(entry["shape"]).clone()
    return tensors


def _meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def _object_digest(sha256_hex: str) -> str:
    """ObjectInfo's digest field: `SHA-256=` + base64url of the raw digest."""
    return "SHA-256=" + base64.urlsafe_b64encode(bytes.fromhex(sha256_hex)).decode()


class WeightStore:
    """Publish, find, pull and watch a job's weights. One instance per NATS connection."""

    _nc: nats.aio.client.Client
    _js: JetStreamContext
    _kv: KeyValue | None
    _stores: dict[str, ObjectStore]
    _chunk_bytes: int
    _half_written: dict[str, set[str]]
    """Per job, the chunk subjects of failed writes not purged yet (NATS did not answer then)."""

    def __init__(self, nc: nats.aio.client.Client, js: JetStreamContext, *, chunk_bytes: int = CHUNK_BYTES) -> None:
        """`chunk_bytes` is capped below the server's max_payload at publish time."""
        self._nc = nc
        self._js = js
        self._chunk_bytes = chunk_bytes
        self._kv = None
        self._stores = {}
        self._half_written = {}

    async def publish(self, job_id: str, version: int, payload: bytes, dtype: str, *, keep: int = 3,
                      base: HeldWeights | None = None, full_interval: int = 1, lease_epoch: int = 0,
                      adapter_of: str = "") -> WeightPointer:
        """Write `version` as a full snapshot `v<version>` or as a delta `d<version>` against `base`,
        move the pointer to it, prune (`_prune`). With `adapter_of` (a base model) the payload is a
        LoRA job's adapter tensors, written whole as `v<version>` with a pointer of kind "adapter".

        A delta is written when `base` is the version the pointer names, the pointer's chain holds
        fewer than `full_interval` versions, and no reader has reported that chain broken
        (`request_full`); otherwise a full snapshot. Raises FailedPrecondition if the pointer is
        already at `version` or above, or moves meanwhile, and Fenced (before writing anything) if it
        was moved under a newer job-lease epoch than lease_epoch.
        """
        kv = await self._pointer_kv()
        current, revision = await self._pointer_entry(kv, job_id)
        _check_epoch(job_id, current, lease_epoch)
        _check_forward(current, version)
        chain = () if adapter_of else await self._next_chain(kv, job_id, current, base, version, full_interval,
                                                             len(payload))
        await self._delete_unreferenced(job_id, f"v{version}", f"d{version}")
        if chain:
            assert base is not None
            sha256_hex = await asyncio.to_thread(_sha256, payload)
            delta = await asyncio.to_thread(weight_delta.encode, base.payload, payload, base.pointer.sha256,
                                            sha256_hex)
            name = f"d{version}"
            await self._write_object(job_id, name, delta)
        else:
            name = f"v{version}"
            sha256_hex = await self._write_object(job_id, name, payload)
        pointer = WeightPointer(version=version, object_name=name, sha256=sha256_hex, size_bytes=len(payload),
                                dtype=dtype, chain=chain, epoch=lease_epoch, base=adapter_of)
        await self._move_pointer(kv, job_id, pointer, revision)
        await self._prune(job_id, keep, pointer)
        return pointer

    async def fence(self, job_id: str, lease_epoch: int) -> WeightPointer | None:
        """Stamp the current pointer (same version and object) with lease_epoch, so no learner of an
        older epoch can move it any more; Fenced if a newer epoch stamped it. Returns the pointer."""
        kv = await self._pointer_kv()
        current, revision = await self._pointer_entry(kv, job_id)
        _check_epoch(job_id, current, lease_epoch)
        if current is None or current.epoch == lease_epoch:
            return current
        stamped = dataclasses.replace(current, epoch=lease_epoch)
        await self._move_pointer(kv, job_id, stamped, revision)
        return stamped

    async def latest(self, job_id: str) -> WeightPointer | None:
        """The job's current pointer, or None before its first publish."""
        pointer, _ = await self._pointer_entry(await self._pointer_kv(), job_id)
        return pointer

    async def pull(self, job_id: str, pointer: WeightPointer, *, timeout_s: float | None = None) -> memoryview:
        """The full payload of the pointer's version (memory the caller owns), verified against the
        pointer (WeightsCorrupt), within a deadline: `update` with nothing held."""
        return (await self.update(job_id, pointer, None, timeout_s=timeout_s)).payload

    async def update(self, job_id: str, pointer: WeightPointer, held: HeldWeights | None, *,
                     timeout_s: float | None = None) -> Pulled:
        """The pointer's version, reached from `held` by deltas when `held` is a version of the
        pointer's chain, else from the chain's full snapshot (then `Pulled.fallback` says why).

        `held.payload` is updated in place: after the call it belongs to the result, or, when the call
        raises, to nobody. A delta missing or failing its checks while applied to `held` makes the
        update start again from the full snapshot. When the full snapshot's own chain is broken the
        reader asks the publisher for a full snapshot (`request_full`) and raises WeightsCorrupt or
        NotFound, as it does for a missing or damaged full object. DeadlineExceeded past `timeout_s`
        (default MIN_PULL_TIMEOUT_S plus the payload, twice for a delta, at MIN_PULL_MB_S).
        """
        if timeout_s is None:
            timeout_s = MIN_PULL_TIMEOUT_S + pointer.size_bytes * (2 if pointer.chain else 1) / (MIN_PULL_MB_S * 1e6)
        try:
            return await asyncio.wait_for(self._update(job_id, pointer, held), timeout_s)
        except TimeoutError as error:
            raise DeadlineExceeded(f"pull of {job_id}/{pointer.object_name} took over {timeout_s:.0f}s") from error

    async def request_full(self, job_id: str, full_version: int) -> None:
        """Report that the chain built on snapshot `full_version` cannot be applied: the publisher's
        next `publish` (or `repair`) writes a full snapshot."""
        await (await self._pointer_kv()).put(_resync_key(job_id), str(full_version).encode())

    async def repair(self, job_id: str, held: HeldWeights, lease_epoch: int = 0) -> WeightPointer | None:
        """When a reader reported the current chain broken and `held` is the pointer's version, write
        that version again as a full snapshot and point at it (same version, same sha256: readers
        holding it lose nothing); the new pointer, or None when there is nothing to repair. Fenced
        (before writing anything) when a newer job-lease epoch moved the pointer."""
        kv = await self._pointer_kv()
        current, revision = await self._pointer_entry(kv, job_id)
        _check_epoch(job_id, current, lease_epoch)
        if current is None or not current.chain or current != held.pointer:
            return None
        if await self._full_wanted(kv, job_id) != current.full_version:
            return None
        name = f"v{current.version}"
        await self._delete_unreferenced(job_id, name)
        if await self._write_object(job_id, name, held.payload) != current.sha256:
            raise WeightsCorrupt(f"{job_id}: held payload of v{current.version} differs from its pointer")
        pointer = dataclasses.replace(current, object_name=name, chain=())
        await self._move_pointer(kv, job_id, pointer, revision)
        log.warning("job %s: chain from v%d reported broken; v%d rewritten as a full snapshot", job_id,
                    current.full_version, current.version)
        return pointer

    async def watch(self, job_id: str) -> AsyncIterator[WeightPointer]:
        """Pointers with strictly increasing versions as the key moves, the current one first."""
        watcher = await (await self._pointer_kv()).watch(bus.check_job_id(job_id))
        newest = -1
        try:
            async for entry in watcher:
                if entry is None or entry.value is None or entry.operation is not None:
                    continue  # end-of-history marker, or a delete/purge
                pointer = WeightPointer.from_json(entry.value)
                if pointer.version > newest:
                    newest = pointer.version
                    yield pointer
        finally:
            await watcher.stop()

    # ---------------------------------------------------------------- pointer

    async def _pointer_kv(self) -> KeyValue:
        if self._kv is None:
            self._kv = await bus.ensure_weights_kv(self._js)
        return self._kv

    @staticmethod
    async def _pointer_entry(kv: KeyValue, job_id: str) -> tuple[WeightPointer | None, int]:
        """(pointer, revision); (None, 0) when absent, (None, revision) when deleted."""
        try:
            entry = await kv.get(bus.check_job_id(job_id))
        except KeyDeletedError as error:
            return None, int(error.entry.revision) if error.entry else 0
        except KeyNotFoundError:
            return None, 0
        assert entry.value is not None and entry.revision is not None
        return WeightPointer.from_json(entry.value), entry.revision

    @staticmethod
    async def _move_pointer(kv: KeyValue, job_id: str, pointer: WeightPointer, revision: int) -> None:
        """Compare-and-swap from `revision`; someone else moving it first is a FailedPrecondition."""
        try:
            if revision:
                await kv.update(job_id, pointer.to_json(), last=revision)
            else:
                await kv.create(job_id, pointer.to_json())
        except KeyWrongLastSequenceError as error:
            raise FailedPrecondition(
                f"weights pointer of {job_id} moved during publish of {pointer.object_name}") from error

    async def _next_chain(self, kv: KeyValue, job_id: str, current: WeightPointer | None, base: HeldWeights | None,
                          version: int, full_interval: int, size: int) -> tuple[int, ...]:
        """The chain of `version` if it may be a delta against `base`, else () (full snapshot)."""
        if base is None or current is None or base.pointer != current or size != current.size_bytes:
            return ()
        chain = current.chain or (current.version,)
        if len(chain) >= full_interval or await self._full_wanted(kv, job_id) == chain[0]:
            return ()
        return (*chain, version)

    @staticmethod
    async def _full_wanted(kv: KeyValue, job_id: str) -> int | None:
        """The snapshot version whose chain a reader reported broken, if any."""
        try:
            entry = await kv.get(_resync_key(job_id))
        except (KeyNotFoundError, KeyDeletedError):
            return None
        return int(entry.value) if entry.value else None

    # ---------------------------------------------------------------- chains

    async def _update(self, job_id: str, pointer: WeightPointer, held: HeldWeights | None) -> Pulled:
        if not pointer.chain:
            payload, _ = await self._read_object(job_id, pointer.object_name, pointer.size_bytes, pointer.sha256)
            return Pulled(payload, pointer.size_bytes, None)
        fallback, pulled_bytes = None, 0
        if held is not None and held.pointer.version in pointer.chain[:-1]:
            try:
                return await self._apply_chain(job_id, pointer, held.payload, held.pointer.sha256, held.pointer.version)
            except NotFound as error:
                fallback = "delta_missing"
                log.warning("job %s: %s; pulling the full snapshot v%d", job_id, error, pointer.full_version)
            except WeightsCorrupt as error:
                fallback = "delta_corrupt"
                log.warning("job %s: %s; pulling the full snapshot v%d", job_id, error, pointer.full_version)
        elif held is not None:
            fallback = "behind"
        snapshot, sha256_hex = await self._read_object(job_id, f"v{pointer.full_version}", None, None)
        try:
            pulled = await self._apply_chain(job_id, pointer, snapshot, sha256_hex, pointer.full_version)
        except (NotFound, WeightsCorrupt):
            await self.request_full(job_id, pointer.full_version)
            raise
        pulled_bytes += len(snapshot) + pulled.pulled_bytes
        return Pulled(pulled.payload, pulled_bytes, fallback)

    async def _apply_chain(self, job_id: str, pointer: WeightPointer, payload: memoryview, sha256_hex: str,
                           after: int) -> Pulled:
        """Apply the deltas of pointer.chain past version `after` to payload (whose digest is
        sha256_hex) in place; check the result's digest against the pointer's."""
        pulled_bytes = 0
        for version in pointer.chain[pointer.chain.index(after) + 1 :]:
            delta, _ = await self._read_object(job_id, f"d{version}", None, None)
            pulled_bytes += len(delta)
            header = await asyncio.to_thread(weight_delta.apply_inplace, payload, delta, sha256_hex)
            sha256_hex = header.sha256
        if await asyncio.to_thread(_sha256, payload) != pointer.sha256:
            raise WeightsCorrupt(f"{job_id}: weights rebuilt for v{pointer.version} differ from the pointer's sha256")
        return Pulled(payload, pulled_bytes, None)

    # ---------------------------------------------------------------- objects

    async def _store(self, job_id: str) -> ObjectStore:
        if job_id not in self._stores:
            self._stores[job_id] = await bus.ensure_object_store(self._js, job_id)
        return self._stores[job_id]

    async def _write_object(self, job_id: str, name: str, payload: bytes | memoryview) -> str:
        """Chunks with a window of async publishes, then the ObjectInfo; returns the sha256 hex. A write that
        fails has its chunks purged: at once, or, when it failed because NATS does not answer
        (`bus.NatsUnreachable`: the purge could not get through either), first thing in the job's next write
        (`_purge_half_written`). Either way no ObjectInfo names them, so no pointer can."""
        await self._store(job_id)
        await self._purge_half_written(job_id)
        bucket = bus.weights_bucket(job_id)
        nuid = self._nc._nuid.next().decode()
        chunk_subject = f"$O.{bucket}.C.{nuid}"
        digest = asyncio.create_task(asyncio.to_thread(lambda: hashlib.sha256(payload).hexdigest()))
        chunk = min(self._chunk_bytes, self._nc.max_payload - 4096)  # room for headers
        try:
            chunks = await self._publish_chunks(chunk_subject, payload, chunk)
            sha256_hex = await digest
            info = api.ObjectInfo(
                name=name, bucket=bucket, nuid=nuid, size=len(payload), chunks=chunks,
                digest=_object_digest(sha256_hex), mtime=datetime.now(UTC).isoformat(),
                options=api.ObjectMetaOptions(max_chunk_size=chunk),
            )
            await self._js.publish(
                _meta_subject(bucket, name), json.dumps(info.as_dict()).encode(),
                headers={api.Header.ROLLUP: MSG_ROLLUP_SUBJECT},
            )
        except BaseException as error:
            digest.cancel()
            self._half_written.setdefault(job_id, set()).add(chunk_subject)
            if not isinstance(error, bus.NatsUnreachable):
                await self._purge_half_written(job_id)
            raise
        return sha256_hex

    async def _purge_half_written(self, job_id: str) -> None:
        """Purge the chunks (and a probe among them) of the job's writes that failed, as each purge lands."""
        subjects = self._half_written.get(job_id, set())
        for subject in sorted(subjects):
            await self._js.purge_stream(f"OBJ_{bus.weights_bucket(job_id)}", subject=subject)
            subjects.discard(subject)

    async def _delete_unreferenced(self, job_id: str, *names: str) -> None:
        """Delete these objects, chunks and all, if they exist: objects of a version above the pointer
        (or a full copy of its delta) that a publisher which died before moving the pointer left."""
        for name in names:
            with contextlib.suppress(NotFoundError):
                await self._delete(job_id, name)

    async def _delete(self, job_id: str, name: str) -> None:
        """Purge an object's metadata, then its chunks (NotFoundError if it does not exist).

        Not nats-py's `ObjectStore.delete`, which leaves a `deleted` metadata message per object: with
        those markers, nats-server (2.15.1) kept about 9 MB more memory for good per deleted 6.4 MB object,
        so a learner publishing every step grew the server by gigabytes an hour (`bench.soak`); purged,
        the server stays flat. A purged name reads as missing, as a deleted one does."""
        info = await (await self._store(job_id)).get_info(name)
        bucket = bus.weights_bucket(job_id)
        await self._js.purge_stream(f"OBJ_{bucket}", subject=_meta_subject(bucket, name))
        await self._js.purge_stream(f"OBJ_{bucket}", subject=f"$O.{bucket}.C.{info.nuid}")

    async def _publish_chunks(self, subject: str, payload: bytes | memoryview, chunk: int) -> int:
        """Publish payload in `chunk`-sized pieces, at most PUBLISH_WINDOW unacked; the count. One deadline
        for the whole: `bus.REQUEST_TIMEOUT_S` plus the payload at MIN_PULL_MB_S. A publish into a socket that
        does not drain returns only after `bus.FLUSH_TIMEOUT_S`, and each ack had a deadline of its own, so a
        learner cut off from NATS spent the one on every other chunk and then the other on an ack before it
        gave up.

        Past the deadline the write asks why (`_timed_out`): NatsUnreachable when the server does not answer
        a ping, the refusal when JetStream is full, a TimeoutError otherwise."""
        window: deque[asyncio.Future[api.PubAck]] = deque()
        view = memoryview(payload)
        count = 0
        deadline_s = bus.REQUEST_TIMEOUT_S + len(payload) / (MIN_PULL_MB_S * 1e6)
        give_up_at = time.monotonic() + deadline_s
        try:
            for start in range(0, len(payload), chunk):
                if time.monotonic() > give_up_at:
                    raise TimeoutError(f"{subject}: {count} chunks sent in {deadline_s:.1f}s, not all")
                if len(window) >= PUBLISH_WINDOW:
                    await asyncio.wait_for(window.popleft(), max(0.0, give_up_at - time.monotonic()))
                window.append(await self._js.publish_async(subject, bytes(view[start : start + chunk])))
                count += 1
            while window:
                await asyncio.wait_for(window.popleft(), max(0.0, give_up_at - time.monotonic()))
        except TimeoutError as error:
            await self._timed_out(subject, chunk, error)
            raise
        finally:
            for future in window:  # a failed write's acks: each holds one of nats-py's in-flight slots till done
                future.cancel()
        return count

    async def _timed_out(self, subject: str, chunk: int, error: TimeoutError) -> None:
        """Why a write's chunks were not all acked in time. When the server does not answer a ping
        (`bus.answers`), NatsUnreachable: a probe or a purge could not get through either, and each would
        spend a request's deadline finding that out. Else a chunk of zeros is published to the same subject
        the waiting way, which raises the refusal if JetStream is full (`bus.jetstream_full`): nats-py never
        completes the future of a `publish_async` that JetStream refused (its reply handler raises the
        refusal into the connection's error callback). The probe is purged with the failed object's chunks."""
        if not await bus.answers(self._nc):
            why = str(error) or "an ack did not come in time"
            raise bus.NatsUnreachable(f"{subject}: {why}, and NATS does not answer a ping") from error
        await self._js.publish(subject, bytes(chunk))

    async def _info(self, job_id: str, name: str) -> api.ObjectInfo:
        try:
            info = await (await self._store(job_id)).get_info(name)
        except NotFoundError as error:  # ObjectNotFoundError subclasses it
            raise NotFound(f"weights object {job_id}/{name} does not exist") from error
        return info

    async def _read_object(self, job_id: str, name: str, size: int | None, sha256_hex: str | None
                           ) -> tuple[memoryview, str]:
        """The object's bytes and sha256, checked against `size` and `sha256_hex` (a pointer's), or
        when those are None against its ObjectInfo (what the writer recorded)."""
        info = await self._info(job_id, name)
        size = int(info.size or 0) if size is None else size
        if sha256_hex is None:
            sha256_hex = base64.urlsafe_b64decode(str(info.digest).removeprefix("SHA-256=")).hex()
        if info.size != size:
            raise WeightsCorrupt(f"{job_id}/{name}: object has {info.size} bytes, pointer {size}")
        buffer = _allocate(size)
        digest = await self._read_chunks(job_id, info, buffer) if size else hashlib.sha256().hexdigest()
        if digest != sha256_hex:
            raise WeightsCorrupt(f"{job_id}/{name}: sha256 differs from the recorded one")
        return buffer, digest

    async def _read_chunks(self, job_id: str, info: api.ObjectInfo, buffer: memoryview) -> str:
        """Fill buffer from a push consumer on the object's chunk subject; the sha256 hex.

        The filled prefix is hashed in a worker thread while later chunks arrive. The last chunk
        (num_pending 0) must end exactly at len(buffer). A stall longer than STALL_CHECK_S checks
        that the object still exists, so a pull of an object pruned meanwhile ends in NotFound."""
        subject, inbox = f"$O.{info.bucket}.C.{info.nuid}", self._nc.new_inbox()
        view, hashed, digest = buffer, 0, hashlib.sha256()
        async with chunk_reader(self._nc, buffer, inbox) as reader:
            await self._js.add_consumer(f"OBJ_{info.bucket}", _chunk_consumer(subject, inbox))
            while not reader.done:
                try:
                    await reader.wait(STALL_CHECK_S)
                except TimeoutError:
                    await self._info(job_id, info.name)
                    continue
                filled = reader.filled  # it grows while the thread hashes
                await asyncio.to_thread(digest.update, view[hashed:filled])
                hashed = filled
        if reader.overrun:
            raise WeightsCorrupt(f"{subject}: more than the {len(buffer)} bytes recorded")
        if reader.filled != len(buffer):
            raise WeightsCorrupt(f"{subject}: {reader.filled} bytes stored, {len(buffer)} recorded")
        digest.update(view[hashed:])
        return digest.hexdigest()

    async def _prune(self, job_id: str, keep: int, pointer: WeightPointer) -> None:
        """Keep what a reader may still need: the objects of the pointer's chain, the newest `keep`
        full snapshots at or below the pointer, and the deltas above the oldest of those (a reader
        part-way through an older chain finishes it). Objects above the pointer are left alone."""
        store = await self._store(job_id)
        try:
            infos = await store.list(ignore_deletes=True)
        except NotFoundError:
            return
        named = [(m.group(1), int(m.group(2)), info.name) for info in infos if (m := _OBJECT_RE.match(info.name))]
        fulls = sorted(v for kind, v, _ in named if kind == "v" and v <= pointer.version)
        kept = set(fulls[-max(1, keep):])
        oldest = min(kept | {pointer.full_version})
        needed = {f"v{v}" for v in kept | {pointer.full_version}} | {f"d{v}" for v in pointer.chain[1:]}
        for kind, version, name in named:
            stale = version < oldest if kind == "d" else True
            if name not in needed and version <= pointer.version and stale:
                await self._delete(job_id, name)


def _allocate(size: int) -> memoryview:
    """`size` zeroed bytes of anonymous memory with their pages mapped up front (MAP_POPULATE), which
    costs less than faulting them in one by one, as `bytearray(size)` does."""
    if not size:
        return memoryview(bytearray())
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)  # Linux only
    return memoryview(mmap.mmap(-1, size, flags=flags))


def _chunk_consumer(subject: str, inbox: str) -> api.ConsumerConfig:
    """An ephemeral push consumer of every chunk in order, unacked, flow-controlled (the server
    deletes it a few seconds after the reader's connection closes)."""
    return api.ConsumerConfig(
        deliver_subject=inbox, filter_subject=subject, deliver_policy=api.DeliverPolicy.ALL,
        ack_policy=api.AckPolicy.NONE, max_deliver=1, flow_control=True, idle_heartbeat=STALL_CHECK_S,
        mem_storage=True, num_replicas=1,
    )


def _sha256(payload: bytes | memoryview) -> str:
    return hashlib.sha256(payload).hexdigest()


def _resync_key(job_id: str) -> str:
    """KV key (next to the job's pointer) where readers report a broken chain."""
    return f"{bus.check_job_id(job_id)}.resync"


def _check_epoch(job_id: str, current: WeightPointer | None, lease_epoch: int) -> None:
    if current is not None and current.epoch > lease_epoch:
        raise Fenced(f"job {job_id}: weights under lease epoch {lease_epoch} refused: the pointer was moved "
                     f"under epoch {current.epoch} (another learner holds the job)")


def _check_forward(current: WeightPointer | None, version: int) -> None:
    if current is not None and version <= current.version:
        raise FailedPrecondition(f"weights version {version} is not above the published {current.version}")

