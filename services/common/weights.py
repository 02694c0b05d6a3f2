"""Weight store: the learner publishes policy weights, actors pull them, over NATS JetStream.

Layout (docs/ARCHITECTURE.md, data flow step 9): one object store bucket per job (`bus.weights_bucket`),
objects `v<version>` holding safetensors bytes; a pointer in KV bucket `bus.WEIGHTS_KV`, key
`<job>`, JSON {version, object, sha256, bytes, dtype}, moved only forward by compare-and-swap.

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
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import mmap
import re
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import nats.aio.client
import torch
from nats.js import JetStreamContext, api
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import MSG_ROLLUP_SUBJECT, KeyValue
from nats.js.object_store import ObjectStore
from safetensors.torch import save as st_save

from services.common import bus
from services.common.chunk_reader import chunk_reader
from services.common.errors import DeadlineExceeded, FailedPrecondition, Fenced, FleetError, NotFound

CHUNK_BYTES = 1024 * 1024
"""Default chunk size (measured best in bench.weights); NATS' default max_payload is also 1 MiB."""
PUBLISH_WINDOW = 16
"""Chunk publishes awaiting their JetStream ack at once."""
MIN_PULL_TIMEOUT_S = 30.0
MIN_PULL_MB_S = 20.0
"""Default pull deadline: MIN_PULL_TIMEOUT_S plus the payload at MIN_PULL_MB_S."""
STALL_CHECK_S = 5.0
"""A pull that receives no chunk for this long checks that its object was not deleted."""
_VERSION_RE = re.compile(r"^v(\d+)$")
_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
}
"""safetensors dtype names fleetrl may publish."""


class WeightsCorrupt(FleetError, ValueError):
    """A pulled object's size or sha256 differs from its pointer."""


