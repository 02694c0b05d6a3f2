"""Weights over NATS JetStream: `NatsTransport`, the object store and KV pointer, the services' default transport
(`fleetrl.weights.store.WeightStore` is the weight channel over it). Imports no torch, so the gateway, which
deletes a job's weights (`fleetrl.jobs.retention`), stays light.

Layout (docs/ARCHITECTURE.md, data flow step 9): one object store bucket per job (`bus.weights_bucket`)
holding the channel's payloads by name; the pointer in KV bucket `bus.WEIGHTS_KV`, key `<job>`, and the
resync note beside it, key `<job>.resync`. A pointer swap is a KV update on the revision read (a create for
revision 0).

Design choices:
- Objects are written in nats-py's object store layout (chunks on `$O.<bucket>.C.<nuid>`, one
  ObjectInfo JSON on `$O.<bucket>.M.<base64url(name)>`), so stock `ObjectStore.get` still reads
  them, but by a pipelined writer (a window of async JetStream publishes of large chunks) instead
  of `put()`'s one publish round trip per 128 KiB.
- Pulls read the chunk subject through an ephemeral push consumer whose messages a ChunkReader
  receives on a connection of its own, the kernel writing each payload straight into its place in
  one buffer of anonymous memory mapped up front (nats-py's client copies every payload about five
  times). A worker thread hashes the filled prefix meanwhile, and the buffer itself is
  returned (a memoryview), not a bytes copy of it. `ObjectStore.get` concatenates with `bytes +=`,
  quadratic in the chunk count (`python -m bench.weights` compares the two; figures measured on
  the development machine are in docs/ARCHITECTURE.md, "Figures measured on one machine").
- Every write first purges the chunks that no ObjectInfo names (`sweep_stray_chunks`): a write that failed
  when NATS did not answer, or whose learner was killed, leaves them, and nothing else would ever delete
  them. A job's weights have one writer, the learner holding the job, which fenced the pointer before its
  first write, so no chunks without an ObjectInfo belong to a write that can still be pointed at.
- Deleting an object purges its metadata and chunks (`NatsTransport.delete`), leaving no marker. Purging a job
  deletes its bucket and purges its pointer's and note's KV subjects (`NatsTransport.purge`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator
from datetime import UTC, datetime

import nats.aio.client
from nats.js import JetStreamContext, api
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import MSG_ROLLUP_SUBJECT, KeyValue
from nats.js.object_store import ObjectStore
from prometheus_client import Counter

from fleetrl.errors import FailedPrecondition, NotFound, WeightsCorrupt
from fleetrl.tasks import bus
from fleetrl.weights.chunk_reader import chunk_reader
from fleetrl.weights.transport import MIN_MB_S, Fetched, Usage, allocate

log = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
"""Default chunk size (measured best in bench.weights); NATS' default max_payload is also 1 MiB."""
PUBLISH_WINDOW = 16
"""Chunk publishes awaiting their JetStream ack at once."""
STALL_CHECK_S = 5.0
"""A pull that receives no chunk for this long checks that its object was not deleted."""
STRAY_CHUNKS_PURGED = Counter("fleetrl_learner_stray_weight_chunks_purged_total",
                              "Weight chunks purged because no object names them (a failed or killed write's)", ["job"])


