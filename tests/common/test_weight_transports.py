"""The weight channel's round trips through each transport: NATS (a real nats-server) and the file system.

The same publish, pull, delta, adapter, fence, watch, retention and purge steps run through both and must end the
same: the channel's rules do not depend on where the bytes go. Then what only the file system transport
does itself: its files, its compare-and-swap under the lock, a killed put's leftovers."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from fleetrl.errors import FailedPrecondition, Fenced, NotFound, WeightsCorrupt
from fleetrl.policy import models
from fleetrl.spec.config import LoraSpec
from fleetrl.tasks import bus
from fleetrl.weights import adapters as lora_weights
from fleetrl.weights.channel import HeldWeights, WeightChannel, decode_safetensors, encode_safetensors
from fleetrl.weights.filesystem import FilesystemTransport
from fleetrl.weights.publish import WeightPublisher
from fleetrl.weights.store import WeightStore
from fleetrl.weights.transport import Transport
from tests.conftest import TinyModel

JOB = "job-transport"


@pytest.fixture(params=["nats", "filesystem"])
async def channel(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[WeightChannel]:
    if request.param == "filesystem":
        yield WeightChannel(FilesystemTransport(tmp_path / "weights"))
        return
    nc = await bus.connect(request.getfixturevalue("nats_url"), "test-transports")
    yield WeightStore(nc, bus.jetstream(nc))
    await nc.close()


def payload_of(model: torch.nn.Module) -> bytes:
    return encode_safetensors(models.state_dict_for_publish(model, "bfloat16"))


async def test_publish_and_pull_full_snapshots_and_delta_chains(channel: WeightChannel) -> None:
    """Versions 0-4 with full_interval 3: full, delta, delta, full, delta. A reader that follows every
    version reads deltas only after v0, one that starts at v4 the snapshot v3 and d4, both byte-exact, and
    retention keeps the chain of v4 and the two newest snapshots."""
    model = torch.nn.Linear(64, 256)
    publisher = WeightPublisher(channel, JOB, "bfloat16", interval=1, keep=2, lease_epoch=1, full_interval=3)
    assert await publisher.sync() == -1
    held: HeldWeights | None = None
    kinds = []
    for version in range(5):
        with torch.no_grad():
            model.weight[version].add_(1.0)  # a few rows change: a delta's worth
        pointer = await publisher.publish(model, version)
        assert pointer is not None and await channel.latest(JOB) == pointer
        kinds.append(pointer.kind)
        pulled = await channel.update(JOB, pointer, held)
        assert bytes(pulled.payload) == payload_of(model) and pulled.fallback is None
        if pointer.chain:
            assert pulled.pulled_bytes < pointer.size_bytes / 2
        held = HeldWeights(pointer, pulled.payload)
    assert kinds == ["full", "delta", "delta", "full", "delta"]
    assert held is not None and held.pointer.chain == (3, 4)
    joined = await channel.update(JOB, held.pointer, None)  # a reader starting now
    assert bytes(joined.payload) == payload_of(model) and joined.pulled_bytes > held.pointer.size_bytes
    assert sorted(await channel.transport.names(JOB)) == ["d1", "d2", "d4", "v0", "v3"]


async def test_adapters_round_trip(channel: WeightChannel, tiny_model: TinyModel) -> None:
    """A LoRA job's versions: its adapter tensors only, whole, merged by an actor into the base it loaded."""
    spec = LoraSpec(rank=4, alpha=8, target_modules=("q_proj", "v_proj"))
    learner = lora_weights.wrap(tiny_model()[0], spec, seed=0)
    with torch.no_grad():
        for name, param in learner.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.1)
    publisher = WeightPublisher(channel, JOB, "float32", interval=1, keep=2, lease_epoch=1, full_interval=4,
                                adapter_of="tiny-llama")
    pointer = await publisher.publish(learner, 0)
    assert pointer is not None and (pointer.kind, pointer.base, pointer.chain) == ("adapter", "tiny-llama", ())
    published = decode_safetensors(await channel.pull(JOB, pointer))
    expected = lora_weights.adapter_tensors(learner, "float32")
    assert published.keys() == expected.keys()
    assert all(torch.equal(published[name], tensor) for name, tensor in expected.items())
    actor = tiny_model()[0]
    lora_weights.MergedAdapter(actor, spec).apply(published)
    merged = models.state_dict_for_publish(learner.merge_and_unload(), "float32")
    after = models.state_dict_for_publish(actor, "float32")
    assert all(torch.allclose(t, merged[n], atol=1e-6) for n, t in after.items())


