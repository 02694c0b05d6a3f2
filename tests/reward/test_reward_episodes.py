"""Episodes in the reward service: a real RewardService, real sandboxed workers, real gRPC.

A scripted environment's answers come back exactly; a repeated step is answered from memory; a
hanging step costs only its own episode (worker killed, counted) while the others go on; a bad
environment file fails Validate and OpenEpisodes with the reason; an abandoned session is reaped
and its workers killed; after close a step is NOT_FOUND. Hostile steps (fork, socket, a write
outside the sandbox, a huge observation) end their episodes within the step timeout, and the
service keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc
import pytest

from fleetrl.proto.fleetrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from fleetrl.reward.client import environment_to_proto
from fleetrl.services.reward.server import Running
from fleetrl.spec.config import EnvironmentSpec
from tests.reward.conftest import reward_server, reward_service

SCRIPTED = '''
class Env:
    def __init__(self, task, target=3, hang_on=""):
        self.task, self.target, self.hang_on, self.turn = task, target, hang_on, 0

    def reset(self):
        return [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Q: " + self.task["prompt"]}]

    def step(self, action):
        if self.hang_on and action == self.hang_on:
            while True:
                pass
        self.turn += 1
        done = self.turn >= self.target
        return (None if done else f"obs {self.turn} to {action}"), 0.5 * self.turn, done
'''


def env_spec(source: str, step_timeout_s: float = 2.0, **params: object) -> reward_pb2.EnvironmentSpec:
    spec = EnvironmentSpec(file="env.py", step_timeout_s=step_timeout_s, memory_limit_mb=256, params=params)
    return environment_to_proto(spec, source.encode())


async def open_session(stub: reward_pb2_grpc.RewardServiceStub, session: str, spec: reward_pb2.EnvironmentSpec,
                       count: int, job: str = "j", tenant: str = "") -> reward_pb2.OpenEpisodesResponse:
    request = reward_pb2.OpenEpisodesRequest(job_id=job, session_id=session, spec=spec, prompt="2+2",
                                             metadata_json=json.dumps({"answer": "4"}), count=count, tenant=tenant)
    return await stub.OpenEpisodes(request, timeout=30)


def step(session: str, *actions: tuple[int, int, str], job: str = "j") -> reward_pb2.StepEpisodesRequest:
    return reward_pb2.StepEpisodesRequest(job_id=job, session_id=session, actions=[
        reward_pb2.Action(episode=e, turn=t, text=text) for e, t, text in actions])


def sample(service: Running, name: str, **labels: str) -> float:
    return service.scorer.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_scripted_episodes_answer_exactly_and_repeat_steps(tmp_path: Path) -> None:
    async with reward_service(tmp_path) as stub:
        spec = env_spec(SCRIPTED, target=2)
        opened = await open_session(stub, "s1", spec, 3)
        assert [e.episode for e in opened.episodes] == [0, 1, 2]
        first = opened.episodes[0]
        assert [(m.role, m.content) for m in first.observation] == [("system", "be brief"), ("user", "Q: 2+2")]
        assert first.status == common_pb2.REWARD_STATUS_OK and not first.done
        assert (await open_session(stub, "s1", spec, 3)).episodes == opened.episodes  # a retried open

        one = (await stub.StepEpisodes(step("s1", (0, 0, "a"), (2, 0, "c")), timeout=10)).results
        assert [(r.episode, r.reward, r.done) for r in one] == [(0, 0.5, False), (2, 0.5, False)]
        assert [(m.role, m.content) for m in one[0].observation] == [("user", "obs 1 to a")]
        again = (await stub.StepEpisodes(step("s1", (0, 0, "other")), timeout=10)).results
        assert again[0] == one[0]  # the same turn is answered from memory, not stepped twice

        two = (await stub.StepEpisodes(step("s1", (0, 1, "b")), timeout=10)).results
        assert (two[0].reward, two[0].done, list(two[0].observation)) == (1.0, True, [])
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await stub.StepEpisodes(step("s1", (0, 2, "c")), timeout=10)
        assert ended.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.aio.AioRpcError) as skipped:
            await stub.StepEpisodes(step("s1", (1, 1, "x")), timeout=10)
        assert skipped.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.aio.AioRpcError) as twice:
            await stub.StepEpisodes(step("s1", (1, 0, "x"), (1, 0, "y")), timeout=10)
        assert twice.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        await stub.CloseEpisodes(reward_pb2.CloseEpisodesRequest(job_id="j", session_id="s1"), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as closed:
            await stub.StepEpisodes(step("s1", (1, 0, "x")), timeout=10)
        assert closed.value.code() == grpc.StatusCode.NOT_FOUND


async def test_hanging_step_costs_only_its_episode(tmp_path: Path) -> None:
    async with reward_server(tmp_path) as (stub, service):
        spec = env_spec(SCRIPTED, step_timeout_s=1.0, target=3, hang_on="hang")
        await open_session(stub, "s2", spec, 2)
        started = time.monotonic()
        results = (await stub.StepEpisodes(step("s2", (0, 0, "hang"), (1, 0, "fine")), timeout=20)).results
        assert time.monotonic() - started < 5
        assert (results[0].status, results[0].done) == (common_pb2.REWARD_STATUS_TIMEOUT, True)
        assert "timed out after 1s" in results[0].reason
        assert (results[1].status, results[1].reward, results[1].done) == (common_pb2.REWARD_STATUS_OK, 0.5, False)
        later = (await stub.StepEpisodes(step("s2", (1, 1, "more")), timeout=10)).results
        assert (later[0].reward, later[0].done) == (1.0, False)
        assert sample(service, "fleetrl_reward_worker_restarts_total", reason="timeout") == 1
        assert sample(service, "fleetrl_reward_episodes_total", job="j", status="timeout") == 1
        pool = next(iter(service.scorer._pools.values())).result()
        assert pool.held_workers == 1 and service.sessions.open_episodes == 1
        while pool.live_workers != 3:  # the pool's 2, plus the one episode 1 holds: the killed one is replaced
            assert time.monotonic() - started < 10
            await asyncio.sleep(0.1)


async def test_bad_environment_files_fail_with_the_reason(tmp_path: Path) -> None:
    async with reward_service(tmp_path) as stub:
        for source, reason in (("import nosuchmodule\n", "No module named 'nosuchmodule'"),
                               ("x = 1\n", "defines no environment: a subclass of fleetrl.env.Env"),
                               ("class Env:\n    def reset(self): return 'hi'\n", "class Env does not define step")):
            answer = await stub.Validate(reward_pb2.ValidateRequest(environment=env_spec(source)), timeout=30)
            assert not answer.ok and reason in answer.reason and "environment.file" in answer.reason
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await open_session(stub, "bad", env_spec("x = 1\n"), 2)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        bad_reset = "class Env:\n    def __init__(self, task): pass\n    def reset(self): return 42\n" \
                    "    def step(self, a): return None, 0, True\n"
        opened = await open_session(stub, "r", env_spec(bad_reset), 1)
        assert (opened.episodes[0].status, opened.episodes[0].done) == (common_pb2.REWARD_STATUS_ERROR, True)
        assert "observation is int" in opened.episodes[0].reason
        ok = await stub.Validate(reward_pb2.ValidateRequest(environment=env_spec(SCRIPTED)), timeout=30)
        assert ok.ok, ok.reason


async def test_abandoned_session_is_reaped(tmp_path: Path) -> None:
    async with reward_server(tmp_path, episode_idle_timeout_s=1.0, workers_per_pool=1) as (stub, service):
        await open_session(stub, "gone", env_spec(SCRIPTED), 3)
        pool = next(iter(service.scorer._pools.values())).result()
        assert pool.held_workers == 3 and service.sessions.open_episodes == 3
        started = time.monotonic()
        while sample(service, "fleetrl_reward_episodes_total", job="j", status="abandoned") < 3:
            assert time.monotonic() - started < 5, "the abandoned session was not reaped"
            await asyncio.sleep(0.1)
        assert time.monotonic() - started >= 0.9  # not before the idle timeout (counted from the open)
        assert sample(service, "fleetrl_reward_worker_restarts_total", reason="abandoned") == 3
        with pytest.raises(grpc.aio.AioRpcError) as reaped:
            await stub.StepEpisodes(step("gone", (0, 0, "late")), timeout=10)
        assert reaped.value.code() == grpc.StatusCode.NOT_FOUND
        while pool.live_workers > 1:  # the killed workers are not replaced beyond the pool's size
            assert time.monotonic() - started < 10
            await asyncio.sleep(0.1)
        assert pool.held_workers == 0 and service.sessions.open_episodes == 0


HOSTILE_STEPS = {  # the body of a hostile step()
    "fork": ["import os", "if os.fork() == 0:", "    os._exit(0)", "return 'forked', 1.0, False"],
    "socket": ["import socket", "socket.create_connection(('127.0.0.1', 22), timeout=1)",
               "return 'connected', 1.0, False"],
    "write_outside": ["open(ESCAPE, 'w').write('x')", "return 'wrote', 1.0, False"],
    "huge_observation": ["return 'x' * (8 << 20), 1.0, False"],
}


def hostile_env(attack: str, escape: Path) -> str:
    body = "".join(f"        {line}\n" for line in HOSTILE_STEPS[attack])
    return (f"ESCAPE = {str(escape)!r}\n\nclass Env:\n    def __init__(self, task):\n        pass\n\n"
            f"    def reset(self):\n        return 'go'\n\n    def step(self, action):\n{body}")


@pytest.mark.parametrize("attack", sorted(HOSTILE_STEPS))
async def test_hostile_environment_steps_are_contained(attack: str, tmp_path: Path) -> None:
    escape = tmp_path / "escaped"
    source = hostile_env(attack, escape)
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    async with reward_service(sandbox) as stub:
        await open_session(stub, "h", env_spec(source, step_timeout_s=2.0), 2)
        started = time.monotonic()
        results = (await stub.StepEpisodes(step("h", (0, 0, "a"), (1, 0, "b")), timeout=20)).results
        assert time.monotonic() - started < 5
        for result in results:
            assert result.done and result.status != common_pb2.REWARD_STATUS_OK, result
            assert result.reward == 0.0 and result.reason
        assert not escape.exists()
        opened = await open_session(stub, "fine", env_spec(SCRIPTED), 1)  # the service keeps serving
        assert opened.episodes[0].status == common_pb2.REWARD_STATUS_OK
        assert (await stub.StepEpisodes(step("fine", (0, 0, "x")), timeout=10)).results[0].reward == 0.5