class NatsTransport:
    """A `fleetrl.weights.transport.Transport` on a JetStream object store bucket per job and the KV pointer."""

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

    # ---------------------------------------------------------------- pointer

    async def read_pointer(self, job_id: str) -> tuple[bytes | None, int]:
        """(value, revision); (None, 0) when absent, (None, revision) when deleted."""
        try:
            entry = await (await self._pointer_kv()).get(bus.check_job_id(job_id))
        except KeyDeletedError as error:
            return None, int(error.entry.revision) if error.entry else 0
        except KeyNotFoundError:
            return None, 0
        assert entry.value is not None and entry.revision is not None
        return entry.value, entry.revision

    async def swap_pointer(self, job_id: str, value: bytes, revision: int) -> None:
        """Compare-and-swap from `revision`; someone else moving it first is a FailedPrecondition."""
        kv = await self._pointer_kv()
        try:
            if revision:
                await kv.update(job_id, value, last=revision)
            else:
                await kv.create(job_id, value)
        except KeyWrongLastSequenceError as error:
            raise FailedPrecondition(f"weights pointer of {job_id} is past revision {revision}") from error

    async def watch_pointer(self, job_id: str) -> AsyncGenerator[bytes]:
        watcher = await (await self._pointer_kv()).watch(bus.check_job_id(job_id))
        try:
            async for entry in watcher:
                if entry is None or entry.value is None or entry.operation is not None:
                    continue  # end-of-history marker, or a delete/purge
                yield entry.value
        finally:
            await watcher.stop()

    async def read_resync(self, job_id: str) -> bytes | None:
        try:
            entry = await (await self._pointer_kv()).get(_resync_key(job_id))
        except (KeyNotFoundError, KeyDeletedError):
            return None
        return entry.value

    async def write_resync(self, job_id: str, value: bytes) -> None:
        await (await self._pointer_kv()).put(_resync_key(job_id), value)

    async def usage(self, job_id: str) -> Usage:
        """The bucket's messages and bytes, and the pointer's and the note's KV entries."""
        messages, size = 0, 0
        with contextlib.suppress(NotFoundError):
            info = await self._js.stream_info(f"OBJ_{bus.weights_bucket(job_id)}")
            messages, size = info.state.messages, info.state.bytes
        for subject in _kv_subjects(job_id):
            try:
                info = await self._js.stream_info(_KV_STREAM, subjects_filter=subject)
            except NotFoundError:
                continue
            messages += sum((info.state.subjects or {}).values())
        return Usage("nats", messages, size)

    async def purge(self, job_id: str) -> None:
        """Delete the job's bucket and purge its pointer's and note's KV subjects (no delete markers left)."""
        self._stores.pop(job_id, None)
        with contextlib.suppress(NotFoundError):
            await self._js.delete_object_store(bus.weights_bucket(job_id))
        for subject in _kv_subjects(job_id):
            with contextlib.suppress(NotFoundError):
                await self._js.purge_stream(_KV_STREAM, subject=subject)

    async def _pointer_kv(self) -> KeyValue:
        if self._kv is None:
            self._kv = await bus.ensure_weights_kv(self._js)
        return self._kv

    # ---------------------------------------------------------------- objects

    async def _store(self, job_id: str) -> ObjectStore:
        if job_id not in self._stores:
            self._stores[job_id] = await bus.ensure_object_store(self._js, job_id)
        return self._stores[job_id]

    async def put(self, job_id: str, name: str, payload: bytes | memoryview) -> str:
        """Chunks with a window of async publishes, then the ObjectInfo; returns the sha256 hex. A write that
        fails has its chunks purged: at once, or, when it failed because NATS does not answer
        (`bus.NatsUnreachable`: the purge could not get through either), by the sweep that starts the job's
        next write (`sweep_stray_chunks`). Either way no ObjectInfo names them, so no pointer can."""
        await self._store(job_id)
        await self.sweep_stray_chunks(job_id)
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
            if not isinstance(error, bus.NatsUnreachable):
                await self._js.purge_stream(f"OBJ_{bucket}", subject=chunk_subject)  # a probe's chunk too
            raise
        return sha256_hex

    async def sweep_stray_chunks(self, job_id: str) -> int:
        """Purge the job's chunk subjects (`$O.<bucket>.C.<nuid>`) whose nuid no ObjectInfo names; the number
        of chunks purged, logged and counted in `fleetrl_learner_stray_weight_chunks_purged_total`.

        They are what a write left that failed when NATS did not answer (its purge could not get through),
        or whose learner was killed half-way: nothing else would delete them until the job is. Called before
        every write, so a learner that claims the job after one that died purges them at its first publish.
        A chunk without an ObjectInfo may also be a write in progress, but a job's weights have one writer,
        the learner holding the job, and it writes only after fencing the pointer with its lease epoch
        (`WeightPublisher.sync`): a learner that lost the job and still writes can never move the pointer to
        what it wrote, and the object whose chunks this purged is deleted before its version is written
        again (`WeightChannel._delete_unreferenced`). So no age of a chunk needs telling apart. The chunk
        subjects are read before the ObjectInfos, so an object finished in between is named. Each call has its
        deadline (a request's); none waits on a watcher, as `ObjectStore.list` does."""
        bucket = bus.weights_bucket(job_id)
        stream = f"OBJ_{bucket}"
        chunks = await self._js.stream_info(stream, subjects_filter=f"$O.{bucket}.C.>")
        if not chunks.state.subjects:
            return 0
        named = await self._named_nuids(stream, bucket)
        stray = {s: n for s, n in chunks.state.subjects.items() if s.rsplit(".", 1)[-1] not in named}
        for subject in sorted(stray):
            await self._js.purge_stream(stream, subject=subject)
        if purged := sum(stray.values()):
            left = (await self._js.stream_info(stream)).state.bytes
            log.warning("job %s: purged %d weight chunks that no object names (left by %d writes that failed or whose "
                        "learner was killed); the bucket holds %d bytes, %d before", job_id, purged, len(stray), left,
                        chunks.state.bytes)
            STRAY_CHUNKS_PURGED.labels(job_id).inc(purged)
        return purged

    async def _named_nuids(self, stream: str, bucket: str) -> set[str]:
        """The chunk nuids that the bucket's ObjectInfos name (one request per object)."""
        metas = await self._js.stream_info(stream, subjects_filter=f"$O.{bucket}.M.>")
        named = set()
        for subject in metas.state.subjects or {}:
            info = json.loads((await self._js.get_last_msg(stream, subject)).data or b"{}")
            if not info.get("deleted"):
                named.add(str(info.get("nuid", "")))
        return named

    async def delete(self, job_id: str, name: str) -> None:
        """Purge an object's metadata, then its chunks, if it exists.

        Not nats-py's `ObjectStore.delete`, which leaves a `deleted` metadata message per object: with
        those markers, nats-server (2.15.1) kept about 9 MB more memory for good per deleted 6.4 MB object,
        so a learner publishing every step grew the server by gigabytes an hour (`bench.soak`); purged,
        the server stays flat. A purged name reads as missing, as a deleted one does."""
        try:
            info = await (await self._store(job_id)).get_info(name)
        except NotFoundError:
            return
        bucket = bus.weights_bucket(job_id)
        await self._js.purge_stream(f"OBJ_{bucket}", subject=_meta_subject(bucket, name))
        await self._js.purge_stream(f"OBJ_{bucket}", subject=f"$O.{bucket}.C.{info.nuid}")

    async def names(self, job_id: str) -> list[str]:
        """The bucket's object names, from its metadata subjects: one stream-info request, under the JetStream
        API's deadline. Not nats-py's `ObjectStore.list`, whose watcher waits for its last entry with no
        deadline, so a connection lost mid-list held the publish that prunes after it for good."""
        bucket = bus.weights_bucket(job_id)
        try:
            info = await self._js.stream_info(f"OBJ_{bucket}", subjects_filter=f"$O.{bucket}.M.>")
        except NotFoundError:
            return []
        meta = len(_meta_subject(bucket, ""))
        return sorted(base64.urlsafe_b64decode(subject[meta:]).decode() for subject in info.state.subjects or {})

    async def _publish_chunks(self, subject: str, payload: bytes | memoryview, chunk: int) -> int:
        """Publish payload in `chunk`-sized pieces, at most PUBLISH_WINDOW unacked; the count. One deadline
        for the whole: `bus.REQUEST_TIMEOUT_S` plus the payload at MIN_MB_S. A publish into a socket that
        does not drain returns only after `bus.FLUSH_TIMEOUT_S`, and each ack had a deadline of its own, so a
        learner cut off from NATS spent the one on every other chunk and then the other on an ack before it
        gave up.

        Past the deadline the write asks why (`_timed_out`): NatsUnreachable when the server does not answer
        a ping, the refusal when JetStream is full, a TimeoutError otherwise."""
        window: deque[asyncio.Future[api.PubAck]] = deque()
        view = memoryview(payload)
        count = 0
        deadline_s = bus.REQUEST_TIMEOUT_S + len(payload) / (MIN_MB_S * 1e6)
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

    async def get(self, job_id: str, name: str, size: int | None) -> Fetched:
        """The object's bytes and their sha256, read as `_read_chunks` does, with the digest its writer
        recorded in the ObjectInfo."""
        info = await self._info(job_id, name)
        size = int(info.size or 0) if size is None else size
        if info.size != size:
            raise WeightsCorrupt(f"{job_id}/{name}: object has {info.size} bytes, pointer {size}")
        buffer = allocate(size)
        digest = await self._read_chunks(job_id, info, buffer) if size else hashlib.sha256().hexdigest()
        recorded = base64.urlsafe_b64decode(str(info.digest).removeprefix("SHA-256=")).hex()
        return Fetched(buffer, digest, recorded)

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