@dataclass(frozen=True)
class WeightPointer:
    """The KV value naming one published weight object.

    On the wire it is JSON {version, object, sha256, bytes, dtype, epoch} (the design's pointer
    format plus the fencing token): `object_name` travels as "object" and `size_bytes` as "bytes";
    a pointer without "epoch" reads as epoch 0."""

    version: int
    object_name: str
    """Name of the object in the job's weight bucket (`v<version>`)."""
    sha256: str
    size_bytes: int
    """Size of the safetensors payload."""
    dtype: str
    epoch: int = 0
    """Job-lease epoch of the learner that moved the pointer here: a lower epoch may not move it."""

    def to_json(self) -> bytes:
        return json.dumps({"version": self.version, "object": self.object_name, "sha256": self.sha256,
                           "bytes": self.size_bytes, "dtype": self.dtype, "epoch": self.epoch},
                          sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> WeightPointer:
        fields = json.loads(raw)
        return cls(
            version=int(fields["version"]), object_name=str(fields["object"]), sha256=str(fields["sha256"]),
            size_bytes=int(fields["bytes"]), dtype=str(fields["dtype"]), epoch=int(fields.get("epoch", 0)),
        )


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

    def __init__(self, nc: nats.aio.client.Client, js: JetStreamContext, *, chunk_bytes: int = CHUNK_BYTES) -> None:
        """`chunk_bytes` is capped below the server's max_payload at publish time."""
        self._nc = nc
        self._js = js
        self._chunk_bytes = chunk_bytes
        self._kv = None
        self._stores = {}

    async def publish(self, job_id: str, version: int, payload: bytes, dtype: str, *, keep: int = 3,
                      lease_epoch: int = 0) -> WeightPointer:
        """Write `v<version>`, move the pointer to it, delete all but the newest `keep` objects.

        Raises FailedPrecondition if the pointer is already at `version` or above, and Fenced (before
        writing anything) if it was moved under a newer job-lease epoch than lease_epoch.
        """
        kv = await self._pointer_kv()
        current, revision = await self._pointer_entry(kv, job_id)
        _check_epoch(job_id, current, lease_epoch)
        _check_forward(current, version)
        name = f"v{version}"
        sha256_hex = await self._write_object(job_id, name, payload)
        pointer = WeightPointer(version=version, object_name=name, sha256=sha256_hex, size_bytes=len(payload),
                                dtype=dtype, epoch=lease_epoch)
        await self._move_pointer(kv, job_id, pointer, revision)
        await self._prune(job_id, keep)
        return pointer

    async def fence(self, job_id: str, lease_epoch: int) -> WeightPointer | None:
        """Stamp the current pointer (same version and object) with lease_epoch, so no learner of an
        older epoch can move it any more; Fenced if a newer epoch stamped it. Returns the pointer."""
        kv = await self._pointer_kv()
        current, revision = await self._pointer_entry(kv, job_id)
        _check_epoch(job_id, current, lease_epoch)
        if current is None or current.epoch == lease_epoch:
            return current
        stamped = replace(current, epoch=lease_epoch)
        await self._move_pointer(kv, job_id, stamped, revision)
        return stamped

    async def latest(self, job_id: str) -> WeightPointer | None:
        """The job's current pointer, or None before its first publish."""
        pointer, _ = await self._pointer_entry(await self._pointer_kv(), job_id)
        return pointer

    async def pull(self, job_id: str, pointer: WeightPointer, *, timeout_s: float | None = None) -> memoryview:
        """The object's bytes (memory the caller owns), verified against the pointer
        (WeightsCorrupt), within a deadline.

        NotFound if the object was deleted (pruned); DeadlineExceeded past `timeout_s`
        (default MIN_PULL_TIMEOUT_S plus the payload at MIN_PULL_MB_S).
        """
        if timeout_s is None:
            timeout_s = MIN_PULL_TIMEOUT_S + pointer.size_bytes / (MIN_PULL_MB_S * 1e6)
        try:
            return await asyncio.wait_for(self._pull(job_id, pointer), timeout_s)
        except TimeoutError as error:
            raise DeadlineExceeded(f"pull of {job_id}/{pointer.object_name} took over {timeout_s:.0f}s") from error

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

    # ---------------------------------------------------------------- objects

    async def _store(self, job_id: str) -> ObjectStore:
        if job_id not in self._stores:
            self._stores[job_id] = await bus.ensure_object_store(self._js, job_id)
        return self._stores[job_id]

    async def _write_object(self, job_id: str, name: str, payload: bytes) -> str:
        """Chunks with a window of async publishes, then the ObjectInfo; returns the sha256 hex."""
        await self._store(job_id)
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
        except BaseException:
            digest.cancel()
            await self._js.purge_stream(f"OBJ_{bucket}", subject=chunk_subject)
            raise
        return sha256_hex

    async def _publish_chunks(self, subject: str, payload: bytes, chunk: int) -> int:
        """Publish payload in `chunk`-sized pieces, at most PUBLISH_WINDOW unacked; the count."""
        window: deque[asyncio.Future[api.PubAck]] = deque()
        view = memoryview(payload)
        count = 0
        for start in range(0, len(payload), chunk):
            if len(window) >= PUBLISH_WINDOW:
                await asyncio.wait_for(window.popleft(), bus.REQUEST_TIMEOUT_S)
            window.append(await self._js.publish_async(subject, bytes(view[start : start + chunk])))
            count += 1
        for future in window:
            await asyncio.wait_for(future, bus.REQUEST_TIMEOUT_S)
        return count

    async def _info(self, job_id: str, name: str) -> api.ObjectInfo:
        try:
            info = await (await self._store(job_id)).get_info(name)
        except NotFoundError as error:  # ObjectNotFoundError subclasses it
            raise NotFound(f"weights object {job_id}/{name} does not exist") from error
        return info

    async def _pull(self, job_id: str, pointer: WeightPointer) -> memoryview:
        info = await self._info(job_id, pointer.object_name)
        if info.size != pointer.size_bytes:
            raise WeightsCorrupt(
                f"{job_id}/{pointer.object_name}: object has {info.size} bytes, pointer {pointer.size_bytes}")
        buffer = _allocate(pointer.size_bytes)
        digest = await self._read_chunks(job_id, info, buffer) if pointer.size_bytes else hashlib.sha256().hexdigest()
        if digest != pointer.sha256:
            raise WeightsCorrupt(f"{job_id}/{pointer.object_name}: sha256 differs from the pointer's")
        return buffer

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

    async def _prune(self, job_id: str, keep: int) -> None:
        """Delete `v<n>` objects older than the newest `keep`."""
        store = await self._store(job_id)
        try:
            infos = await store.list(ignore_deletes=True)
        except NotFoundError:
            return
        versions = sorted(int(m.group(1)) for info in infos if (m := _VERSION_RE.match(info.name)))
        for version in versions[: max(0, len(versions) - max(1, keep))]:
            await store.delete(f"v{version}")


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


def _check_epoch(job_id: str, current: WeightPointer | None, lease_epoch: int) -> None:
    if current is not None and current.epoch > lease_epoch:
        raise Fenced(f"job {job_id}: weights under lease epoch {lease_epoch} refused: the pointer was moved "
                     f"under epoch {current.epoch} (another learner holds the job)")


def _check_forward(current: WeightPointer | None, version: int) -> None:
    if current is not None and version <= current.version:
        raise FailedPrecondition(f"weights version {version} is not above the published {current.version}")