async def test_fencing_watch_and_damage(channel: WeightChannel) -> None:
    """A newer lease epoch fences the older learner before it writes; the watch sees every version once, in
    order; a pointer whose digest the bytes do not match is refused, a pruned version is NotFound."""
    seen: list[int] = []

    async def watch() -> None:
        async for pointer in channel.watch(JOB):
            seen.append(pointer.version)
            if pointer.version == 2:
                return

    watching = asyncio.create_task(watch())
    p0 = await channel.publish(JOB, 0, os.urandom(10_000), "float32", lease_epoch=1, keep=1)
    assert (await channel.fence(JOB, 2) or pytest.fail("no pointer")).epoch == 2
    with pytest.raises(Fenced):
        await channel.publish(JOB, 1, os.urandom(10_000), "float32", lease_epoch=1)
    with pytest.raises(FailedPrecondition):
        await channel.publish(JOB, 0, os.urandom(10_000), "float32", lease_epoch=2)
    await asyncio.sleep(0.3)
    await channel.publish(JOB, 1, os.urandom(10_000), "float32", lease_epoch=2, keep=1)
    await asyncio.sleep(0.3)
    p2 = await channel.publish(JOB, 2, os.urandom(10_000), "float32", lease_epoch=2, keep=1)
    await asyncio.wait_for(watching, 10)
    assert seen == [0, 1, 2]
    with pytest.raises(NotFound):
        await channel.pull(JOB, p0)  # pruned (keep=1)
    with pytest.raises(WeightsCorrupt, match="sha256"):
        await channel.pull(JOB, dataclasses.replace(p2, sha256="0" * 64))
    with pytest.raises(WeightsCorrupt, match="bytes"):
        await channel.pull(JOB, dataclasses.replace(p2, size_bytes=p2.size_bytes + 1))


async def test_purge_deletes_the_job_s_weights_and_only_them(channel: WeightChannel) -> None:
    """What `fleetrl delete` and retention do to a job's weights: usage counts its payloads, pointer and note;
    after purge nothing of the job is left, another job's weights are untouched, a second purge finds nothing,
    and a learner that publishes the job again starts from version 0."""
    payload = os.urandom(50_000)
    for version in range(3):
        await channel.publish(JOB, version, payload, "float32", keep=2)
    await channel.request_full(JOB, 0)
    other = await channel.publish("job-other", 0, payload, "float32")
    held = await channel.transport.usage(JOB)
    assert held.items >= 4 and held.size_bytes >= 2 * len(payload), held
    await channel.transport.purge(JOB)
    assert (await channel.transport.usage(JOB)).items == 0
    assert await channel.latest(JOB) is None and await channel.transport.names(JOB) == []
    assert await channel.transport.read_resync(JOB) is None
    await channel.transport.purge(JOB)
    assert bytes(await channel.pull("job-other", other)) == payload
    again = await channel.publish(JOB, 0, payload, "float32")
    assert bytes(await channel.pull(JOB, again)) == payload


# ------------------------------------------------------------- the file system transport's own


async def test_files_of_a_job_and_a_damaged_payload(tmp_path: Path) -> None:
    transport: Transport = FilesystemTransport(tmp_path)
    channel = WeightChannel(transport)
    payload = os.urandom(100_000)
    pointer = await channel.publish(JOB, 0, payload, "bfloat16")
    assert sorted(p.name for p in (tmp_path / JOB).iterdir()) == ["objects", "pointer", "pointer.lock"]
    assert await channel.pull(JOB, pointer) == payload
    path = tmp_path / JOB / "objects" / "v0"
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 1
    path.write_bytes(bytes(damaged))
    with pytest.raises(WeightsCorrupt, match="sha256"):
        await channel.pull(JOB, pointer)
    path.write_bytes(bytes(damaged[:-1]))
    with pytest.raises(WeightsCorrupt, match="bytes"):
        await channel.pull(JOB, pointer)


async def test_a_killed_puts_leftover_is_removed_by_the_next_put(tmp_path: Path) -> None:
    channel = WeightChannel(FilesystemTransport(tmp_path))
    await channel.publish(JOB, 0, b"zero" * 100, "bfloat16")
    leftover = tmp_path / JOB / "objects" / ".tmp-v1-killed"
    leftover.write_bytes(b"half a payload")
    assert await channel.transport.names(JOB) == ["v0"]
    await channel.publish(JOB, 1, b"one" * 100, "bfloat16")
    assert sorted(p.name for p in (tmp_path / JOB / "objects").iterdir()) == ["v0", "v1"]


async def test_concurrent_swaps_from_two_transports_on_one_directory(tmp_path: Path) -> None:
    """Each of two transports (each with its own lock file descriptors) swaps from the revisions it reads, many
    times at once: every swap that returned moved the revision by one, every other was refused."""
    transports = [FilesystemTransport(tmp_path), FilesystemTransport(tmp_path)]

    async def swap(transport: FilesystemTransport, n: int) -> bool:
        _, revision = await transport.read_pointer(JOB)
        try:
            await transport.swap_pointer(JOB, f"{n}".encode(), revision)
        except FailedPrecondition:
            return False
        return True

    done = await asyncio.gather(*(swap(transports[n % 2], n) for n in range(40)))
    value, revision = await transports[0].read_pointer(JOB)
    assert revision == sum(done) >= 1 and value is not None
