"""Round trips through a real gateway process: submit, get, list, cancel (with task purge), watch,
download, idempotency, and the CLI's output and exit codes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from fleetrl.errors import ConfigError, FailedPrecondition, NotFound, PermissionDenied
from fleetrl.jobs.store import ADAPTER_DIR, JobState, JobStore
from fleetrl.launcher import jobs_cli as cli
from fleetrl.runtime import heartbeat
from fleetrl.runtime.heartbeat import Beat
from fleetrl.sdk.client import Client, Run
from fleetrl.tasks import bus
from tests.gateway.conftest import ROOT, TOKENS, Infra, Proc


def builtin_run(client: Client, prompts: Path, **params: object) -> Run:
    return client.create_run(model="tiny-test", prompt_file=prompts, reward_builtin="numeric_match", **params)


def test_submit_get_list_cancel(client_for: Callable[..., Client], job_dir: Path) -> None:
    alice = client_for("carol")
    run = alice.create_run(model="tiny-test", prompt_file=job_dir / "prompts.jsonl",
                           reward_file=job_dir / "reward.py", name="first", learning_rate=3e-5, max_steps=7,
                           algorithm="dapo", rollout={"temperature": 0.7})
    job = run.status()
    assert (job.state, job.name, job.tenant) == ("queued", "first", "carol")
    assert job.spec["optim"]["learning_rate"] == 3e-5 and job.spec["train"]["max_steps"] == 7
    assert job.spec["algorithm"]["name"] == "dapo" and job.spec["rollout"]["temperature"] == 0.7
    second = builtin_run(alice, job_dir / "prompts.jsonl")
    listed = [j.job_id for j in alice.list_jobs()]
    assert listed.index(second.job_id) < listed.index(run.job_id)  # newest first
    cancelled = run.cancel("changed my mind")
    assert (cancelled.state, cancelled.reason) == ("cancelled", "changed my mind")
    assert run.cancel().state == "cancelled"  # idempotent
    with pytest.raises(ConfigError) as bad:
        alice.create_run(model="m", prompt_file=job_dir / "prompts.jsonl", reward_builtin="x", learnig_rate=1)
    assert [v.field for v in bad.value.violations] == ["learnig_rate"]


def test_the_reward_sandbox_is_named_in_the_job_and_the_fleet(
        client_for: Callable[..., Client], job_dir: Path, gateway: Proc, capsys: pytest.CaptureFixture[str]) -> None:
    client = client_for("alice")
    job = builtin_run(client, job_dir / "prompts.jsonl").status()
    assert job.sandbox.startswith("mode jail: ") and "missing: none" in job.sandbox, job.sandbox
    assert client.fleet().reward_sandbox == job.sandbox
    assert cli.main(cli_run(gateway, "status", job.job_id)) == 0
    assert "mode jail" in capsys.readouterr().out
    client.cancel_job(job.job_id)


def test_a_tenant_sees_its_own_share_of_actor_time_and_no_other_tenants_jobs(
        client_for: Callable[..., Client], job_dir: Path, infra: Infra) -> None:
    """GetFleet with each tenant's token: an actor's beat names alice's job and bob's; alice sees her job,
    its seconds and her row, bob's only as part of the others' row, and bob the other way round."""
    alice, bob = client_for("alice"), client_for("bob")
    mine = builtin_run(alice, job_dir / "prompts.jsonl").job_id
    theirs = builtin_run(bob, job_dir / "prompts.jsonl").job_id
    beat = Beat("actor", "actor-shares", "generating", mine, 3, served_s={mine: 6.0, theirs: 3.0})

    async def write(clear: bool) -> None:
        store = JobStore.from_url(infra.redis_url)
        try:
            await (heartbeat.clear(store.redis, "actor", beat.member_id) if clear
                   else heartbeat.write(store.redis, beat, ttl_s=60))
        finally:
            await store.close()

    asyncio.run(write(clear=False))
    try:
        for client, own, other, own_s in ((alice, "alice", theirs, 6.0), (bob, "bob", mine, 3.0)):
            fleet = client.fleet()
            [member] = [m for m in fleet.members if m.member_id == beat.member_id]
            assert member.job_id == (mine if own == "alice" else "")
            ours, others = fleet.shares
            assert (ours.tenant, others.tenant) == (own, "")
            assert (ours.served_s, others.served_s) == (own_s, 9.0 - own_s)
            text = json.dumps(fleet.to_dict())
            assert other not in text and ("bob" if own == "alice" else "alice") not in text, text

        # carol, an operator (the shared gateway's `operators`), sees every tenant's rows when she asks, and
        # still acts on her own jobs only; nobody else may ask
        carol = client_for("carol")
        fleet = carol.fleet(all_tenants=True)
        [member] = [m for m in fleet.members if m.member_id == beat.member_id]
        assert (member.job_id, member.policy_version) == (mine, 3)
        served = {s.tenant: s.served_s for s in fleet.shares}
        assert (served["alice"], served["bob"]) == (6.0, 3.0) and "" not in served
        assert {mine, theirs} <= {q.job_id for q in fleet.queues}
        listed = {j.job_id: j.tenant for j in carol.list_jobs(1000, all_tenants=True)}
        assert (listed[mine], listed[theirs]) == ("alice", "bob")
        assert mine not in {j.job_id for j in carol.list_jobs(1000)}  # not asked: her own only
        assert theirs not in json.dumps(carol.fleet().to_dict())
        for call in (lambda: carol.get_job(mine), lambda: carol.cancel_job(mine),
                     lambda: carol.accounting(mine)):
            with pytest.raises(NotFound):
                call()
        for call in (lambda: alice.fleet(all_tenants=True), lambda: bob.list_jobs(all_tenants=True)):
            with pytest.raises(PermissionDenied, match="not an operator"):
                call()
        assert alice.get_job(mine).state == "queued"  # carol's cancel did nothing
    finally:
        asyncio.run(write(clear=True))
        alice.cancel_job(mine)
        bob.cancel_job(theirs)


def test_idempotency_key_returns_the_same_job(client_for: Callable[..., Client], job_dir: Path) -> None:
    client = client_for("carol")
    first = client.submit_file(job_dir / "job.toml", idempotency_key="same")
    again = client.submit_file(job_dir / "job.toml", idempotency_key="same")
    assert first.job_id == again.job_id


def test_cancel_purges_queued_tasks(infra: Infra, client_for: Callable[..., Client], job_dir: Path) -> None:
    run = builtin_run(client_for("alice"), job_dir / "prompts.jsonl")

    async def publish_and_count(n: int) -> int:
        nc = await bus.connect(infra.nats_url, "test")
        js = bus.jetstream(nc)
        await bus.ensure_streams(js)
        for i in range(n):
            await js.publish(bus.task_subject(run.job_id), b"task", headers={"Nats-Msg-Id": f"{run.job_id}/0/{i}"})
        info = await js.stream_info(bus.TASKS_STREAM, subjects_filter=bus.task_subject(run.job_id))
        await nc.drain()
        return int((info.state.subjects or {}).get(bus.task_subject(run.job_id), 0))

    assert asyncio.run(publish_and_count(5)) == 5
    assert run.cancel().state == "cancelled"
    assert asyncio.run(publish_and_count(0)) == 0


def play_learner(infra: Infra, job_id: str, steps: int, model_dir: Path | None = None) -> None:
    """What a learner writes: running, step metrics, exported model, succeeded."""
    async def go(store: JobStore) -> None:
        await asyncio.sleep(0.3)
        await store.set_state(job_id, JobState.RUNNING, allowed_from=(JobState.QUEUED,))
        for step in range(1, steps + 1):
            await asyncio.sleep(0.1)
            await store.append_step(job_id, {"step": step, "policy_version": step, "reward_mean": step / 10,
                                             "kl": 0.01 * step, "tokens_per_s": 100.0 + step}, lease_epoch=0)
        if model_dir is not None:
            await store.set_model_uri(job_id, str(model_dir))
        await store.set_state(job_id, JobState.SUCCEEDED)

    infra.store(go)


def test_watch_streams_states_and_steps_then_ends(infra: Infra, client_for: Callable[..., Client],
                                                  job_dir: Path) -> None:
    client = client_for("bob")
    run = builtin_run(client, job_dir / "prompts.jsonl", max_steps=4)
    learner = threading.Thread(target=play_learner, args=(infra, run.job_id, 4))
    learner.start()
    events = list(run.events())
    learner.join()
    states = [e.state for e in events if e.state]
    assert states[0] == "queued" and states[-1] == "succeeded" and "running" in states
    assert [e.step.step for e in events if e.step] == [1, 2, 3, 4]
    assert events[-1].job.last is not None and events[-1].job.last["reward_mean"] == pytest.approx(0.4)
    assert [s.step for s in run.watch(from_step=3)] == [3, 4]
    assert run.wait(timeout_s=10).state == "succeeded"


def test_download_model(infra: Infra, client_for: Callable[..., Client], job_dir: Path, tmp_path: Path) -> None:
    client = client_for("bob")
    run = builtin_run(client, job_dir / "prompts.jsonl")
    with pytest.raises(FailedPrecondition, match="queued"):
        run.download_model(tmp_path / "early")
    model = tmp_path / "export"
    (model / "sub").mkdir(parents=True)
    files = {"model.safetensors": bytes(range(256)) * 9000, "config.json": b'{"a": 1}', "sub/empty.txt": b""}
    for name, data in files.items():
        (model / name).write_bytes(data)
    play_learner(infra, run.job_id, 1, model)
    out = run.download_model(tmp_path / "got")
    assert {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()} == files


def test_download_of_a_lora_job_is_its_adapter_directory_or_with_merged_its_full_model(
        infra: Infra, client_for: Callable[..., Client], job_dir: Path, tmp_path: Path) -> None:
    run = builtin_run(client_for("bob"), job_dir / "prompts.jsonl", train__lora={"rank": 4})
    exported = tmp_path / "jobs" / run.job_id
    trees = {"model": {"model.safetensors": b"merged" * 1000, "config.json": b"{}"},
             ADAPTER_DIR: {"adapter_model.safetensors": b"adapter" * 100, "adapter_config.json": b"{}"}}
    for name, files in trees.items():
        (exported / name).mkdir(parents=True)
        for file, data in files.items():
            (exported / name / file).write_bytes(data)
    play_learner(infra, run.job_id, 1, exported / "model")

    def got(out: Path) -> dict[str, bytes]:
        return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    assert got(run.download_model(tmp_path / "adapter")) == trees[ADAPTER_DIR]
    assert got(run.download_model(tmp_path / "merged", merged=True)) == trees["model"]


# ----------------------------------------------------------------------------- CLI

def cli_run(gateway: Proc, *args: str, tenant: str = "alice") -> list[str]:
    return [*args, "--gateway", gateway.address, "--token", TOKENS[tenant]]


def test_cli_submit_status_jobs_cancel(gateway: Proc, job_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(cli_run(gateway, "submit", str(job_dir / "job.toml"), "--set", "train.max_steps=9",
                            "--json")) == 0
    job = json.loads(capsys.readouterr().out)
    assert job["spec"]["train"]["max_steps"] == 9 and job["state"] == "queued"
    assert cli.main(cli_run(gateway, "status", job["job_id"])) == 0
    assert "cli-job" in capsys.readouterr().out
    assert cli.main(cli_run(gateway, "jobs")) == 0
    assert job["job_id"] in capsys.readouterr().out
    assert cli.main(cli_run(gateway, "status", "--json")) == 0
    assert job["job_id"] in [j["job_id"] for j in json.loads(capsys.readouterr().out)]
    assert cli.main(cli_run(gateway, "cancel", job["job_id"], "--json")) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "cancelled"


def test_cli_bad_input_exits_2_and_names_every_field(gateway: Proc, job_dir: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(cli_run(gateway, "submit", str(job_dir / "job.toml"), "--set", "train.max_steps=0",
                            "--set", "rollout.temperature=-1", "--set", "optim.lr=1"))
    err = capsys.readouterr().err
    assert code == 2
    for field in ("train.max_steps", "rollout.temperature", "optim.lr"):
        assert f"  {field}: " in err
    (job_dir / "prompts.jsonl").unlink()
    assert cli.main(cli_run(gateway, "submit", str(job_dir / "job.toml"))) == 2
    assert "prompts:" in capsys.readouterr().err
    assert cli.main(cli_run(gateway, "status", "j-000000000000")) == 2
    assert cli.main(cli_run(gateway, "status", "not/an id")) == 2
    assert cli.main(["jobs", "--gateway", "127.0.0.1:1", "--token", "x"]) == 1
    assert cli.main(["frobnicate"]) == 2


def test_cli_watch_prints_summary(infra: Infra, gateway: Proc, client_for: Callable[..., Client],
                                  job_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = builtin_run(client_for("alice"), job_dir / "prompts.jsonl", max_steps=3)
    learner = threading.Thread(target=play_learner, args=(infra, run.job_id, 3))
    learner.start()
    assert cli.main(cli_run(gateway, "watch", run.job_id)) == 0
    learner.join()
    out = capsys.readouterr().out
    assert "succeeded" in out and "reward_mean" in out and "3 steps watched" in out
    assert cli.main(cli_run(gateway, "watch", run.job_id, "--json")) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["step"]["step"] for line in lines if line["step"]] == [1, 2, 3]
    cancelled = builtin_run(client_for("alice"), job_dir / "prompts.jsonl")
    cancelled.cancel()
    assert cli.main(cli_run(gateway, "watch", cancelled.job_id)) == 1


def test_unknown_job_is_not_found(client_for: Callable[..., Client]) -> None:
    with pytest.raises(NotFound):
        client_for("alice").get_job("j-ffffffffffff")


def test_cli_download_json_and_unwritable_dir(infra: Infra, gateway: Proc, client_for: Callable[..., Client],
                                              job_dir: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    run = builtin_run(client_for("alice"), job_dir / "prompts.jsonl")
    model = tmp_path / "export"
    (model / "sub").mkdir(parents=True)
    (model / "weights.bin").write_bytes(b"w" * 3000)
    (model / "sub" / "config.json").write_text("{}")
    play_learner(infra, run.job_id, 1, model)
    out = tmp_path / "got"
    assert cli.main(cli_run(gateway, "download", run.job_id, str(out), "--json")) == 0
    assert json.loads(capsys.readouterr().out) == {"job_id": run.job_id, "dir": str(out), "files": 2, "bytes": 3002}
    assert (out / "weights.bin").read_bytes() == b"w" * 3000 and (out / "sub" / "config.json").read_text() == "{}"
    blocker = tmp_path / "a-file"
    blocker.write_text("in the way")
    assert cli.main(cli_run(gateway, "download", run.job_id, str(blocker / "dir"))) == 2
    err = capsys.readouterr().err
    assert "path: " in err and str(blocker) in err and "Traceback" not in err
    assert cli.main(cli_run(gateway, "download", run.job_id, str(blocker), "--json")) == 2
    error = json.loads(capsys.readouterr().err)
    assert error["code"] == "INVALID_ARGUMENT" and [v["field"] for v in error["violations"]] == ["path"]
    assert str(blocker) in error["violations"][0]["description"]


def test_cli_errors_are_clear_and_json_with_json(gateway: Proc, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-ca.pem"
    assert cli.main(cli_run(gateway, "jobs", "--ca-file", str(missing))) == 2
    err = capsys.readouterr().err
    assert "ca_file: " in err and str(missing) in err
    assert cli.main(cli_run(gateway, "status", "j-000000000000", "--json")) == 2
    assert json.loads(capsys.readouterr().err) == {"error": "job 'j-000000000000' does not exist",
                                                   "code": "NOT_FOUND", "violations": []}
    assert cli.main(cli_run(gateway, "status", "not/an id", "--json")) == 2
    assert [v["field"] for v in json.loads(capsys.readouterr().err)["violations"]] == ["job_id"]
    assert cli.main(["jobs", "--gateway", gateway.address, "--token", "t\u00f6ken", "--json"]) == 2
    assert json.loads(capsys.readouterr().err)["violations"][0]["field"] == "token"
    assert cli.main(["jobs", "--gateway", gateway.address, "--token", "wrong", "--json"]) == 1
    assert json.loads(capsys.readouterr().err)["code"] == "UNAUTHENTICATED"
    # the same as a process: one line of JSON on stderr, no traceback
    done = subprocess.run([sys.executable, "-m", "fleetrl.launcher.jobs_cli", "jobs", "--gateway", gateway.address,
                           "--ca-file", str(missing), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert json.loads(done.stderr)["violations"][0] == {"field": "ca_file",
                                                        "description": f"{missing}: No such file or directory"}
