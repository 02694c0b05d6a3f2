"""Two jobs on one reward service, tried as a hostile tenant would: nothing of one job reaches the other.

Each test can fail: the control case shows the same probe seeing its own job's traces (a worker is
reused within a job), so an empty result for the other job means isolation, not a probe that sees
nothing. Real service, real jailed workers, real gRPC.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from fleetrl.proto.fleetrl.v1 import common_pb2, reward_pb2
from fleetrl.reward import jail
from tests.reward.conftest import file_spec, items, reward_server, reward_service
from tests.reward.test_reward_episodes import env_spec, open_session, step

OK, ERROR = common_pb2.REWARD_STATUS_OK, common_pb2.REWARD_STATUS_ERROR

MARKER = """
import os
def reward(completion, prompt, **meta):
    if completion == "write":
        with open("marker", "w") as handle:
            handle.write("left by the other job")
    return float(os.path.exists("marker"))
"""

REMEMBERING_ENV = """
SEEN = []

class Env:
    def __init__(self, task):
        self.task = task

    def reset(self):
        SEEN.append(self.task["prompt"])
        return " ".join(SEEN)

    def step(self, action):
        return None, 0.0, True
"""


async def score(stub, job: str, spec: reward_pb2.RewardSpec, *completions: str,
                tenant: str = "") -> list[reward_pb2.ScoreResult]:
    request = reward_pb2.ScoreRequest(job_id=job, spec=spec, items=items(*((c, {}) for c in completions)),
                                      tenant=tenant)
    return list((await stub.Score(request, timeout=20)).results)


async def test_two_jobs_with_one_reward_file_share_no_worker(tmp_path: Path) -> None:
    async with reward_service(tmp_path, workers_per_pool=1) as stub:
        spec = file_spec(MARKER)
        (wrote,) = await score(stub, "job-a", spec, "write")
        assert wrote.status == OK and wrote.reward == 1.0, wrote.reason
        (own,) = await score(stub, "job-a", spec, "check")
        assert own.reward == 1.0, "control: job a's next item should run on the worker it wrote in"
        (other,) = await score(stub, "job-b", spec, "check")
        assert other.status == OK and other.reward == 0.0, "job b saw a file job a's item left"


async def test_two_jobs_with_one_environment_file_share_no_worker(tmp_path: Path) -> None:
    async with reward_service(tmp_path, workers_per_pool=1) as stub:
        spec = env_spec(REMEMBERING_ENV)

        async def first_observation(job: str, session: str) -> str:
            opened = await open_session(stub, session, spec, 1, job=job)
            await stub.CloseEpisodes(reward_pb2.CloseEpisodesRequest(job_id=job, session_id=session), timeout=10)
            assert opened.episodes[0].status == OK, opened.episodes[0].reason
            return opened.episodes[0].observation[0].content

        assert await first_observation("job-a", "a1") == "2+2"
        assert await first_observation("job-a", "a2") == "2+2 2+2", "control: job a's worker is reused"
        assert await first_observation("job-b", "b1") == "2+2", "job b's reset saw job a's episodes"


async def test_a_session_is_found_only_by_its_own_job(tmp_path: Path) -> None:
    async with reward_service(tmp_path, workers_per_pool=1) as stub:
        spec = env_spec(REMEMBERING_ENV)
        assert (await open_session(stub, "s", spec, 1, job="job-a")).episodes[0].status == OK
        with pytest.raises(grpc.aio.AioRpcError) as stepped:
            await stub.StepEpisodes(step("s", (0, 0, "x"), job="job-b"), timeout=10)
        assert stepped.value.code() == grpc.StatusCode.NOT_FOUND
        await stub.CloseEpisodes(reward_pb2.CloseEpisodesRequest(job_id="job-b", session_id="s"), timeout=10)
        (mine,) = (await stub.StepEpisodes(step("s", (0, 0, "x"), job="job-a"), timeout=10)).results
        assert mine.status == OK and mine.done, "job b's close reached job a's session"


async def test_episode_slots_are_shared_out_by_job_and_by_tenant(tmp_path: Path) -> None:
    async with reward_service(tmp_path, workers_per_pool=1, max_episodes=10, max_episodes_per_job=2,
                              max_episodes_per_tenant=3) as stub:
        spec = env_spec(REMEMBERING_ENV)
        assert len((await open_session(stub, "a1", spec, 2, job="a", tenant="t")).episodes) == 2
        with pytest.raises(grpc.aio.AioRpcError) as job_full:
            await open_session(stub, "a2", spec, 1, job="a", tenant="t")
        assert job_full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_episodes_per_job 2" in job_full.value.details()
        assert len((await open_session(stub, "b1", spec, 1, job="b", tenant="t")).episodes) == 1
        with pytest.raises(grpc.aio.AioRpcError) as tenant_full:
            await open_session(stub, "b2", spec, 1, job="b", tenant="t")
        assert "max_episodes_per_tenant 3" in tenant_full.value.details()
        other = await open_session(stub, "c1", spec, 2, job="c", tenant="u")  # another tenant is not starved
        assert [e.status for e in other.episodes] == [OK, OK]
        await stub.CloseEpisodes(reward_pb2.CloseEpisodesRequest(job_id="a", session_id="a1"), timeout=10)
        assert len((await open_session(stub, "a3", spec, 2, job="a", tenant="t")).episodes) == 2


async def test_a_tenant_holds_at_most_its_share_of_pools(tmp_path: Path) -> None:
    async with reward_server(tmp_path, workers_per_pool=1, max_pools_per_tenant=2) as (stub, service):
        spec = file_spec(MARKER)
        for job in ("a", "b", "c"):
            assert (await score(stub, job, spec, "check", tenant="t"))[0].status == OK
        assert (await score(stub, "d", spec, "check", tenant="u"))[0].status == OK
        tenants = sorted(key.tenant for key in service.scorer._pools)
        assert tenants == ["t", "t", "u"], tenants  # job a's idle pool was closed for job c


THREAD_PER_CALL = """
import random, threading, time
TOKEN = random.random()
def reward(completion, prompt, **meta):
    if completion == "thread":
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    return TOKEN
"""


async def test_a_worker_left_running_a_thread_never_serves_again(tmp_path: Path) -> None:
    async with reward_server(tmp_path, workers_per_pool=1) as (stub, service):
        spec = file_spec(THREAD_PER_CALL)
        (first,) = await score(stub, "j", spec, "plain")
        (second,) = await score(stub, "j", spec, "plain")
        assert first.reward == second.reward, "control: a clean worker serves the next item"
        (threaded,) = await score(stub, "j", spec, "thread")
        assert threaded.status == OK and threaded.reward == first.reward
        (after,) = await score(stub, "j", spec, "plain")
        assert after.status == OK and after.reward != first.reward, "the worker with a live thread served again"
        registry = service.scorer.metrics.registry
        assert registry.get_sample_value("fleetrl_reward_worker_restarts_total", {"reason": "dirty"}) == 1.0


async def test_threads_started_at_import_or_in_reset_fail_their_call(tmp_path: Path) -> None:
    async with reward_service(tmp_path, workers_per_pool=1) as stub:
        at_import = "import threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()\n" \
                    "def reward(completion, prompt, **meta):\n    return 1.0\n"
        verdict = await stub.Validate(reward_pb2.ValidateRequest(spec=file_spec(at_import)), timeout=20)
        assert not verdict.ok and "left 1 thread(s) or process(es) running" in verdict.reason, verdict.reason
        in_reset = REMEMBERING_ENV.replace("        SEEN.append", "        import threading, time\n"
                                           "        threading.Thread(target=time.sleep, args=(60,)).start()\n"
                                           "        SEEN.append")
        opened = await open_session(stub, "s", env_spec(in_reset), 2)
        assert [e.status for e in opened.episodes] == [ERROR, ERROR]
        assert "reset left 1 thread(s)" in opened.episodes[0].reason, opened.episodes[0].reason


FORGED = """
import os, sys
FRAMES = {{"bigint": b'{{"value": ' + b"1" * 5000 + b'}}', "surrogate": b'{{"error": "\\\\ud800"}}'}}
def forge(body):
    fd = sys.modules["fleetrl.reward.codeexec"].CHILD_CLOSE_FDS[1]
    os.write(fd, len(body).to_bytes(4, "big") + body)
    os.close(fd)
{body}
"""


async def test_a_malformed_reply_fails_only_its_own_item(tmp_path: Path) -> None:
    source = FORGED.format(body="def reward(completion, prompt, **meta):\n"
                                "    if completion in FRAMES:\n        forge(FRAMES[completion])\n"
                                "    return {'a': 1.7e308, 'b': 1.7e308} if completion == 'sum' else 1.0\n")
    async with reward_service(tmp_path, workers_per_pool=2) as stub:
        results = await score(stub, "j", file_spec(source), "fine", "bigint", "surrogate", "sum", "also fine")
        assert [r.status for r in results] == [OK, ERROR, ERROR, ERROR, OK], [r.reason for r in results]
        assert "malformed reply" in results[1].reason and "malformed reply" in results[2].reason
        assert "non-finite total" in results[3].reason


FORGING_ENV = FORGED.format(body="""
class Env:
    def __init__(self, task):
        pass

    def reset(self):
        return "go"

    def step(self, action):
        if action in FRAMES:
            forge(FRAMES[action])
        return "again", 1.7e308, False
