"""What the operator of a reward service controls: caps on what a job may ask, the refusal to run
reward code without the jail, the rate at which a pool starts workers, and no worker or temp dir
outliving a SIGKILLed service."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from fleetrl.launcher.embedded import free_port, wait_for_port
from fleetrl.proto.fleetrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from fleetrl.reward import jail
from fleetrl.reward.pool import RespawnBudget
from fleetrl.reward.scorer import Scorer
from fleetrl.reward.settings import RewardSettings
from fleetrl.runtime.grpcutil import channel
from tests.reward.conftest import (
    UID_BASE,
    builtin_spec,
    descendants,
    file_spec,
    items,
    reward_service,
    uid_processes,
    wait_gone,
)
from tests.reward.test_reward_episodes import SCRIPTED, env_spec, open_session

ROOT = Path(__file__).resolve().parents[2]
BENIGN = "def reward(completion, prompt, **meta):\n    return 1.0\n"
HANG = "import time\ndef reward(completion, prompt, **meta):\n    time.sleep(1e9)\n"


async def test_a_spec_asking_more_than_the_caps_is_refused_naming_the_field(tmp_path: Path) -> None:
    async with reward_service(tmp_path, max_memory_limit_mb=512, max_timeout_per_item_s=2.0) as stub:
        too_much = await stub.Validate(reward_pb2.ValidateRequest(spec=file_spec(BENIGN, memory_mb=1024)), timeout=10)
        assert not too_much.ok and "reward.memory_limit_mb: 1024 exceeds" in too_much.reason, too_much.reason
        too_slow = await stub.Validate(reward_pb2.ValidateRequest(spec=file_spec(BENIGN, timeout_s=5)), timeout=10)
        assert not too_slow.ok and "reward.timeout_per_item_s: 5 exceeds" in too_slow.reason, too_slow.reason
        ok = await stub.Validate(reward_pb2.ValidateRequest(spec=file_spec(BENIGN, memory_mb=512, timeout_s=2)),
                                 timeout=10)
        assert ok.ok, ok.reason


async def test_without_the_jail_reward_code_is_refused_unless_legacy_is_chosen(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jail, "bwrap_binary", lambda: None)
    async with reward_service(tmp_path) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Score(reward_pb2.ScoreRequest(job_id="j", spec=file_spec(BENIGN), items=items(("x", {}))),
                             timeout=10)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no bwrap binary" in str(refused.value.details())
        # a built-in that runs no submitted code is scored in the legacy sandbox, and says so
        verdict = await stub.Validate(reward_pb2.ValidateRequest(spec=builtin_spec("numeric_match")), timeout=30)
        assert verdict.ok and verdict.sandbox.mode == "legacy" and "jail is unavailable" in verdict.sandbox.summary
        scored = await stub.Score(reward_pb2.ScoreRequest(job_id="j", spec=builtin_spec("numeric_match"), items=items(
            ("it is 5", {"answer": "5"}), ("6", {"answer": "5"}))), timeout=30)
        assert [(r.status, r.reward) for r in scored.results] == [(common_pb2.REWARD_STATUS_OK, 1.0),
                                                                  (common_pb2.REWARD_STATUS_OK, 0.0)]
        # code_tests runs the completion as a program, alone or as a term of a sum: refused
        code = {"builtin": "code_tests", "params": {}}
        for spec in (builtin_spec("code_tests"), builtin_spec("weighted_sum", {"terms": [
                {"builtin": "numeric_match"}, code]})):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Score(reward_pb2.ScoreRequest(job_id="j", spec=spec, items=items(("x", {}))), timeout=10)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert (await stub.Describe(reward_pb2.DescribeRequest(), timeout=10)).problem
    scorer = Scorer(RewardSettings(sandbox_mode="legacy", sandbox_dir=tmp_path))
    assert scorer.sandbox.problem == "" and scorer.sandbox.describe().startswith("mode legacy")
    held = scorer.metrics.registry.get_sample_value("fleetrl_reward_sandbox_layer", {"layer": "seccomp"})
    assert held == 0.0


@pytest.mark.parametrize("mode", ["jail", "legacy"])
async def test_the_sandbox_in_use_is_described_and_named_in_every_validation(mode: str, tmp_path: Path) -> None:
    async with reward_service(tmp_path, sandbox_mode=mode) as stub:
        report = await stub.Describe(reward_pb2.DescribeRequest(), timeout=10)
        verdict = await stub.Validate(reward_pb2.ValidateRequest(spec=file_spec(BENIGN)), timeout=30)
    assert report.mode == mode and report.problem == "" and report.summary.startswith(f"mode {mode}: ")
    assert verdict.ok and verdict.sandbox == report
    if mode == "jail":
        assert all(report.layers.values()) and {"bwrap", "seccomp"} <= set(report.layers)
    else:
        assert not any(report.layers.values())


@pytest.mark.parametrize("mode", ["jail", "legacy"])
async def test_a_sigkilled_service_leaves_no_worker_and_its_temp_dirs_are_swept(mode: str, tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "fleetrl.services.reward", "--listen", f"127.0.0.1:{port}", "--workers", "2",
            "--set", f"sandbox_uid_base={UID_BASE}", "--set", f"sandbox_dir={tmp_path}",
            "--set", f"sandbox_mode={mode}", "--set", f"run_dir={tmp_path / 'run'}"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await asyncio.to_thread(wait_for_port, "127.0.0.1", port, 60.0, proc)
        async with channel(f"127.0.0.1:{port}") as chan:
            stub = reward_pb2_grpc.RewardServiceStub(chan)
            call = stub.Score(reward_pb2.ScoreRequest(job_id="j", spec=file_spec(HANG, timeout_s=30),
                                                      items=items(("x", {}))), timeout=60)
            await asyncio.sleep(1.0)
            workers = descendants(proc.pid)
            assert workers, "the service started no worker"
            proc.send_signal(signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError):
                await call
    finally:
        proc.kill()
        proc.wait()
    start = time.monotonic()
    left = wait_gone(lambda: [pid for pid in workers if os.path.exists(f"/proc/{pid}")
                              and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"], 5.0)
    assert left == [], f"workers outlived the SIGKILLed service: {left}"
    assert time.monotonic() - start < 5.0
    if os.geteuid() == 0:
        assert wait_gone(lambda: uid_processes(lambda u: UID_BASE <= u < UID_BASE + 60_000)) == []
    left_dirs = [p for p in tmp_path.iterdir() if p.name != "run"]
    if mode == "legacy":
        assert left_dirs, "the legacy workers' temp dirs should still be there after the SIGKILL"
    scorer = Scorer(RewardSettings(sandbox_mode=mode, sandbox_dir=tmp_path))  # the next service sweeps them
    await scorer.close()
    assert [p for p in tmp_path.iterdir() if p.name != "run"] == []


async def test_the_pool_reports_status_ok_in_the_jail_for_a_builtin_that_forks(tmp_path: Path) -> None:
    """code_tests forks a child per test: built-in workers may fork (but not exec) in the jail."""
    from fleetrl.reward.client import spec_to_proto
    from fleetrl.spec.config import RewardSpec

    spec = spec_to_proto(RewardSpec(builtin="code_tests", params={}, timeout_per_item_s=10))
    async with reward_service(tmp_path) as stub:
        reply = await stub.Score(reward_pb2.ScoreRequest(job_id="j", spec=spec, items=items(
            ("```python\ndef add(a, b):\n    return a + b\n```", {"tests": ["assert add(1, 2) == 3"]}))), timeout=30)
    assert reply.results[0].status == common_pb2.REWARD_STATUS_OK, reply.results[0].reason
    assert reply.results[0].reward == 1.0 and reply.results[0].components["all_passed"] == 1.0


def test_the_probe_accepts_a_virtualenv_under_a_hidden_dir_and_nothing_else_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A venv in /tmp/x or /home/u is bound at its own path, so /tmp or /home exists in the jail holding
    just that step; anything else there means the host's dir leaked in (a fresh clone's venv under /tmp
    once made the probe refuse every reward)."""
    from fleetrl.reward import jail

    monkeypatch.setattr(jail, "_python_paths", lambda: ["/usr/local", "/tmp/clone/.venv", "/home/u/.pyenv/v"])
    assert jail._only_bound_paths({"tmp": ["clone"], "home": ["u"]})
    assert jail._only_bound_paths({})
    assert not jail._only_bound_paths({"tmp": ["clone", "secret"]})
    assert not jail._only_bound_paths({"var": ["log"]})
    assert jail._only_bound_paths({"run": []})  # an empty mount point holds nothing of the host


