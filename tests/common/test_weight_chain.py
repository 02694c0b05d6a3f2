"""Delta publishing against a real nats-server: chains rebuild the exact full payloads of real
training steps, fallbacks to the full snapshot, late joiners, retention, and a publisher killed
between writing a delta and moving the pointer."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch
from nats.aio.client import Client as NATS
from nats.js.object_store import ObjectStore

from fleetrl.errors import WeightsCorrupt
from fleetrl.policy import models
from fleetrl.tasks import bus
from fleetrl.weights.publish import WeightPublisher
from fleetrl.weights.store import HeldWeights, WeightStore, encode_safetensors
from tests.conftest import TinyModel

JOB = "job-chain"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    client = await bus.connect(nats_url, "test-chain")
    yield client
    await client.close()


@pytest.fixture
def store(nc: NATS) -> WeightStore:
    return WeightStore(nc, bus.jetstream(nc))


async def object_names(nc: NATS) -> set[str]:
    objects: ObjectStore = await bus.jetstream(nc).object_store(bus.weights_bucket(JOB))
    return {info.name for info in await objects.list(ignore_deletes=True)}


def trainer(model: torch.nn.Module, lr: float) -> Callable[[], None]:
    """One AdamW step of next-token loss on fixed random tokens per call."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def step() -> None:
        model(tokens, labels=tokens).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    return step


def training_steps(model: torch.nn.Module, steps: int, lr: float) -> list[bytes]:
    """The bf16 payload a full publish would send before and after each of `steps` training steps."""
    step = trainer(model, lr)
    payloads = [encode_safetensors(models.state_dict_for_publish(model, "bfloat16"))]
    for _ in range(steps):
        step()
        payloads.append(encode_safetensors(models.state_dict_for_publish(model, "bfloat16")))
    return payloads


async def test_chain_rebuilds_every_full_payload_of_real_training_steps(
        store: WeightStore, nc: NATS, tiny_model: TinyModel) -> None:
    model, _ = tiny_model()
    payloads = training_steps(model, 20, lr=1e-5)  # the demo's learning rate
    assert len({hashlib.sha256(p).digest() for p in payloads}) == 21  # every step changed some bf16 value
    base: HeldWeights | None = None
    held: HeldWeights | None = None
    late: HeldWeights | None = None
    delta_bytes = []
    for version, payload in enumerate(payloads):
        pointer = await store.publish(JOB, version, payload, "bfloat16", keep=2, base=base, full_interval=6)
        base = HeldWeights(pointer, memoryview(payload))
        assert pointer.kind == ("full" if version % 6 == 0 else "delta")
        assert pointer.full_version == version - version % 6 and pointer.sha256 == hashlib.sha256(payload).hexdigest()
        pulled = await store.update(JOB, pointer, held)
        assert bytes(pulled.payload) == payload and pulled.fallback is None  # an actor that follows every version
        held = HeldWeights(pointer, pulled.payload)
        if pointer.chain:
            delta_bytes.append(pulled.pulled_bytes)
        if version == 17:  # an actor starting now: the snapshot v12, then d13..d17
            joined = await store.update(JOB, pointer, None)
            assert bytes(joined.payload) == payload and joined.fallback is None
            assert joined.pulled_bytes == len(payloads[12]) + sum(delta_bytes[-5:])
        if version == 3:
            late = HeldWeights(pointer, memoryview(bytearray(payload)))
    assert max(delta_bytes) < len(payloads[0]) / 2  # SmolLM2 at this rate: under 5% (bench.weights)
    assert late is not None
    behind = await store.update(JOB, pointer, late)  # v3's chain is gone: the snapshot v18, d19 and d20
    assert bytes(behind.payload) == payloads[20] and behind.fallback == "behind"
    # retention: the chain of v20 (v18, d19, d20), the two newest snapshots and the deltas after the older
    assert await object_names(nc) == {"v12", "v18"} | {f"d{v}" for v in (13, 14, 15, 16, 17, 19, 20)}


async def test_corrupt_held_weights_fall_back_to_the_full_snapshot(store: WeightStore) -> None:
    v0, v1 = os.urandom(300_000), os.urandom(300_000)
    v2 = v1[:5000] + os.urandom(1000) + v1[6000:]
    p0 = await store.publish(JOB, 0, v0, "bfloat16", full_interval=4)
    p1 = await store.publish(JOB, 1, v1, "bfloat16", base=HeldWeights(p0, memoryview(v0)), full_interval=4)
    p2 = await store.publish(JOB, 2, v2, "bfloat16", base=HeldWeights(p1, memoryview(v1)), full_interval=4)
    flipped = bytearray(v1)
    flipped[1000] ^= 1  # a reader's copy damaged where d2 writes nothing: it applies, the digest catches it
    pulled = await store.update(JOB, p2, HeldWeights(p1, memoryview(flipped)))
    assert bytes(pulled.payload) == v2 and pulled.fallback == "delta_corrupt"
    assert pulled.pulled_bytes > len(v0)  # the snapshot v0, then d1 and d2


