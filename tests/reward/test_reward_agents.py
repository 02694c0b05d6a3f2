"""Agent files in the reward service: a real RewardService, real sandboxed workers, the real `openai` SDK.

A scripted agent's calls come back as the episode protocol says: the first call and a rewritten
history as whole conversations (`segment`), a call that extends the previous one as its new
messages only, `run`'s return as the final reward; the completion the agent receives carries the
actor's text, finish reason, usage and parsed tool calls. An async agent reaches the policy through
an `openai.AsyncOpenAI()` built from the environment alone, even at import, and gets what agent
frameworks expect (sync tools in `asyncio.to_thread`, `inspect.getsource`, no tracing). Hostile
agents (a hang between calls, a flood of calls, a huge message, a call after `run` returned, network
attempts, a write outside the sandbox) end their episodes within their limits, and the service keeps
serving.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from fleetrl.proto.fleetrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from fleetrl.reward.client import environment_to_proto
from fleetrl.spec.config import EnvironmentSpec
from tests.reward.conftest import reward_server, reward_service

OK = common_pb2.REWARD_STATUS_OK
STARTS = {"worker_start_timeout_s": 20.0, "worker_load_timeout_s": 20.0}
"""An agent worker imports the openai SDK as it starts: the reward tests' 3 s is too short on a loaded machine."""

SCRIPTED = '''
def run(client, task, bonus=0.0):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Q: " + task["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
    messages += [first.choices[0].message, {"role": "user", "content": "sure?"}]
    second = client.chat.completions.create(model="policy", messages=messages)
    summary = [{"role": "user", "content": "summary: " + second.choices[0].message.content}]
    third = client.chat.completions.create(model="policy", messages=summary)
    usage = first.usage
    return (bonus + (third.choices[0].message.content == "yes") + 10 * usage.prompt_tokens
            + 100 * usage.completion_tokens + 1000 * (first.choices[0].finish_reason == "length"))
'''

ASYNC_TOOLS = '''
import openai

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]

async def run(client, task):
    assert isinstance(client, openai.AsyncOpenAI)
    other = openai.AsyncOpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY point at the policy
    reply = await other.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}],
                                                tools=TOOLS)
    calls = reply.choices[0].message.tool_calls or []
    arguments = json.loads(calls[0].function.arguments) if calls else {}
    return {"called": float(len(calls)), "right": float(arguments.get("expression") == "2+2"),
            "finish": float(reply.choices[0].finish_reason == "tool_calls")}
'''.replace("import openai", "import json\nimport openai")


FRAMEWORK_HABITS = '''
import asyncio, inspect, os
import openai

CLIENT = openai.AsyncOpenAI()  # at import, from the environment

def add(expression):
    """A sync tool, which frameworks run in the event loop's default executor."""
    return str(sum(int(term) for term in expression.split("+")))

async def run(client, task):
    first = await CLIENT.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])
    both = await asyncio.gather(asyncio.to_thread(add, first.choices[0].message.content), asyncio.to_thread(add, "1+1"))
    last = await CLIENT.chat.completions.create(model="m", messages=[{"role": "user", "content": " ".join(both)}])
    return {"tools": float(both == ["4", "2"]), "source": float("frameworks run" in inspect.getsource(add)),
            "no_tracing": float(os.environ["OPENAI_AGENTS_DISABLE_TRACING"] == "1"),
            "last": float(last.choices[0].message.content == "ok")}
'''


RESPONSES_API = '''
import json
import openai

TOOLS = [{"type": "function", "name": "calc", "description": "evaluate",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}]

async def run(client, task):
    """The Responses API as the OpenAI Agents SDK's default model drives it: the whole input every call."""
    items = [{"role": "user", "content": task["prompt"]}]
    first = await client.responses.create(model="m", instructions="use calc", input=items, tools=TOOLS)
    calls = [item for item in first.output if item.type == "function_call"]
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items += [{"type": "function_call_output", "call_id": c.call_id,
               "output": str(eval(json.loads(c.arguments)["expression"]))} for c in calls]
    second = await client.responses.create(model="m", instructions="use calc", input=items, tools=TOOLS,
                                           max_output_tokens=3)
    try:
        await client.responses.create(model="m", input="again", previous_response_id=second.id)
        stateful = "accepted"
    except openai.BadRequestError as error:
        stateful = str(error)
    return {"called": float(len(calls) == 1 and calls[0].name == "calc"),
            "answer": float(second.output_text == "4"), "usage": float(second.usage.output_tokens),
            "incomplete": float(second.status == "incomplete"),
            "refused": float("previous_response_id is not supported" in stateful)}
'''


def agent_spec(source: str, step_timeout_s: float = 2.0, **params: object) -> reward_pb2.EnvironmentSpec:
    spec = EnvironmentSpec(kind="agent", file="agent.py", step_timeout_s=step_timeout_s, memory_limit_mb=512,
                           params=params)
    return environment_to_proto(spec, source.encode())