def test_the_respawn_budget_allows_a_burst_then_a_rate() -> None:
    budget = RespawnBudget(burst=2, per_s=10.0)
    waits = [budget.take() for _ in range(4)]
    assert waits[:2] == [0.0, 0.0]
    assert waits[2] == pytest.approx(0.1, abs=0.01) and waits[3] == pytest.approx(0.2, abs=0.01)
    time.sleep(0.5)  # the two reservations are spent, then three more tokens came in, capped at the burst
    assert [budget.take() for _ in range(3)] == [0.0, 0.0, pytest.approx(0.1, abs=0.01)]


CRASH = ("import os\ndef reward(completion, prompt, **meta):\n    if meta.get('crash'):\n        os._exit(1)\n"
         "    return 1.0\n")


async def test_a_pool_whose_workers_keep_dying_backs_off(tmp_path: Path) -> None:
    """A reward file that kills its worker on every item gets at most burst + rate * time replacements;
    the rest of its items fail at once naming the back-off, other specs are served, and it recovers."""
    burst, per_s = 3, 2.0
    async with reward_service(tmp_path, workers_per_pool=2, burst_workers_per_pool=0, worker_respawn_burst=burst,
                              worker_respawns_per_s=per_s) as stub:
        crash = file_spec(CRASH)
        start = time.monotonic()
        reply = await stub.Score(reward_pb2.ScoreRequest(job_id="j", spec=crash, items=items(
            *[("x", {"crash": True})] * 40)), timeout=30)
        elapsed = time.monotonic() - start
        statuses = [r.status for r in reply.results]
        killed = statuses.count(common_pb2.REWARD_STATUS_KILLED)
        backing_off = [r for r in reply.results if r.status == common_pb2.REWARD_STATUS_ERROR]
        assert killed + len(backing_off) == 40, reply.results
        assert killed <= 2 + burst + per_s * elapsed + 1, (killed, elapsed)
        assert backing_off and all("reward pool backing off" in r.reason and "worker_respawns_per_s" in r.reason
                                   for r in backing_off), backing_off[:1]
        assert elapsed < 5.0
        other = await stub.Score(reward_pb2.ScoreRequest(job_id="k", spec=file_spec(BENIGN), items=items(
            ("x", {}))), timeout=10)
        assert other.results[0].status == common_pb2.REWARD_STATUS_OK
        deadline = time.monotonic() + 5.0
        while True:  # a worker starts once the budget allows: the spec's good items score again
            again = await stub.Score(reward_pb2.ScoreRequest(job_id="j", spec=crash, items=items(("x", {}))),
                                     timeout=10)
            if again.results[0].status == common_pb2.REWARD_STATUS_OK or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert again.results[0].status == common_pb2.REWARD_STATUS_OK, again.results[0].reason