async def test_broken_chain_is_reported_and_the_publisher_repairs_it(
        store: WeightStore, nc: NATS, tiny_model: TinyModel) -> None:
    """d1 deleted: neither the held v0 nor the snapshot v0 reaches v2, so the reader asks for a full
    snapshot, and the publisher rewrites v2 as one; the reader then loads v2, never an unchecked
    payload."""
    model, _ = tiny_model()
    publisher = WeightPublisher(store, JOB, "bfloat16", interval=1, keep=3, lease_epoch=1, full_interval=4)
    step = trainer(model, lr=1e-3)
    p0 = await publisher.publish(model, 0)
    assert p0 is not None
    held = HeldWeights(p0, (await store.update(JOB, p0, None)).payload)
    step()
    await publisher.publish(model, 1)
    step()
    pointer = await publisher.publish(model, 2)
    assert pointer is not None and pointer.chain == (0, 1, 2)
    await (await bus.jetstream(nc).object_store(bus.weights_bucket(JOB))).delete("d1")
    with pytest.raises(KeyError, match="d1"):  # NotFound
        await store.update(JOB, pointer, held)
    assert await store.latest(JOB) == pointer  # nothing repaired before the publisher looks
    await publisher.repair_if_requested()
    repaired = await store.latest(JOB)
    assert repaired is not None and repaired.version == 2 and repaired.kind == "full"
    assert repaired.sha256 == pointer.sha256 and repaired.object_name == "v2"
    pulled = await store.update(JOB, repaired, None)
    expected = encode_safetensors(models.state_dict_for_publish(model, "bfloat16"))
    assert bytes(pulled.payload) == expected
    step()
    following = await publisher.publish(model, 3)  # the next version builds on the repaired snapshot
    assert following is not None and following.chain == (2, 3)
    caught_up = await store.update(JOB, following, HeldWeights(repaired, pulled.payload))
    assert caught_up.fallback is None
    assert bytes(caught_up.payload) == encode_safetensors(models.state_dict_for_publish(model, "bfloat16"))


async def test_damaged_delta_is_rejected_and_reported(store: WeightStore, nc: NATS) -> None:
    v0, v1 = os.urandom(3 * 1024 * 1024), os.urandom(3 * 1024 * 1024)
    p0 = await store.publish(JOB, 0, v0, "bfloat16", full_interval=4)
    p1 = await store.publish(JOB, 1, v1, "bfloat16", base=HeldWeights(p0, memoryview(v0)), full_interval=4)
    js = bus.jetstream(nc)
    info = await (await js.object_store(bus.weights_bucket(JOB))).get_info("d1")
    last = await js.get_last_msg(f"OBJ_{info.bucket}", f"$O.{info.bucket}.C.{info.nuid}")
    await js.delete_msg(f"OBJ_{info.bucket}", last.seq)
    await js.publish(f"$O.{info.bucket}.C.{info.nuid}", os.urandom(len(last.data)))
    with pytest.raises(WeightsCorrupt):
        await store.update(JOB, p1, HeldWeights(p0, memoryview(bytearray(v0))))
    kv = await js.key_value(bus.WEIGHTS_KV)
    assert (await kv.get(f"{JOB}.resync")).value == b"0"
    assert (await store.publish(JOB, 2, v0, "bfloat16", base=HeldWeights(p1, memoryview(v1)),
                                full_interval=4)).kind == "full"  # the report is honoured


KILLED_PUBLISHER = """
import asyncio, sys
from fleetrl.tasks import bus
from fleetrl.weights import store as weights
from fleetrl.weights.store import HeldWeights, WeightStore

async def main(url: str) -> None:
    nc = await bus.connect(url, "doomed-publisher")
    store = WeightStore(nc, bus.jetstream(nc))
    payloads = [bytes([v]) * 200_000 for v in range(3)]
    base = None
    for version in range(2):
        pointer = await store.publish("job-chain", version, payloads[version], "bfloat16", base=base, full_interval=8)
        base = HeldWeights(pointer, memoryview(payloads[version]))

    async def stall(*args: object) -> None:
        print("delta written", flush=True)
        await asyncio.sleep(3600)

    weights.WeightStore._move_pointer = staticmethod(stall)  # the pointer never moves: SIGKILL comes first
    await store.publish("job-chain", 2, payloads[2], "bfloat16", base=base, full_interval=8)

asyncio.run(main(sys.argv[1]))
"""


async def test_publisher_killed_between_delta_and_pointer_leaves_readers_consistent(
        store: WeightStore, nc: NATS, nats_url: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", KILLED_PUBLISHER, nats_url], stdout=subprocess.PIPE, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)
        assert line == b"delta written\n"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert "d2" in await object_names(nc)  # written, never pointed at
    pointer = await store.latest(JOB)
    assert pointer is not None and pointer.version == 1 and pointer.chain == (0, 1)
    reader = await store.update(JOB, pointer, None)  # a reader sees v1, rebuilt and checked
    assert hashlib.sha256(reader.payload).hexdigest() == pointer.sha256
    # the restarted publisher holds no base: its first version is a full snapshot, the orphan goes
    restarted = WeightPublisher(store, JOB, "bfloat16", interval=1, keep=2, lease_epoch=1, full_interval=8)
    assert await restarted.sync() == 1
    model = torch.nn.Linear(4, 50_000, bias=False)
    p2 = await restarted.publish(model, 2)
    assert p2 is not None and p2.kind == "full"
    assert "d2" not in await object_names(nc)
    p3 = await restarted.publish(model, 3)
    assert p3 is not None and p3.chain == (2, 3)
    caught_up = await store.update(JOB, p3, HeldWeights(pointer, reader.payload))
    assert caught_up.fallback == "behind" and hashlib.sha256(caught_up.payload).hexdigest() == p3.sha256