async def open_session(stub: reward_pb2_grpc.RewardServiceStub, session: str, spec: reward_pb2.EnvironmentSpec,
                       count: int = 1) -> list[reward_pb2.EpisodeResult]:
    request = reward_pb2.OpenEpisodesRequest(job_id="j", session_id=session, spec=spec, prompt="2+2",
                                             metadata_json=json.dumps({"answer": "4"}), count=count)
    return list((await stub.OpenEpisodes(request, timeout=30)).episodes)


async def act(stub: reward_pb2_grpc.RewardServiceStub, session: str, turn: int, text: str, episode: int = 0,
              **fields: object) -> reward_pb2.EpisodeResult:
    action = reward_pb2.Action(episode=episode, turn=turn, text=text, **fields)  # type: ignore[arg-type]
    request = reward_pb2.StepEpisodesRequest(job_id="j", session_id=session, actions=[action])
    (result,) = (await stub.StepEpisodes(request, timeout=20)).results
    return result


def messages(result: reward_pb2.EpisodeResult) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in result.observation]


async def test_scripted_agent_calls_are_turns(tmp_path: Path) -> None:
    async with reward_service(tmp_path, **STARTS) as stub:
        (first,) = await open_session(stub, "s", agent_spec(SCRIPTED, bonus=0.5))
        assert first.status == OK and not first.done, first.reason
        assert first.segment and first.max_new_tokens == 5
        assert messages(first) == [("system", "be brief"), ("user", "Q: 2+2")]

        second = await act(stub, "s", 0, "4.", finish_reason="length", prompt_tokens=7, completion_tokens=5)
        assert second.status == OK and not second.segment and second.max_new_tokens == 0
        assert messages(second) == [("user", "sure?")]  # extends the call before: only the new message

        third = await act(stub, "s", 1, "yes, 4")
        assert third.segment and messages(third) == [("user", "summary: yes, 4")]  # a rewritten history

        last = await act(stub, "s", 2, "yes")
        assert last.status == OK and last.done, last.reason
        assert last.reward == 0.5 + 1 + 70 + 500 + 1000  # usage and finish reason as the actor reported them


async def test_async_agent_with_tools_through_a_default_client(tmp_path: Path) -> None:
    async with reward_service(tmp_path, **STARTS) as stub:
        (first,) = await open_session(stub, "t", agent_spec(ASYNC_TOOLS))
        assert first.status == OK and first.segment, first.reason
        assert [t["function"]["name"] for t in json.loads(first.tools_json)] == ["calc"]
        call = '<tool_call>{"name": "calc", "arguments": {"expression": "2+2"}}</tool_call>'
        last = await act(stub, "t", 0, call)
        assert last.status == OK and last.done, last.reason
        assert dict(last.components) == {"called": 1.0, "right": 1.0, "finish": 1.0} and last.reward == 3.0


async def test_an_agent_on_the_responses_api(tmp_path: Path) -> None:
    """`client.responses.create` (the OpenAI Agents SDK's default model): instructions and function tools
    reach the actor as a chat; the tool call comes back as a function_call item; the next call, the whole
    input with the output items and the tool's output, extends the first (only the tool message is new:
    one training sample); a call naming previous_response_id is refused with a 400 that says why."""
    async with reward_service(tmp_path, **STARTS) as stub:
        (first,) = await open_session(stub, "r", agent_spec(RESPONSES_API))
        assert first.status == OK and first.segment, first.reason
        assert messages(first) == [("system", "use calc"), ("user", "2+2")]
        assert [t["function"]["name"] for t in json.loads(first.tools_json)] == ["calc"]
        call = '<tool_call>{"name": "calc", "arguments": {"expression": "2+2"}}</tool_call>'
        second = await act(stub, "r", 0, call)
        assert second.status == OK and not second.segment and second.max_new_tokens == 3, second.reason
        assert messages(second) == [("tool", "4")]
        last = await act(stub, "r", 1, "4", finish_reason="length", completion_tokens=3)
        assert last.status == OK and last.done, last.reason
        assert dict(last.components) == {"called": 1.0, "answer": 1.0, "usage": 3.0, "incomplete": 1.0,
                                         "refused": 1.0}