async def test_a_spec_that_fails_to_load_is_retried_with_backoff(tmp_path: Path) -> None:
    """Score of a file whose import fails: items are errors naming why, and the next loads wait 1 s, then
    2 s (doubling), so calls in between start no worker."""
    async with reward_service(tmp_path) as stub:
        request = reward_pb2.ScoreRequest(job_id="j", spec=file_spec("raise ImportError('no luck')\n"),
                                          items=items(("x", {})))

        async def reason() -> str:
            result = (await stub.Score(request, timeout=10)).results[0]
            assert result.status == common_pb2.REWARD_STATUS_ERROR
            return result.reason

        assert "cannot load" in (first := await reason()) and "ImportError: no luck" in first, first
        start = time.monotonic()
        again = await reason()
        assert time.monotonic() - start < 0.5
        assert "cannot load (failed 1 time(s) in a row; not tried again for" in again and "no luck" in again, again
        await asyncio.sleep(1.0)
        assert "cannot load" in await reason()
        second = await reason()
        waits = re.findall(r"failed 2 time\(s\) in a row; not tried again for ([0-9.]+)s", second)
        assert waits and 1.5 < float(waits[0]) <= 2.0, second


async def test_a_pool_that_cannot_start_a_worker_again_is_dropped(tmp_path: Path) -> None:
    """A file that loads only before a deadline: once its workers die after it, their replacements fail to
    load, the pool breaks, and the spec's items are errors naming why, also those that were waiting for a
    worker when it broke (then the load back-off)."""
    async with reward_service(tmp_path, worker_respawn_burst=100) as stub:
        source = (f"import os, time\nif time.time() > {time.time() + 2.0}:\n    raise ImportError('too late')\n"
                  "def reward(completion, prompt, **meta):\n    return 1.0 if completion == 'ok' else os._exit(1)\n")
        request = reward_pb2.ScoreRequest(job_id="j", spec=file_spec(source), items=items(("x", {}), ("y", {})))
        loaded = await stub.Score(reward_pb2.ScoreRequest(job_id="j", spec=request.spec, items=items(("ok", {}))),
                                  timeout=10)  # the job's pool, loaded before the deadline
        assert loaded.results[0].status == common_pb2.REWARD_STATUS_OK, loaded.results[0].reason
        await asyncio.sleep(2.5)
        killed = await stub.Score(request, timeout=10)
        assert [r.status for r in killed.results] == [common_pb2.REWARD_STATUS_KILLED] * 2
        # at once: its items wait for a worker while the replacements fail to start, three times each, and the
        # pool breaks under them (once under load this failed the whole call UNAVAILABLE: items are verdicts)
        broken = await stub.Score(request, timeout=10)
        assert all(r.status == common_pb2.REWARD_STATUS_ERROR and "no reward worker could be started" in r.reason
                   for r in broken.results), broken.results
        later = await stub.Score(request, timeout=10)
        assert "cannot load (failed 1 time(s) in a row" in later.results[0].reason, later.results[0].reason


async def test_the_respawn_budget_does_not_throttle_the_workers_episodes_hold(tmp_path: Path) -> None:
    """Opening a group's episodes starts a held worker for each: demand, not replacements, so a budget of
    one start and then almost none still opens all of them at once (each episode used to wait for a token)."""
    async with reward_service(tmp_path, workers_per_pool=1, worker_respawn_burst=1,
                              worker_respawns_per_s=0.01) as stub:
        start = time.monotonic()
        opened = await open_session(stub, "s", env_spec(SCRIPTED), 6)
        assert [e.status for e in opened.episodes] == [common_pb2.REWARD_STATUS_OK] * 6, opened.episodes
        assert time.monotonic() - start < 20
