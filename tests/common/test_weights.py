"""Weight store against a real nats-server: round trip, corruption, CAS, pruning, watch, restart."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from nats.aio.client import Client as NATS
from nats.js.object_store import ObjectStore
from prometheus_client import REGISTRY

from fleetrl.errors import DeadlineExceeded, FailedPrecondition, Fenced, NotFound, WeightsCorrupt
from fleetrl.launcher.embedded import EmbeddedNats
from fleetrl.tasks import bus
from fleetrl.weights import jetstream as weights
from fleetrl.weights.chunk_reader import ChunkReader
from fleetrl.weights.store import WeightPointer, WeightStore, decode_safetensors, encode_safetensors

JOB = "job-w"


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    client = await bus.connect(nats_url, "test-weights")
    yield client
    await client.close()


@pytest.fixture
def store(nc: NATS) -> WeightStore:
    return WeightStore(nc, bus.jetstream(nc))


async def object_store(nc: NATS) -> ObjectStore:
    return await bus.jetstream(nc).object_store(bus.weights_bucket(JOB))


async def test_round_trip_verifies_digest_and_stock_get_reads_it(store: WeightStore, nc: NATS) -> None:
    payload = os.urandom(5 * 1024 * 1024 + 123)
    pointer = await store.publish(JOB, 0, payload, "bfloat16")
    assert pointer == WeightPointer(0, "v0", hashlib.sha256(payload).hexdigest(), len(payload), "bfloat16")
    assert await store.latest(JOB) == pointer
    assert await store.pull(JOB, pointer) == payload
    assert (await (await object_store(nc)).get("v0")).data == payload  # same layout as nats-py's put


async def test_chunks_fit_a_default_1_mib_max_payload(tmp_path: Path) -> None:
    with EmbeddedNats(data_dir=tmp_path / "small", max_payload_mb=1) as server:
        client = await bus.connect(server.url, "test-weights-small")
        try:
            store = WeightStore(client, bus.jetstream(client))
            payload = os.urandom(3 * 1024 * 1024)
            assert await store.pull(JOB, await store.publish(JOB, 0, payload, "bfloat16")) == payload
        finally:
            await client.close()


async def test_safetensors_through_the_store(store: WeightStore) -> None:
    tensors = {
        "w": torch.randn(64, 32).to(torch.bfloat16), "b": torch.arange(7, dtype=torch.float32),
        "mask": torch.tensor([True, False, True]), "steps": torch.tensor(3, dtype=torch.int64),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
    }
    pointer = await store.publish(JOB, 1, encode_safetensors(tensors), "bfloat16")
    pulled = decode_safetensors(await store.pull(JOB, pointer))
    assert pulled.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert pulled[name].dtype == tensor.dtype and torch.equal(pulled[name], tensor)


async def test_latest_is_none_before_first_publish(store: WeightStore) -> None:
    assert await store.latest(JOB) is None


async def test_a_stale_learners_publish_is_fenced_before_it_writes(store: WeightStore, nc: NATS) -> None:
    await store.publish(JOB, 0, b"v0" * 100, "float32", lease_epoch=1)
    stamped = await store.fence(JOB, 2)  # the learner that claimed the job next
    assert stamped is not None and (stamped.version, stamped.epoch) == (0, 2)
    with pytest.raises(Fenced, match="lease epoch 1"):
        await store.publish(JOB, 1, b"v1" * 100, "float32", lease_epoch=1)
    with pytest.raises(Fenced):
        await store.fence(JOB, 1)
    objects = await bus.jetstream(nc).object_store(bus.weights_bucket(JOB))
    assert [info.name for info in await objects.list()] == ["v0"]  # nothing of epoch 1 was written
    assert (await store.publish(JOB, 1, b"v1" * 100, "float32", lease_epoch=2)).epoch == 2


async def test_pointer_with_wrong_sha_raises_corrupt(store: WeightStore) -> None:
    pointer = await store.publish(JOB, 0, os.urandom(300_000), "bfloat16")
    forged = WeightPointer(0, pointer.object_name, "0" * 64, pointer.size_bytes, pointer.dtype)
    with pytest.raises(WeightsCorrupt, match="sha256"):
        await store.pull(JOB, forged)
    with pytest.raises(WeightsCorrupt, match="bytes"):
        await store.pull(JOB, WeightPointer(0, pointer.object_name, pointer.sha256, pointer.size_bytes + 1, "bfloat16"))


async def test_replaced_chunk_raises_corrupt(store: WeightStore, nc: NATS) -> None:
    """Delete one stored chunk and append a same-sized forged one: size matches, digest does not."""
    pointer = await store.publish(JOB, 0, os.urandom(3 * 1024 * 1024), "bfloat16")
    js = bus.jetstream(nc)
    info = await (await object_store(nc)).get_info("v0")
    subject = f"$O.{info.bucket}.C.{info.nuid}"
    stream = f"OBJ_{info.bucket}"
    first = await js.get_last_msg(stream, subject)  # the last chunk, a full one here
    await js.delete_msg(stream, first.seq)
    await js.publish(subject, os.urandom(len(first.data)))
    with pytest.raises(WeightsCorrupt, match="sha256"):
        await store.pull(JOB, pointer)


async def test_missing_chunk_raises_corrupt(store: WeightStore, nc: NATS) -> None:
    pointer = await store.publish(JOB, 0, os.urandom(3 * 1024 * 1024), "bfloat16")
    js = bus.jetstream(nc)
    info = await (await object_store(nc)).get_info("v0")
    last = await js.get_last_msg(f"OBJ_{info.bucket}", f"$O.{info.bucket}.C.{info.nuid}")
    await js.delete_msg(f"OBJ_{info.bucket}", last.seq)
    with pytest.raises(WeightsCorrupt, match="bytes stored"):
        await store.pull(JOB, pointer)


async def purge_chunks(nc: NATS, name: str) -> None:
    info = await (await object_store(nc)).get_info(name)
    await bus.jetstream(nc).purge_stream(f"OBJ_{info.bucket}", subject=f"$O.{info.bucket}.C.{info.nuid}")


async def test_pull_is_bounded_by_its_deadline(store: WeightStore, nc: NATS) -> None:
    pointer = await store.publish(JOB, 0, os.urandom(100_000), "bfloat16")
    await purge_chunks(nc, "v0")
    with pytest.raises(DeadlineExceeded):
        await store.pull(JOB, pointer, timeout_s=1.0)


async def test_pull_of_object_deleted_meanwhile_raises_not_found(
    store: WeightStore, nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(weights, "STALL_CHECK_S", 0.2)
    pointer = await store.publish(JOB, 0, os.urandom(100_000), "bfloat16")
    await purge_chunks(nc, "v0")  # the pull stalls as if the object were pruned mid-read
    pulling = asyncio.create_task(store.pull(JOB, pointer, timeout_s=10.0))
    await asyncio.sleep(0.5)
    await (await object_store(nc)).delete("v0")
    with pytest.raises(NotFound):
        await pulling


async def test_pointer_never_moves_backwards(store: WeightStore) -> None:
    await store.publish(JOB, 5, b"five", "bfloat16")
    for stale in (5, 4):
        with pytest.raises(FailedPrecondition):
            await store.publish(JOB, stale, b"stale", "bfloat16")
    latest = await store.latest(JOB)
    assert latest is not None and latest.version == 5
    assert await store.pull(JOB, latest) == b"five"  # v5 was not overwritten


class RacedStore(WeightStore):
    """A store whose publish is overtaken by `rival`'s between its read of the pointer and its
    compare-and-swap: the rival publishes once this store's object is written."""

    rival: WeightStore

    def __init__(self, nc: NATS, rival: WeightStore) -> None:
        super().__init__(nc, bus.jetstream(nc))
        self.rival = rival

    async def _write_object(self, job_id: str, name: str, payload: bytes) -> str:
        sha256_hex = await super()._write_object(job_id, name, payload)
        await self.rival.publish(job_id, 9, b"rival", "bfloat16")
        return sha256_hex