async def test_agent_files_get_what_frameworks_expect(tmp_path: Path) -> None:
    """A client built at import finds the policy in the environment; sync tools in `asyncio.to_thread`, two at
    once, leave no thread running (the default executor runs them inline); `inspect.getsource` reads the
    file (smolagents' @tool does); the OpenAI Agents SDK's tracing thread stays off."""
    async with reward_service(tmp_path, **STARTS) as stub:
        (first,) = await open_session(stub, "f", agent_spec(FRAMEWORK_HABITS))
        assert first.status == OK and messages(first) == [("user", "2+2")], first.reason
        second = await act(stub, "f", 0, "2+2")
        assert second.status == OK and second.segment and messages(second) == [("user", "4 2")], second.reason
        last = await act(stub, "f", 1, "ok")
        assert last.status == OK and last.done, last.reason
        assert dict(last.components) == {"tools": 1.0, "source": 1.0, "no_tracing": 1.0, "last": 1.0}


AGENT_RUNS = {
    "no_run": "x = 1",
    "bad_return": "def run(client, task):\n    return float('nan')",
    "answer": "def run(client, task):\n    return 'the answer is 4'",
}


@pytest.mark.parametrize("case", sorted(AGENT_RUNS))
async def test_agent_files_that_end_at_once(case: str, tmp_path: Path) -> None:
    async with reward_service(tmp_path, **STARTS) as stub:
        if case == "no_run":
            request = reward_pb2.OpenEpisodesRequest(job_id="j", session_id="n", spec=agent_spec(AGENT_RUNS[case]),
                                                     prompt="p", count=1)
            with pytest.raises(Exception, match="does not define `run"):
                await stub.OpenEpisodes(request, timeout=30)
            return
        (result,) = await open_session(stub, "n", agent_spec(AGENT_RUNS[case]))
        assert result.done
        if case == "answer":
            assert result.status == OK and result.answer == "the answer is 4" and result.reward == 0.0
        else:
            assert result.status != OK and "finite number" in result.reason


HOSTILE = {
    # after its first completion, the agent never calls again nor returns
    "hang_between_calls": "    while True:\n        pass",
    # more calls than any episode allows: the actor stops stepping and closes the session
    "flood": "    while True:\n        ask(client, 'again')",
    # a message larger than a worker's reply may be
    "huge_message": "    ask(client, 'x' * (4 << 20))",
    # a thread calling the policy after run returned
    "call_after_return": ("    threading.Thread(target=lambda: (time.sleep(0.2), ask(client, 'late'))).start()\n"
                          "    return 1.0"),
    "socket": "    socket.create_connection(('127.0.0.1', 22), timeout=1)\n    return 1.0",
    "urllib": "    urllib.request.urlopen('http://127.0.0.1:22', timeout=1)\n    return 1.0",
    "write_outside": "    open(ESCAPE, 'w').write('x')\n    return 1.0",
}


REASONS = {"hang_between_calls": "timed out after 2s", "huge_message": "exceeds 1048576",
           "call_after_return": "left 1 thread(s) or process(es) running",
           "socket": "sandbox: socket.getaddrinfo is not allowed", "urllib": "sandbox: urllib.Request is not allowed",
           "write_outside": "outside the temp dir is not allowed"}


def hostile_agent(attack: str, escape: Path) -> str:
    return (f"import socket, threading, time, urllib.request\nESCAPE = {str(escape)!r}\n\n"
            "def ask(client, text):\n"
            "    return client.chat.completions.create(model='p', messages=[{'role': 'user', 'content': text}])\n\n"
            f"def run(client, task):\n    ask(client, 'first')\n{HOSTILE[attack]}\n")


@pytest.mark.parametrize("attack", sorted(HOSTILE))
async def test_hostile_agents_are_contained(attack: str, tmp_path: Path) -> None:
    escape, sandbox = tmp_path / "escaped", tmp_path / "sandbox"
    sandbox.mkdir()
    async with reward_server(sandbox, workers_per_pool=1, **STARTS) as (stub, service):
        (first,) = await open_session(stub, "h", agent_spec(hostile_agent(attack, escape), step_timeout_s=2.0))
        assert first.status == OK and messages(first) == [("user", "first")], first.reason
        started = time.monotonic()
        result = await act(stub, "h", 0, "hello")
        if attack == "flood":
            for turn in range(1, 4):  # every call is one more turn, until the actor gives up on the episode
                assert result.status == OK and not result.done and messages(result) == [("user", "again")]
                result = await act(stub, "h", turn, "hello")
            await stub.CloseEpisodes(reward_pb2.CloseEpisodesRequest(job_id="j", session_id="h"), timeout=10)
            # its run still waits inside a call: the worker is killed, not given to another episode
            restarts = "fleetrl_reward_worker_restarts_total"
            assert service.scorer.metrics.registry.get_sample_value(restarts, {"reason": "cancelled"}) == 1.0
        else:
            assert result.done and result.status != OK and result.reward == 0.0, result
            assert REASONS[attack] in result.reason, result.reason
        assert time.monotonic() - started < 8
        assert not escape.exists()
        (fine,) = await open_session(stub, "fine", agent_spec(SCRIPTED))  # the service keeps serving
        assert fine.status == OK and fine.segment, fine.reason
