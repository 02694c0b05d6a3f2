"""Embedded servers start only once they answer, survive SIGKILL with their data, and stop cleanly."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
from pathlib import Path

import nats
import pytest
import redis

from fleetrl.launcher.embedded import (
    STATE_FILE,
    EmbeddedNats,
    EmbeddedValkey,
    Infra,
    free_port,
    process_identity,
    stop_recorded,
)
from fleetrl.tasks import bus

# Enough single-key writes that replaying the AOF takes Valkey a noticeable time (about 0.3 s here).
AOF_KEYS = 200_000
_FILL = "for i = 1, tonumber(ARGV[1]) do redis.call('SET', 'k' .. i, 'v') end"


def _raw_command(server: EmbeddedValkey, *words: bytes) -> bytes:
    """One command over a bare socket: no client library that retries a LOADING answer for us."""
    request = b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in words)
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        sock.sendall(request)
        return sock.recv(256)


def test_valkey_keeps_aof_data_across_sigkill(tmp_path: Path) -> None:
    server = EmbeddedValkey(data_dir=tmp_path / "v", appendfsync="always")
    with server:
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        port = server.port
        server.kill()
        assert not server.alive()
        assert not server.healthy()
        server.start()
        assert server.port == port
        assert redis.Redis.from_url(server.url).get("k") == b"v"
    assert not server.alive()


def test_valkey_start_returns_only_after_the_aof_is_loaded(tmp_path: Path) -> None:
    server = EmbeddedValkey(data_dir=tmp_path / "v", appendfsync="always")
    with server:
        redis.Redis.from_url(server.url).eval(_FILL, 0, AOF_KEYS)
        server.kill()
        server.start()
        # Valkey accepts connections while it replays the AOF and answers "-LOADING" meanwhile.
        assert _raw_command(server, b"DBSIZE") == b":%d\r\n" % AOF_KEYS


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
        monitor_port = server.monitor_port
        server.kill()
        assert not server.healthy()
        server.start()
        assert server.monitor_port == monitor_port
        assert server.healthy()
        assert asyncio.run(count()) == 3


def test_stop_recorded_signals_a_pid_only_while_it_is_the_recorded_process(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        identity = process_identity(sleeper.pid)
        assert identity is not None
        start_ticks, exe = identity.split(":", 1)
        # The recorded server is gone and its pid now belongs to a process that started at another time.
        (tmp_path / STATE_FILE).write_text(f"NATS_PID={sleeper.pid}\nNATS_PROCESS={int(start_ticks) - 1}:{exe}\n")
        assert stop_recorded(tmp_path) == []
        assert sleeper.poll() is None
        assert not (tmp_path / STATE_FILE).exists()

        (tmp_path / STATE_FILE).write_text(f"NATS_PID={sleeper.pid}\nNATS_PROCESS={identity}\n")
        assert stop_recorded(tmp_path, timeout_s=5) == [sleeper.pid]
        assert sleeper.wait(5) == -signal.SIGTERM
    finally:
        sleeper.kill()
        sleeper.wait()


def test_free_port_never_hands_out_one_port_twice() -> None:
    """The kernel returns a closed probe's port again at random (a thousand draws from its ephemeral
    range repeat one almost surely); a fleet picking a dozen ports must not give two services one."""
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)


def test_the_embedded_servers_refuse_a_client_without_credentials(tmp_path: Path) -> None:
    """What `fleetrl up` starts requires credentials (generated once per run directory, kept across a
    restart): a client without them is refused by both, one with the URL's is served."""
    with Infra(tmp_path / "infra") as infra:
        assert infra.nats.credentials is not None and infra.valkey.credentials is not None
        anonymous = _raw_command(infra.valkey, b"GET", b"k")
        assert anonymous.startswith(b"-NOAUTH"), anonymous
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=infra.valkey.host, port=infra.valkey.port, password="wrong").ping()
        assert redis.Redis.from_url(infra.valkey.url).ping()

        async def nats_logins() -> str:
            anonymous = f"nats://{infra.nats.host}:{infra.nats.port}"
            with pytest.raises(Exception, match=r"[Aa]uthorization"):
                await asyncio.wait_for(nats.connect(anonymous, allow_reconnect=False, connect_timeout=5), 15)
            nc = await asyncio.wait_for(nats.connect(infra.nats.url, allow_reconnect=False, connect_timeout=5), 15)
            await nc.close()
            return "ok"

        assert asyncio.run(nats_logins()) == "ok"
        url = infra.valkey.url
        infra.valkey.kill()
        infra.valkey.start()
        assert redis.Redis.from_url(url).ping()  # the same password after a restart
    again = Infra(tmp_path / "infra")  # a later `fleetrl up` on the same run directory
    assert (again.nats.credentials, again.valkey.credentials) == (infra.nats.credentials, infra.valkey.credentials)