@pytest.mark.parametrize("published_before", [False, True], ids=["create", "update"])
async def test_pointer_moved_during_publish_raises_failed_precondition(
    store: WeightStore, nc: NATS, published_before: bool
) -> None:
    """A real compare-and-swap conflict on the KV pointer, on its creation and on an update: the
    overtaken writer gets FailedPrecondition and the pointer keeps the rival's version."""
    if published_before:
        await store.publish(JOB, 1, b"one", "bfloat16")
    raced = RacedStore(nc, store)
    with pytest.raises(FailedPrecondition, match="moved during publish"):
        await raced.publish(JOB, 2, b"two", "bfloat16")
    latest = await store.latest(JOB)
    assert latest is not None and latest.version == 9
    assert await store.pull(JOB, latest) == b"rival"


async def test_keep_deletes_older_objects(store: WeightStore, nc: NATS) -> None:
    pointers = [await store.publish(JOB, version, os.urandom(1000), "bfloat16", keep=2) for version in range(4)]
    names = {info.name for info in await (await object_store(nc)).list(ignore_deletes=True)}
    assert names == {"v2", "v3"}
    with pytest.raises(NotFound):
        await store.pull(JOB, pointers[1])
    assert len(await store.pull(JOB, pointers[3])) == 1000


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024


