"""Auth matrix (no token, bad token, other tenant, right tenant), exempt health/reflection, TLS,
open mode, and the token table itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from fleetrl.errors import ConfigError, NotFound, PermissionDenied, Unauthenticated, Unavailable
from fleetrl.proto.fleetrl.v1 import gateway_pb2
from fleetrl.runtime.tokens import TokenSettings
from fleetrl.sdk.client import Client, Run
from fleetrl.services.gateway.__main__ import main as gateway_main
from fleetrl.services.gateway.auth import TokenTable, hash_token
from tests.gateway.conftest import ROOT, TOKENS, Infra, Proc


@pytest.fixture
def bobs_run(client_for: Callable[..., Client], job_dir: Path) -> Run:
    return client_for("bob").create_run(model="tiny-test", prompt_file=job_dir / "prompts.jsonl",
                                        reward_builtin="numeric_match")


@pytest.mark.parametrize("token", [None, "", "wrong-token", TOKENS["alice"] + "x"])
def test_missing_or_bad_token_is_unauthenticated(client_for: Callable[..., Client], bobs_run: Run,
                                                 job_dir: Path, token: str | None) -> None:
    client = Client(client_for("bob").address, token=token)
    for call in (client.list_jobs, lambda: client.get_job(bobs_run.job_id),
                 lambda: client.cancel_job(bobs_run.job_id), lambda: list(client.watch_job(bobs_run.job_id)),
                 lambda: client.submit_file(job_dir / "job.toml")):
        with pytest.raises(Unauthenticated):
            call()
    client.close()


def test_other_tenant_sees_nothing(client_for: Callable[..., Client], bobs_run: Run, tmp_path: Path) -> None:
    alice = client_for("alice")
    for call in (lambda: alice.get_job(bobs_run.job_id), lambda: alice.cancel_job(bobs_run.job_id),
                 lambda: list(alice.watch_job(bobs_run.job_id)),
                 lambda: alice.download_model(bobs_run.job_id, tmp_path)):
        with pytest.raises(NotFound, match="does not exist"):
            call()
    assert bobs_run.job_id not in [j.job_id for j in alice.list_jobs(1000)]
    assert bobs_run.status().state == "queued"  # alice's cancel did nothing


def test_right_tenant_and_raw_bearer_header(gateway: Proc, bobs_run: Run) -> None:
    assert bobs_run.status().tenant == "bob"
    with grpc.insecure_channel(gateway.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service="fleetrl.v1.JobService"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING  # exempt: no token needed


@pytest.mark.parametrize("token", [None, "wrong-token", TOKENS["alice"]])
def test_reflection_lists_and_describes_services_with_any_or_no_token(gateway: Proc, token: str | None) -> None:
    """Reflection is exempt from auth (as auth.py says), so `grpcurl list` works on a closed gateway."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="fleetrl.v1.JobService")]
    with grpc.insecure_channel(gateway.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        listed, described = stub.ServerReflectionInfo(iter(requests), timeout=10, metadata=metadata)
        names = {s.name for s in listed.list_services_response.service}
        assert names == {"fleetrl.v1.JobService", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
        files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                 for raw in described.file_descriptor_response.file_descriptor_proto]
        methods = {m.name for f in files for svc in f.service if svc.name == "JobService" for m in svc.method}
        assert methods == set(gateway_pb2.DESCRIPTOR.services_by_name["JobService"].methods_by_name)
        list_jobs = channel.unary_unary("/fleetrl.v1.JobService/ListJobs",
                                        request_serializer=gateway_pb2.ListJobsRequest.SerializeToString,
                                        response_deserializer=gateway_pb2.ListJobsResponse.FromString)
        if token != TOKENS["alice"]:  # the same channel and metadata are refused by the JobService
            with pytest.raises(grpc.RpcError) as caught:
                list_jobs(gateway_pb2.ListJobsRequest(), timeout=10, metadata=metadata)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        else:
            list_jobs(gateway_pb2.ListJobsRequest(), timeout=10, metadata=metadata)


def test_token_table() -> None:
    table = TokenTable({"a": hash_token("s3cret")})
    assert table.tenant_for("Bearer s3cret") == "a"
    assert table.tenant_for("bearer  s3cret ") == "a"
    for header in (None, "", "s3cret", "Basic s3cret", "Bearer ", "Bearer other"):
        with pytest.raises(Unauthenticated):
            table.tenant_for(header)
    assert TokenTable({}, open_mode=True).tenant_for(None) == "local"


def test_operators_are_tenants_of_the_table_and_only_they_list_every_tenant() -> None:
    table = TokenTable({"a": hash_token("1"), "op": hash_token("2")}, operators=["op"])
    assert (table.viewer("a", False), table.viewer("op", False), table.viewer("op", True)) == ("a", "op", None)
    with pytest.raises(PermissionDenied, match="tenant 'a' is not an operator"):
        table.viewer("a", True)
    assert TokenTable({}, open_mode=True).viewer("local", True) is None  # the one user of an open service
    settings = TokenSettings(tokens={"a": hash_token("1")}, operators=["a", "nobody"])
    with pytest.raises(ConfigError) as refused:
        settings.token_table()
    assert [(v.field, v.description) for v in refused.value.violations] == [
        ("operators[1]", "'nobody' is not a tenant of tokens or tokens_file")]


def test_hash_token_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert gateway_main(["hash-token", "abc"]) == 0
    assert capsys.readouterr().out.strip() == hash_token("abc")


def test_closed_gateway_without_tokens_refuses_to_start(infra: Infra) -> None:
    proc = infra.gateway("no-tokens", tokens={})
    with pytest.raises(Unavailable):
        proc.start(timeout_s=20)
    assert proc.proc is not None and proc.proc.wait(10) == 2
    assert "no tokens configured" in proc.log()


def test_open_mode_is_loud_and_single_tenant(infra: Infra, job_dir: Path) -> None:
    proc = infra.gateway("open", "open_mode = true", tokens={}).start()
    try:
        with Client(proc.address) as client:
            job = client.submit_file(job_dir / "job.toml")
            assert job.tenant == "local" and client.get_job(job.job_id).job_id == job.job_id
        assert "OPEN MODE" in proc.log()
    finally:
        proc.stop()


def test_tls(infra: Infra, tmp_path: Path, job_dir: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    proc = infra.gateway("tls", f'tls_cert = "{cert}"\ntls_key = "{key}"').start()
    try:
        with Client(proc.address, token=TOKENS["alice"], ca_file=cert) as client:
            assert client.submit_file(job_dir / "job.toml").tenant == "alice"
        with Client(proc.address, token=TOKENS["alice"], timeout_s=3) as plain, pytest.raises(Unavailable):
            plain.list_jobs()
        # --tls without --ca-file trusts gRPC's default roots, which GRPC_DEFAULT_SSL_ROOTS_FILE_PATH replaces
        env = {**os.environ, "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(cert), "FLEETRL_TOKEN": TOKENS["alice"]}
        command = [sys.executable, "-m", "fleetrl.launcher.jobs_cli", "jobs", "--gateway", proc.address, "--json"]
        trusted = subprocess.run([*command, "--tls"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert trusted.returncode == 0, trusted.stderr
        assert isinstance(json.loads(trusted.stdout), list)
        plaintext = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert plaintext.returncode == 1 and json.loads(plaintext.stderr)["code"] == "UNAVAILABLE"
    finally:
        proc.stop()
