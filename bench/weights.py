"""Weight store throughput: fleetrl's publish/pull against stock nats-py get and raw loopback TCP.

`python -m bench.weights --json [--payload-mb 270]` starts its own embedded nats-server in a temp
dir, publishes one payload of random bytes (the size of SmolLM2-135M in bf16 by default) through
WeightStore, pulls it back, reads the same object with stock `ObjectStore.get`, copies the same
bytes over a 127.0.0.1 socket, and prints one JSON object with the timings and ratios. For
context it also times stock put + get (128 KiB chunks) of the first STOCK_LAYOUT_MB MB.

Then (`--delta-steps`, 0 to skip) full snapshots against deltas on weights from real full
fine-tuning steps of the demo job at `--delta-lr` (`bench.weight_deltas`): bytes per version, the
fraction of bf16 values changed per step, and a reader's pull+apply seconds for each; skipped, with
the reason in `delta_skipped`, when the model (`--delta-model`) is not available here.

Then (`--lora-rank`, 0 to skip) a LoRA job's adapter versions against full bf16 snapshots of the
same model (`bench.weight_adapters`): bytes per version and an actor's adapter pull+apply seconds
against its full pull, measured in the same run; skipped, with the reason in `lora_skipped`, when
the model (`--lora-model`) is not available here.

With `--actor-device DEVICE` (cuda on a GPU box; default: not measured), a learner and an actor on one
box: the bf16 snapshot of `--actor-model`'s weights taken from a model on DEVICE, encoded and published
(`actor_publish_s`: what a learner on DEVICE pays per version), then pulled and loaded in place into an
hf backend on DEVICE as `make_backend` builds an actor's, in `--actor-dtype` (`update` + decode +
`load_weights`, waiting for the device: `actor_pull_load_s`, the fastest of `--repeats`), each also per
GB of payload (`actor_publish_s_per_gb`, `actor_pull_load_s_per_gb`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, cast

from nats.js.object_store import ObjectStore

from bench import weight_adapters, weight_deltas
from bench.train_step import synchronize
from fleetrl.launcher.embedded import EmbeddedNats
from fleetrl.policy import models
from fleetrl.policy.backends import HFBackend, make_backend
from fleetrl.tasks import bus
from fleetrl.weights.store import CHUNK_BYTES, WeightStore, decode_safetensors, encode_safetensors

JOB = "bench"
STOCK_LAYOUT_MB = 50


def loopback_s(payload: bytes) -> float:
    """Seconds to send payload over a 127.0.0.1 TCP socket into a preallocated buffer."""
    listener = socket.create_server(("127.0.0.1", 0))
    received = bytearray(len(payload))

    def receive() -> None:
        conn, _ = listener.accept()
        view, offset = memoryview(received), 0
        with conn:
            while offset < len(received):
                offset += conn.recv_into(view[offset : offset + (1 << 20)])

    reader = threading.Thread(target=receive)
    reader.start()
    started = time.perf_counter()
    with socket.create_connection(listener.getsockname()) as conn:
        conn.sendall(payload)
        reader.join()
    elapsed = time.perf_counter() - started
    listener.close()
    assert received == payload
    return elapsed


async def timed(coro: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    result = await coro
    return result, time.perf_counter() - started


async def measure(url: str, payload: bytes, stock_mb: int | None, repeats: int) -> dict[str, Any]:
    nc = await bus.connect(url, "bench-weights")
    js = bus.jetstream(nc)
    store = WeightStore(nc, js)
    pointer, publish_s = await timed(store.publish(JOB, 1, payload, "bfloat16"))
    pulls = []
    for _ in range(repeats):
        pulled, seconds = await timed(store.pull(JOB, pointer))
        assert pulled == payload
        pulls.append(seconds)
    stock_payload = payload if stock_mb is None else payload[: stock_mb * 10**6]
    if len(stock_payload) != len(payload):
        pointer = await store.publish(JOB, 2, stock_payload, "bfloat16")
    objects = await js.object_store(bus.weights_bucket(JOB))
    result, stock_s = await timed(objects.get(pointer.object_name))
    assert result.data == stock_payload
    figures = {
        "payload_mb": len(payload) / 1e6, "chunk_bytes": min(CHUNK_BYTES, nc.max_payload - 4096),
        "publish_s": publish_s, "pull_s": min(pulls), "pull_s_all": pulls,
        "pull_mb_s": len(payload) / 1e6 / min(pulls), "nats_py_get_payload_mb": len(stock_payload) / 1e6,
        "nats_py_get_s": stock_s, "nats_py_get_mb_s": len(stock_payload) / 1e6 / stock_s,
    }
    figures.update(await stock_layout(objects, payload[:STOCK_LAYOUT_MB * 10**6]))
    await nc.drain()
    return figures


async def stock_layout(objects: ObjectStore, payload: bytes) -> dict[str, float]:
    """Stock put (128 KiB chunks) then stock get: the path fleetrl replaces, on a smaller payload
    because get's `bytes +=` is quadratic in the chunk count."""
    _, put_s = await timed(objects.put("stock", payload))
    result, get_s = await timed(objects.get("stock"))
    assert result.data == payload
    mb = len(payload) / 1e6
    return {"stock_layout_payload_mb": mb, "stock_layout_put_mb_s": mb / put_s, "stock_layout_get_mb_s": mb / get_s}