async def test_pruning_leaves_no_markers_and_the_server_does_not_grow(
    store: WeightStore, nc: NATS, nats_server: EmbeddedNats
) -> None:
    """nats-py's ObjectStore.delete leaves a `deleted` metadata message per object, and with those
    nats-server kept about 1.4x every deleted object's bytes in memory for good (a soak's server grew
    by a gigabyte in a minute). Pruning purges instead: the bucket's stream holds the kept objects only,
    and the server's memory stays flat."""
    assert nats_server.proc is not None
    payload = os.urandom(4_000_000)
    before = 0.0
    for version in range(40):
        await store.publish(JOB, version, payload, "bfloat16", keep=2)
        if version == 4:
            before = rss_mb(nats_server.proc.pid)
    grown = rss_mb(nats_server.proc.pid) - before
    state = (await bus.jetstream(nc).stream_info(f"OBJ_{bus.weights_bucket(JOB)}")).state
    chunks = -(-len(payload) // weights.CHUNK_BYTES)
    print(f"nats-server grew {grown:.0f} MB over 35 publishes of a 4 MB object, each pruning one")
    assert state.messages == 2 * (chunks + 1)  # two objects: their chunks and one metadata message each
    assert grown < 60  # with the deleted markers: about 190 MB


async def chunk_subjects(nc: NATS) -> dict[str, int]:
    """The job's chunk subjects in its bucket's stream, and the chunks on each."""
    bucket = bus.weights_bucket(JOB)
    info = await bus.jetstream(nc).stream_info(f"OBJ_{bucket}", subjects_filter=f"$O.{bucket}.C.>")
    return dict(info.state.subjects or {})


async def write_killed_half_way(nc: NATS, chunks: int) -> str:
    """What a learner killed in the middle of a write leaves: chunks under a fresh nuid, no ObjectInfo."""
    subject = f"$O.{bus.weights_bucket(JOB)}.C.{nc._nuid.next().decode()}"
    for _ in range(chunks):
        await bus.jetstream(nc).publish(subject, os.urandom(weights.CHUNK_BYTES))
    return subject


def purged_counted() -> float:
    return REGISTRY.get_sample_value("fleetrl_learner_stray_weight_chunks_purged_total", {"job": JOB}) or 0.0


async def test_the_sweep_purges_the_chunks_no_object_names_and_keeps_the_objects(store: WeightStore,
                                                                                 nc: NATS) -> None:
    payload = os.urandom(3 * 1024 * 1024 + 5)
    pointer = await store.publish(JOB, 0, payload, "bfloat16")
    stray = await write_killed_half_way(nc, 3)
    stream = f"OBJ_{bus.weights_bucket(JOB)}"
    before = (await bus.jetstream(nc).stream_info(stream)).state.bytes
    counted = purged_counted()
    purged = await WeightStore(nc, bus.jetstream(nc)).sweep_stray_chunks(JOB)  # a new learner's: it knows nothing
    after = (await bus.jetstream(nc).stream_info(stream)).state.bytes
    left = await chunk_subjects(nc)
    v0 = await (await object_store(nc)).get_info("v0")
    assert purged == 3 and purged_counted() - counted == 3
    assert left == {f"$O.{v0.bucket}.C.{v0.nuid}": 4} and stray not in left, left
    assert before - after >= 3 * weights.CHUNK_BYTES, (before, after)
    assert await store.pull(JOB, pointer) == payload  # byte-exact, digest checked
    assert await store.sweep_stray_chunks(JOB) == 0


async def test_a_publish_after_a_learner_killed_mid_write_leaves_no_stray_chunks(nc: NATS) -> None:
    """The learner that wrote half an object died; the next one to publish the job's weights purges its chunks
    (before, a failed write's chunks were remembered in the memory of the process that failed, and purged only
    by its next write)."""
    await WeightStore(nc, bus.jetstream(nc)).publish(JOB, 0, os.urandom(1000), "bfloat16")
    stray = await write_killed_half_way(nc, 2)
    pointer = await WeightStore(nc, bus.jetstream(nc)).publish(JOB, 1, os.urandom(1000), "bfloat16")
    infos = await (await object_store(nc)).list(ignore_deletes=True)
    assert set(await chunk_subjects(nc)) == {f"$O.{i.bucket}.C.{i.nuid}" for i in infos}, stray
    assert pointer.version == 1


async def test_watch_yields_increasing_versions(store: WeightStore) -> None:
    await store.publish(JOB, 0, b"zero", "bfloat16")
    seen: list[int] = []

    async def consume() -> None:
        async for pointer in store.watch(JOB):
            seen.append(pointer.version)
            if pointer.version == 3:
                return

    watching = asyncio.create_task(consume())
    for version in (1, 2, 3):
        await asyncio.sleep(0.05)
        await store.publish(JOB, version, f"v{version}".encode(), "bfloat16")
    await asyncio.wait_for(watching, 10)
    assert seen == [0, 1, 2, 3]


async def test_pull_after_server_sigkill_and_restart(nats_server: EmbeddedNats, store: WeightStore, nc: NATS) -> None:
    payload = os.urandom(2 * 1024 * 1024)
    pointer = await store.publish(JOB, 7, payload, "bfloat16")
    nats_server.kill()
    nats_server.start()
    fresh = await bus.connect(nats_server.url, "test-weights-after")
    try:
        after = WeightStore(fresh, bus.jetstream(fresh))
        assert await after.latest(JOB) == pointer
        assert await after.pull(JOB, pointer) == payload
    finally:
        await fresh.close()
    await asyncio.wait_for(_until_connected(nc), 10)
    assert await store.pull(JOB, pointer) == payload  # the reconnected original client too


async def _until_connected(client: NATS) -> None:
    while not client.is_connected:
        await asyncio.sleep(0.05)


class _Wire(asyncio.Transport):
    """Records what a ChunkReader sends."""

    sent: bytearray

    def __init__(self) -> None:
        super().__init__()
        self.sent = bytearray()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.sent += data

    def close(self) -> None:
        pass


def _chunk(data: bytes, pending: int, header: bytes = b"") -> bytes:
    reply = f"$JS.ACK.OBJ_b.c.1.{9 - pending}.{9 - pending}.1700000000000000000.{pending}"
    if not header:
        return f"MSG $O.b.C.n 1 {reply} {len(data)}\r\n".encode() + data + b"\r\n"
    return f"HMSG $O.b.C.n 1 {reply} {len(header)} {len(header) + len(data)}\r\n".encode() + header + data + b"\r\n"


def _status(header: bytes, reply: str = "") -> bytes:
    args = f"_INBOX.x 1 {reply}" if reply else "_INBOX.x 1"
    return f"HMSG {args} {len(header)} {len(header)}\r\n".encode() + header + b"\r\n"


WIRE = (
    b'INFO {"server_id":"x","max_payload":8388608}\r\nPONG\r\n'
    + _chunk(b"hello", pending=2)
    + _status(b"NATS/1.0 100 Idle Heartbeat\r\n\r\n")
    + _status(b"NATS/1.0 100 FlowControl Request\r\n\r\n", reply="$JS.FC.b.c.fc1")
    + b"PING\r\n"
    + _chunk(b", w", pending=1)
    + _status(b"NATS/1.0 100 Idle Heartbeat\r\nNats-Consumer-Stalled: $JS.FC.b.c.fc2\r\n\r\n")
    + _chunk(b"orld!", pending=0, header=b"NATS/1.0\r\n\r\n")
)


def _feed(reader: ChunkReader, wire: bytes, piece: int) -> None:
    """Deliver wire as a socket would, at most `piece` bytes per read, into the reader's own buffers."""
    at = 0
    while at < len(wire):
        target = reader.get_buffer(-1)
        size = min(len(target), piece, len(wire) - at)
        target[:size] = wire[at : at + size]
        reader.buffer_updated(size)
        at += size


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 64, len(WIRE)])
def test_chunk_reader_parses_any_split_of_the_stream(piece: int) -> None:
    buffer, wire = bytearray(13), _Wire()
    reader = ChunkReader(memoryview(buffer))
    reader.connection_made(wire)
    _feed(reader, WIRE, piece)
    assert reader.done and not reader.overrun and reader.filled == 13
    assert buffer == b"hello, world!"
    assert wire.sent == b"PUB $JS.FC.b.c.fc1 0\r\n\r\nPONG\r\nPUB $JS.FC.b.c.fc2 0\r\n\r\n"


def test_chunk_reader_stops_at_a_chunk_that_does_not_fit() -> None:
    buffer = bytearray(10)
    reader = ChunkReader(memoryview(buffer))
    reader.connection_made(_Wire())
    _feed(reader, WIRE, 5)
    assert reader.overrun and reader.filled == 8 and buffer[:8] == b"hello, w"