def _meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def _object_digest(sha256_hex: str) -> str:
    """ObjectInfo's digest field: `SHA-256=` + base64url of the raw digest."""
    return "SHA-256=" + base64.urlsafe_b64encode(bytes.fromhex(sha256_hex)).decode()


def _chunk_consumer(subject: str, inbox: str) -> api.ConsumerConfig:
    """An ephemeral push consumer of every chunk in order, unacked, flow-controlled (the server
    deletes it a few seconds after the reader's connection closes)."""
    return api.ConsumerConfig(
        deliver_subject=inbox, filter_subject=subject, deliver_policy=api.DeliverPolicy.ALL,
        ack_policy=api.AckPolicy.NONE, max_deliver=1, flow_control=True, idle_heartbeat=STALL_CHECK_S,
        mem_storage=True, num_replicas=1,
    )


def _resync_key(job_id: str) -> str:
    """KV key (next to the job's pointer) where readers report a broken chain."""
    return f"{bus.check_job_id(job_id)}.resync"


_KV_STREAM = f"KV_{bus.WEIGHTS_KV}"
"""The stream behind the pointer bucket."""


def _kv_subjects(job_id: str) -> list[str]:
    """The subjects of the job's pointer and resync note in `_KV_STREAM`."""
    return [f"$KV.{bus.WEIGHTS_KV}.{key}" for key in (bus.check_job_id(job_id), _resync_key(job_id))]

