"""Embedded servers start, survive SIGKILL with their data, and stop cleanly."""

from __future__ import annotations

import asyncio
from pathlib import Path

import redis

from services.common import bus
from services.common.embedded import EmbeddedNats, EmbeddedValkey


def test_valkey_keeps_aof_data_across_sigkill(tmp_path: Path) -> None:
    server = EmbeddedValkey(data_dir=tmp_path / "v", appendfsync="always")
    with server:
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        port = server.port
        server.kill()
        assert not server.alive()
        server.start()
        assert server.port == port
        assert redis.Redis.from_url(server.url).get("k") == b"v"
    assert not server.alive()


def test_jetstream_messages_survive_nats_sigkill(tmp_path: Path) -> None:
    server = EmbeddedNats(data_dir=tmp_path / "n")

    async def publish() -> None:
        nc = await bus.connect(server.url, "test")
        js = bus.jetstream(nc)
        await bus.ensure_streams(js)
        for i in range(3):
            await js.publish(bus.task_subject("j1"), b"x", headers={"Nats-Msg-Id": f"j1/0/{i}"})
        await js.publish(bus.task_subject("j1"), b"x", headers={"Nats-Msg-Id": "j1/0/0"})  # duplicate
        await nc.close()

    async def count() -> int:
        nc = await bus.connect(server.url, "test")
        info = await bus.jetstream(nc).stream_info(bus.TASKS_STREAM)
        await nc.close()
        return int(info.state.messages)

    with server:
        asyncio.run(publish())
        server.kill()
        server.start()
        assert asyncio.run(count()) == 3