""")


async def test_a_malformed_or_non_finite_step_fails_only_its_own_episode(tmp_path: Path) -> None:
    async with reward_service(tmp_path, workers_per_pool=1) as stub:
        assert len((await open_session(stub, "s", env_spec(FORGING_ENV), 3)).episodes) == 3
        request = step("s", (0, 0, "surrogate"), (1, 0, "bigint"), (2, 0, "fine"))
        first = (await stub.StepEpisodes(request, timeout=20)).results
        assert [r.status for r in first] == [ERROR, ERROR, OK], [r.reason for r in first]
        again = (await stub.StepEpisodes(request, timeout=20)).results  # a retry is answered from memory
        assert [r.status for r in again] == [ERROR, ERROR, OK]
        (overflow,) = (await stub.StepEpisodes(step("s", (2, 1, "fine")), timeout=20)).results
        assert overflow.status == ERROR and "non-finite total" in overflow.reason, overflow.reason


WRITER = """
import os
def attempt(path):
    try:
        with open(path, "w") as handle:
            handle.write("x")
        return "written"
    except OSError as error:
        return error.strerror
results = {{p: attempt(p) for p in ("/x", "/dev/x", "/dev/shm/x", "/proc/x")}}
written = 0
try:
    for index in range(64):
        with open(f"{workdir}/f{{index}}", "wb") as handle:
            handle.write(bytes(1 << 20))
        written += 1
