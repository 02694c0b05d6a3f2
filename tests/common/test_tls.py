"""TLS on the internal hops, with real servers and a CA made for the test (trustme).

- NATS (nats-server with a certificate): the services' client (`bus.connect`) and the weight pull's own
  connection (`chunk_reader`, which upgrades after INFO as NATS does) work over TLS checked against
  `tls_ca_file`; a client that does not speak TLS is refused, and one that checks against the system's CAs
  fails its handshake.
- Redis: the embedded Valkey binary is built without TLS, so a TLS terminator (Python's ssl, in this
  test) stands in front of it, as stunnel or a cloud Redis's endpoint would: the job store and the replay
  service reach it by `rediss://` with `tls_ca_file`, and not without the CA.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.exceptions
import trustme

from fleetrl.errors import Unavailable
from fleetrl.jobs.store import JobStore
from fleetrl.launcher.embedded import EmbeddedNats, EmbeddedValkey
from fleetrl.replay.client import INSERTED, ReplayClient
from fleetrl.services.replay.config import ReplaySettings
from fleetrl.services.replay.server import running
from fleetrl.spec.config import JobSpec, ReplayConfig
from fleetrl.tasks import bus
from fleetrl.weights.store import NatsTransport
from tests.common.test_half_open import group

SPEC = JobSpec.model_validate({"model": "tiny-llama", "prompts": "p.jsonl", "reward": {"builtin": "numeric_match"}})


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def server_files(ca: trustme.CA, tmp_path: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate chain, server key) for 127.0.0.1, as PEM files."""
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key"
    ca.cert_pem.write_to_path(str(paths[0]))
    cert.private_key_and_cert_chain_pem.write_to_path(str(paths[1]))
    cert.private_key_pem.write_to_path(str(paths[2]))
    return paths


async def test_nats_over_tls_for_services_and_weight_pulls_and_no_plaintext(
        tmp_path: Path, server_files: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    ca_file, cert_file, key_file = server_files
    with EmbeddedNats(data_dir=tmp_path / "nats", tls_cert_file=cert_file, tls_key_file=key_file) as server:
        assert server.url.startswith("tls://")
        nc = await bus.connect(server.url, "tls-test", tls_ca_file=ca_file, max_reconnect_attempts=1)
        try:
            transport = NatsTransport(nc, bus.jetstream(nc), chunk_bytes=64 * 1024)
            payload = bytes(range(256)) * 4096  # 1 MiB: 16 chunks through the chunk reader's TLS connection
            sha = await transport.put("j", "v1", payload)
            fetched = await transport.get("j", "v1", len(payload))
            assert bytes(fetched.payload) == payload and fetched.sha256 == sha == fetched.recorded_sha256
        finally:
            await nc.close()

        # a client that does not speak TLS: INFO says it is required, and CONNECT in the clear is refused
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
            assert b'"tls_required":true' in raw.recv(4096)
            raw.sendall(b'CONNECT {"verbose":false}\r\nPING\r\n')
            answer = b""
            with contextlib.suppress(OSError):
                while chunk := raw.recv(4096):
                    answer += chunk
            assert b"PONG" not in answer, answer

        # a client checking the server against the system's CAs refuses the test CA's certificate, and says
        # why (nats-py then keeps the connect pending: the service does not start)
        with pytest.raises((Unavailable, TimeoutError)):
            await asyncio.wait_for(bus.connect(server.url, "tls-test", max_reconnect_attempts=1), 5)
        assert "CERTIFICATE_VERIFY_FAILED" in caplog.text


@contextlib.asynccontextmanager
async def tls_terminator(cert_file: Path, key_file: Path, port: int) -> AsyncIterator[int]:
    """A TLS endpoint on a free port that forwards each connection's plaintext to 127.0.0.1:port."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ssl.SSLError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def forward(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(pump(client_r, server_w), pump(server_r, client_w))

    server = await asyncio.start_server(forward, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def test_redis_over_tls_for_the_job_store_and_replay(tmp_path: Path,
                                                           server_files: tuple[Path, Path, Path]) -> None:
    ca_file, cert_file, key_file = server_files
    with EmbeddedValkey(data_dir=tmp_path / "valkey") as valkey:
        async with tls_terminator(cert_file, key_file, valkey.port) as port:
            url = f"rediss://127.0.0.1:{port}/0"
            store = JobStore.from_url(url, retry_s=1.0, tls_ca_file=ca_file)
            try:
                job = await store.create("t", SPEC, b"", None)
                claimed = await store.claim("L1", lease_s=5)
                assert claimed is not None and claimed.job_id == job.job_id
            finally:
                await store.close()

            settings = ReplaySettings.model_validate({"listen": "127.0.0.1:0", "redis_url": url, "grace_s": 0,
                                                      "tls_ca_file": str(ca_file)})
            async with running(settings) as svc, ReplayClient(f"127.0.0.1:{svc.port}", timeout_s=5) as client:
                await client.configure("j", ReplayConfig.model_validate({}))
                assert await client.insert([group("t0")]) == [INSERTED]

            unchecked = JobStore.from_url(url, retry_s=0.5)  # the system's CAs: the test CA is not among them
            try:
                with pytest.raises(redis.exceptions.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
                    await unchecked.get(job.job_id)
            finally:
                await unchecked.close()