async def measure_actor(url: str, model_name: str, device: str, dtype: str, repeats: int) -> dict[str, Any]:
    """The --actor-device figures (module docstring): publish from a model on `device`, pull into an actor there."""
    actor = cast(HFBackend, make_backend("hf", model_name, dtype=dtype, device=device))
    nc = await bus.connect(url, "bench-actor")
    store = WeightStore(nc, bus.jetstream(nc))
    started = time.perf_counter()
    payload = encode_safetensors(models.state_dict_for_publish(actor.model, "bfloat16"))
    pointer = await store.publish("bench-actor", 1, payload, "bfloat16")
    publish_s = time.perf_counter() - started
    pull_load_s = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        pulled = await store.update("bench-actor", pointer, None)
        actor.load_weights(decode_safetensors(pulled.payload))
        synchronize(device)
        pull_load_s = min(pull_load_s, time.perf_counter() - started)
    await nc.drain()
    gb = len(payload) / 1e9
    return {"actor_model": model_name, "actor_device": device, "actor_dtype": dtype, "actor_payload_gb": round(gb, 4),
            "actor_publish_s": round(publish_s, 4), "actor_pull_load_s": round(pull_load_s, 4),
            "actor_publish_s_per_gb": round(publish_s / gb, 3), "actor_pull_load_s_per_gb": round(pull_load_s / gb, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (the only output format)")
    parser.add_argument("--payload-mb", type=int, default=270, help="payload size in MB (10**6 bytes)")
    parser.add_argument(
        "--stock-mb", type=int, default=None,
        help="read a separate object of this many MB with stock ObjectStore.get (default: the same object)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="pulls; pull_s is the fastest")
    parser.add_argument("--delta-steps", type=int, default=3,
                        help="learner steps whose weights compare full and delta publishing (0: skip)")
    parser.add_argument("--delta-model", default="smollm2-135m", help="model of those steps")
    parser.add_argument("--delta-lr", type=float, default=weight_deltas.FULL_FT_LR,
                        help="learning rate of those full fine-tuning steps (the demo job's own is a LoRA rate)")
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of the LoRA adapter figure (0: skip)")
    parser.add_argument("--lora-model", default="smollm2-135m", help="base model of the LoRA adapter figure")
    parser.add_argument("--gen-tokens", type=int, default=16, help="new tokens of the LoRA generation figure")
    parser.add_argument("--actor-device", default="",
                        help="publish from and pull into an actor on this device (e.g. cuda; default: skipped)")
    parser.add_argument("--actor-model", default="smollm2-135m", help="model of the --actor-device figures")
    parser.add_argument("--actor-dtype", default="float32", help="the actor's compute dtype (default float32)")
    args = parser.parse_args()
    lora_skipped = weight_deltas.model_available(args.lora_model) if args.lora_rank else "--lora-rank 0"
    skipped = weight_deltas.model_available(args.delta_model) if args.delta_steps else "--delta-steps 0"
    trained: tuple[list[bytes], dict[str, Any]] | None = None
    if skipped is None:
        trained = weight_deltas.train_payloads(args.delta_model, args.delta_steps, args.delta_lr)
    payload = os.urandom(args.payload_mb * 10**6)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(data_dir=Path(tmp)) as server:
        figures = asyncio.run(measure(server.url, payload, args.stock_mb, args.repeats))
        if trained is not None:
            figures.update(trained[1])
            figures.update(asyncio.run(weight_deltas.measure_deltas(server.url, trained[0], args.repeats)))
        else:
            figures["delta_skipped"] = skipped
        if lora_skipped is None:
            figures.update(asyncio.run(weight_adapters.measure_adapters(server.url, args.lora_model, args.lora_rank,
                                                                        args.repeats, args.gen_tokens)))
        else:
            figures["lora_skipped"] = lora_skipped
        if args.actor_device:
            figures.update(asyncio.run(measure_actor(server.url, args.actor_model, args.actor_device,
                                                     args.actor_dtype, args.repeats)))
    loopback = min(loopback_s(payload) for _ in range(args.repeats))
    figures["loopback_mb_s"] = len(payload) / 1e6 / loopback
    figures["ratio_vs_stock"] = figures["pull_mb_s"] / figures["nats_py_get_mb_s"]
    figures["ratio_vs_loopback"] = figures["pull_mb_s"] / figures["loopback_mb_s"]
    figures["cpus"], figures["load_avg_1m"] = os.cpu_count(), os.getloadavg()[0]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