except OSError as error:
    results["tmpfs"] = error.strerror
results["written_mb"] = written
print(results)
"""


def test_the_jail_filesystems_are_bounded(tmp_path: Path) -> None:
    """Only /sandbox is writable in the jail, and only up to its size: the root and /dev (tmpfs mounts
    sized at half the RAM by default) are read-only, so a write cannot escape worker_tmp_mb. The program
    runs in the jail directly, without the worker's audit hook, so this checks the kernel's layer alone."""
    bwrap = jail.bwrap_binary()
    if bwrap is None or not jail.probe(bwrap)[0]["bwrap"]:
        pytest.skip("bwrap cannot run here")
    done = subprocess.run(jail.command(bwrap, [sys.executable, "-I", "-c", WRITER.format(workdir=jail.WORKDIR)], 8),
                          capture_output=True, text=True, timeout=60, check=True, stdin=subprocess.DEVNULL)
    results = eval(done.stdout)  # our own program's dict literal
    assert results["/x"] == results["/dev/x"] == results["/dev/shm/x"] == "Read-only file system", results
    assert results["/proc/x"] != "written"
    assert results["tmpfs"] == "No space left on device" and results["written_mb"] <= 8, results


async def test_a_new_episode_sees_no_file_of_the_last_one(tmp_path: Path) -> None:
    source = REMEMBERING_ENV.replace('        return " ".join(SEEN)', '        seen = os.listdir(".")\n'
                                     '        open("left", "w").write("x")\n        return " ".join(seen) or "empty"')
    async with reward_service(tmp_path, workers_per_pool=1) as stub:
        spec = env_spec("import os\n" + source)
        for session in ("s1", "s2"):
            opened = await open_session(stub, session, spec, 1)
            assert opened.episodes[0].observation[0].content == "empty", opened.episodes[0]
            await stub.CloseEpisodes(reward_pb2.CloseEpisodesRequest(job_id="j", session_id=session), timeout=10)


async def test_a_score_call_with_no_items_warms_the_jobs_pool(tmp_path: Path) -> None:
    """What an actor sends when it starts serving a job: the job's pool loads in the background, so its
    first group does not wait for the workers' start and imports."""
    async with reward_server(tmp_path, workers_per_pool=1) as (stub, service):
        assert await score(stub, "warm", file_spec(MARKER)) == []
        keys = [key for key in service.scorer._pools if key.job_id == "warm"]
        assert len(keys) == 1, service.scorer._pools
        pool = await service.scorer._pools[keys[0]]
        assert pool.live_workers == 1
        (first,) = await score(stub, "warm", file_spec(MARKER), "check")
        assert first.status == OK and first.latency_s < 1.0, first
