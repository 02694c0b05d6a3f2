"""Agent files in the reward service: a real RewardService, real sandboxed workers, the real `openai` SDK.

A scripted agent's calls come back as the episode protocol says: the first call and a rewritten
history as whole conversations (`segment`), a call that extends the previous one as its new
messages only, `run`'s return as the final reward; the completion the agent receives carries the
actor's text, finish reason, usage and parsed tool calls. An async agent reaches the policy through
an `openai.AsyncOpenAI()` built from the environment alone, even at import, and gets what agent
frameworks expect (sync tools in `asyncio.to_thread`, `inspect.getsource`, no tracing). A streamed
call (`stream=True` on the openai client, `Runner.run_streamed` in the OpenAI Agents SDK, LangChain's
`ChatOpenAI(streaming=True)`) gets the reply as deltas that assemble into what the actor generated, and
its episode records the turns the same episode unstreamed records. The Agents SDK's agent runs in a
service run as root and as an ordinary user. A LangGraph graph's parallel branches have their calls
generated together, each branch extending its own. Hostile agents (a hang between calls, a flood of
calls, a huge message, a call after `run` returned, network attempts, a write outside the sandbox) end
their episodes within their limits, and the service keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from fleetrl.launcher.embedded import free_port, wait_for_port
from fleetrl.proto.fleetrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from fleetrl.reward.client import environment_to_proto
from fleetrl.reward.sandbox import Outcome
from fleetrl.reward.scorer import Status
from fleetrl.reward.sessions import check_reply
from fleetrl.runtime.grpcutil import channel
from fleetrl.spec.config import EnvironmentSpec
from tests.reward.conftest import (
    ROOT,
    UID_BASE,
    descendants,
    launcher,
    reward_server,
    reward_service,
    sandbox_uid_processes,
    subreaper,
    wait_gone,
)

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


AGENTS_SDK = '''
import os

import openai
from agents import Agent, Runner, WebSearchTool, function_tool

UIDS = []


@function_tool
def calculator(expression: str) -> str:
    """Evaluate a sum of integers such as '40 + 2'."""
    UIDS.append(os.getuid())
    return str(sum(int(term) for term in expression.split("+")))


async def refusal(attempt):
    try:
        await attempt
    except openai.BadRequestError as error:
        return str(error)
    return "accepted"


async def run(client, task):
    """The SDK's own default model (no model given: OpenAIResponsesModel on a client it builds from
    OPENAI_BASE_URL), a function tool, then another agent on a new conversation."""
    solver = Agent(name="solver", instructions="Use the calculator.", tools=[calculator])
    solved = await Runner.run(solver, task["prompt"])
    checker = Agent(name="checker", instructions="Reply yes or no.")
    checked = await Runner.run(checker, f"Is {task['prompt']} = {solved.final_output}?")
    refused = [await refusal(Runner.run(checker, "again", previous_response_id=checked.last_response_id)),
               await refusal(Runner.run(checker, "again", conversation_id="conv_1")),
               await refusal(Runner.run(Agent(name="searcher", tools=[WebSearchTool()]), "look it up"))]
    return {"responses_api": float(solved.last_response_id.startswith("resp_fleetrl_")),
            "tool_uid": float(UIDS[0]) if len(UIDS) == 1 else -1.0,
            "answer": float(solved.final_output == task["answer"]), "checked": float(checked.final_output == "yes"),
            "previous_response_id": float("previous_response_id is not supported" in refused[0]),
            "conversation": float("conversation is not supported" in refused[1]),
            "hosted_tool": float("tools[0] is a 'web_search' tool" in refused[2])}
'''


STREAMED_CHAT = '''
import json

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


def received(client, messages, stream):
    """What the agent receives of one completion, assembled from the chunks when it streams."""
    if not stream:
        reply = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        choice = reply.choices[0]
        return {"role": choice.message.role, "content": choice.message.content, "finish": choice.finish_reason,
                "calls": [[c.id, c.function.name, c.function.arguments] for c in choice.message.tool_calls or []],
                "usage": [reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens]}
    chunks = [chunk for chunk in client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, stream=True, stream_options={"include_usage": True})]
    *deltas, last = chunks
    assert last.choices == [] and all(c.usage is None for c in deltas), "the usage comes last, alone"
    calls = {}
    for chunk in deltas:
        for call in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(call.index, [call.id, call.function.name, ""])
            entry[2] += call.function.arguments or ""
    return {"role": deltas[0].choices[0].delta.role,
            "content": "".join(c.choices[0].delta.content or "" for c in deltas),
            "finish": deltas[-1].choices[0].finish_reason, "calls": list(calls.values()),
            "usage": [last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens]}


def run(client, task, stream=False):
    """Two completions: the first's reply (and its tool calls' outputs) go back with a report of what the
    agent received, which the actor sees as the second call's new user message."""
    messages = [{"role": "user", "content": task["prompt"]}]
    got = received(client, messages, stream)
    calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in got["calls"]]
    messages.append({"role": "assistant", "content": got["content"], **({"tool_calls": calls} if calls else {})})
    messages += [{"role": "tool", "tool_call_id": i, "content": str(eval(json.loads(a)["expression"]))}
                 for i, _, a in got["calls"]]
    messages.append({"role": "user", "content": json.dumps(got)})
    last = received(client, messages, stream)
    return float(last["content"] == "done" and last["finish"] == "stop")
'''


def async_agent(source: str) -> str:
    """A sync agent file as its `async def run` on an `openai.AsyncOpenAI`."""
    for sync, coroutine in (("def ", "async def "), ("client.chat", "await client.chat"),
                            ("chunk for chunk in", "chunk async for chunk in"), ("= received(", "= await received(")):
        source = source.replace(sync, coroutine)
    return source


AGENTS_SDK_STREAMED = '''
import json

from agents import Agent, Runner, function_tool


@function_tool
def calculator(expression: str) -> str:
    """Evaluate a sum of integers such as '40 + 2'."""
    return str(sum(int(term) for term in expression.split("+")))


def output_of(response):
    return {"text": "".join(part.text for item in response.output if item.type == "message" for part in item.content),
            "calls": [[item.name, item.arguments] for item in response.output if item.type == "function_call"]}


async def play(agent, text, stream):
    """The run's final output, and what the agent received of each model response: its text and tool calls,
    from the stream's deltas when it streams."""
    if not stream:
        result = await Runner.run(agent, text)
        return result.final_output, [output_of(response) for response in result.raw_responses]
    result = Runner.run_streamed(agent, text)
    received, texts, calls = [], [], []
    async for event in result.stream_events():
        data = event.data if event.type == "raw_response_event" else None
        kind = getattr(data, "type", None)
        if kind == "response.output_text.delta":
            texts.append(data.delta)
        elif kind == "response.output_item.added" and data.item.type == "function_call":
            calls.append([data.item.name, ""])
        elif kind == "response.function_call_arguments.delta":
            calls[-1][1] += data.delta
        elif kind == "response.completed":
            received.append({"text": "".join(texts), "calls": calls})
            texts, calls = [], []
    return result.final_output, received


async def run(client, task, stream=False):
    """A solver with a function tool, then a checker given the solver's answer and a report of what the agent
    received (the actor sees it as the checker's user message)."""
    solver = Agent(name="solver", instructions="Use the calculator.", tools=[calculator])
    answer, received = await play(solver, task["prompt"], stream)
    checker = Agent(name="checker", instructions="Reply yes or no.")
    checked, more = await play(checker, json.dumps({"answer": answer, "received": received}), stream)
    return {"answer": float(answer == task["answer"]), "checked": float(checked == "yes"),
            "received": float(more == [{"text": "yes", "calls": []}])}
'''


CONCURRENT = '''
import asyncio

async def run(client, task, pause=False):
    async def chain(name):
        messages = [{"role": "user", "content": name + "1"}]
        first = await client.chat.completions.create(model="m", messages=messages)
        if pause:
            await asyncio.sleep(0)  # the other chains' calls come in between
        messages += [first.choices[0].message, {"role": "user", "content": name + "2"}]
        return (await client.chat.completions.create(model="m", messages=messages)).choices[0].message.content
    return float(await asyncio.gather(chain("A"), chain("B"), chain("C")) == ["a2", "b2", "c2"])
'''

LANGGRAPH_BRANCHES = '''
from typing import TypedDict

from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph


class Replies(TypedDict):
    a: str
    b: str
    both: str


def branch(name):
    """A node asking the model twice, its second call continuing the first's conversation."""
    async def ask(state):
        model = ChatOpenAI(model="policy")
        messages = [HumanMessage(name.upper() + "1")]
        messages += [await model.ainvoke(messages), HumanMessage(name.upper() + "2")]
        return {name: (await model.ainvoke(messages)).content}
    return ask


async def run(client, task):
    """START fans out to the nodes a and b, which run in parallel; join waits for both."""
    graph = StateGraph(Replies)
    graph.add_node("a", branch("a"))
    graph.add_node("b", branch("b"))
    graph.add_node("join", lambda state: {"both": state["a"] + " " + state["b"]})
    graph.add_edge(START, "a")
    graph.add_edge(START, "b")
    graph.add_edge(["a", "b"], "join")
    graph.add_edge("join", END)
    updates = [update async for update in graph.compile().astream({"a": "", "b": ""}, stream_mode="updates")]
    return {"a": float({"a": {"a": "a2"}} in updates[:2]), "b": float({"b": {"b": "b2"}} in updates[:2]),
            "join": float(updates[2:] == [{"join": {"both": "a2 b2"}}])}
'''

LANGCHAIN_STREAMED = '''
import json

import openai
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

MEDIA_TYPES = []


@tool
def calc(expression: str) -> str:
    """Evaluate a sum of integers such as '40 + 2'."""
    return str(sum(int(term) for term in expression.split("+")))


async def seen(response):
    MEDIA_TYPES.append(response.headers["content-type"].split(";")[0])


def received(reply):
    """What LangChain made of a completion: from the chunks it assembled when it streams."""
    return {"content": reply.content, "calls": [[c["id"], c["name"], c["args"]] for c in reply.tool_calls],
            "finish": reply.response_metadata.get("finish_reason"),
            "usage": [reply.usage_metadata[key] for key in ("input_tokens", "output_tokens", "total_tokens")]}


async def run(client, task, stream=False):
    """Two calls of a ChatOpenAI bound to a tool: the first's reply and its tool calls' outputs go back with a
    report of what LangChain received, which the actor sees as the second call's new user message."""
    http = openai.DefaultAsyncHttpxClient(event_hooks={"response": [seen]})
    model = ChatOpenAI(model="policy", streaming=stream, stream_usage=True, http_async_client=http)
    model = model.bind_tools([calc])
    messages = [HumanMessage(task["prompt"])]
    reply = await model.ainvoke(messages)
    messages += [reply, *(ToolMessage(calc.invoke(call["args"]), tool_call_id=call["id"]) for call in reply.tool_calls)]
    messages.append(HumanMessage(json.dumps(received(reply))))
    last = await model.ainvoke(messages)
    assert MEDIA_TYPES == ["text/event-stream" if stream else "application/json"] * 2, MEDIA_TYPES
    return float(last.content == "done" and received(last)["finish"] == "stop")
'''

CONCURRENT_FLOOD = '''
import asyncio

async def run(client, task):
    async def ask(index):
        messages = [{"role": "user", "content": str(index)}]
        return await client.chat.completions.create(model="m", messages=messages)
    await asyncio.gather(*(ask(index) for index in range(1000)))
    return 1.0
'''


BAD_RESPONSES_INPUT = {
    # what the agent sends as `input` (after instructions, a system message of the chat it stands for) -> the 400
    "image": ([{"type": "function_call", "call_id": "c", "name": "calc", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c", "output": "4"},
               {"role": "user", "content": [{"type": "input_text", "text": "see"},
                                            {"type": "input_image", "image_url": "https://example.com/x.png"}]}],
              "input[2].content[1] is a 'input_image' part"),
    "tool_output": ([{"role": "user", "content": "hi"},
                     {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}],
                    "input[1].output[0] is a 'input_file' part"),
    "role": ([{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}], "input[1].role is 'robot'"),
    "content": ([{"type": "reasoning", "summary": []}, {"role": "user", "content": 7}],
                "input[1].content is int"),
}

RESPONSES_BAD_INPUT = f"""
import openai

CASES = {BAD_RESPONSES_INPUT!r}

async def run(client, task):
    found = {{}}
    for name, (items, expected) in CASES.items():
        try:
            await client.responses.create(model="m", instructions="be brief", input=items)
            found[name] = 0.0
        except openai.BadRequestError as error:
            found[name] = float(expected in str(error))
    return found
"""


def agent_spec(source: str, step_timeout_s: float = 2.0, *, max_parallel_calls: int = 8,
               **params: object) -> reward_pb2.EnvironmentSpec:
    spec = EnvironmentSpec(kind="agent", file="agent.py", step_timeout_s=step_timeout_s, memory_limit_mb=512,
                           max_parallel_calls=max_parallel_calls, params=params)
    return environment_to_proto(spec, source.encode())


async def open_session(stub: reward_pb2_grpc.RewardServiceStub, session: str, spec: reward_pb2.EnvironmentSpec,
                       count: int = 1) -> list[reward_pb2.EpisodeResult]:
    request = reward_pb2.OpenEpisodesRequest(job_id="j", session_id=session, spec=spec, prompt="2+2",
                                             metadata_json=json.dumps({"answer": "4"}), count=count)
    return list((await stub.OpenEpisodes(request, timeout=30)).episodes)


async def act(stub: reward_pb2_grpc.RewardServiceStub, session: str, turn: int, text: str, episode: int = 0,
              **fields: object) -> reward_pb2.EpisodeResult:
    fields.setdefault("call", turn + 1)  # an agent making one call at a time: turn k answers its call k + 1
    action = reward_pb2.Action(episode=episode, turn=turn, text=text, **fields)  # type: ignore[arg-type]
    request = reward_pb2.StepEpisodesRequest(job_id="j", session_id=session, actions=[action])
    (result,) = (await stub.StepEpisodes(request, timeout=20)).results
    return result


async def answer(stub: reward_pb2_grpc.RewardServiceStub, session: str, turn: int,
                 calls: list[reward_pb2.EpisodeResult]) -> list[reward_pb2.EpisodeResult]:
    """Answer every pending call of episode 0 with its last message's text, lowercased, in one step."""
    actions = [reward_pb2.Action(episode=0, turn=turn, call=c.call, text=messages(c)[-1][1].lower()) for c in calls]
    request = reward_pb2.StepEpisodesRequest(job_id="j", session_id=session, actions=actions)
    return list((await stub.StepEpisodes(request, timeout=20)).results)


def shape(results: list[reward_pb2.EpisodeResult]) -> list[tuple[int, int, bool, list[tuple[str, str]]]]:
    """Each call's id, the call it extends, whether it opens a segment, and its messages."""
    return [(r.call, r.extends, r.segment, messages(r)) for r in results]


def messages(result: reward_pb2.EpisodeResult) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in result.observation]


async def play(stub: reward_pb2_grpc.RewardServiceStub, session: str, spec: reward_pb2.EnvironmentSpec,
               actions: list[tuple[str, dict[str, object]]]) -> list[reward_pb2.EpisodeResult]:
    """One episode: the actor's actions (text and fields) in turn; every reply, its latency cleared (what the
    actor records of a turn)."""
    (result,) = await open_session(stub, session, spec)
    results = [result]
    for turn, (text, fields) in enumerate(actions):
        assert result.status == OK and not result.done, result.reason
        result = await act(stub, session, turn, text, 0, **fields)
        results.append(result)
    for result in results:
        result.ClearField("latency_s")
    return results


async def streamed_and_not(stub: reward_pb2_grpc.RewardServiceStub, source: str,
                           actions: list[tuple[str, dict[str, object]]],
                           step_timeout_s: float = 2.0) -> list[reward_pb2.EpisodeResult]:
    """The episode of an agent file whose `run` takes `stream`, played streamed: asserts its every reply is
    the one the same episode unstreamed gets."""
    plain = await play(stub, "plain", agent_spec(source, step_timeout_s, stream=False), actions)
    streamed = await play(stub, "streamed", agent_spec(source, step_timeout_s, stream=True), actions)
    assert streamed == plain
    return streamed


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




@pytest.mark.parametrize("client", ["sync", "async"])
async def test_a_streamed_chat_completion(client: str, tmp_path: Path) -> None:
    """`chat.completions.create(stream=True, stream_options={"include_usage": True})` on the openai client
    (`OpenAI`, `AsyncOpenAI`): the chunks assemble into the completion the actor generated (role, text,
    finish reason, usage last and alone), and the episode records the turns it records unstreamed."""
    source = STREAMED_CHAT if client == "sync" else async_agent(STREAMED_CHAT)
    async with reward_service(tmp_path, **STARTS) as stub:
        first, second, last = await streamed_and_not(stub, source, [
            ("4.", {"finish_reason": "length", "prompt_tokens": 7, "completion_tokens": 5}), ("done", {})])
    assert first.segment and messages(first) == [("user", "2+2")], first.reason
    assert not second.segment and [role for role, _ in messages(second)] == ["user"], second.reason
    assert json.loads(messages(second)[0][1]) == {"role": "assistant", "content": "4.", "finish": "length",
                                                  "calls": [], "usage": [7, 5, 12]}
    assert last.status == OK and last.done and last.reward == 1.0, last.reason


async def test_streamed_tool_calls(tmp_path: Path) -> None:
    """A streamed completion whose text holds a tool call: the tool-call delta carries the call the unstreamed
    completion's `tool_calls` carry (id, name, arguments), the finish reason is `tool_calls`, and the reply
    the agent sends back with the tool's output extends the call (only the new messages go out)."""
    call = '<tool_call>{"name": "calc", "arguments": {"expression": "2+2"}}</tool_call>'
    async with reward_service(tmp_path, **STARTS) as stub:
        first, second, last = await streamed_and_not(stub, async_agent(STREAMED_CHAT), [
            (call, {"prompt_tokens": 9, "completion_tokens": 12}), ("done", {})])
    assert first.segment and [t["function"]["name"] for t in json.loads(first.tools_json)] == ["calc"]
    assert not second.segment and [role for role, _ in messages(second)] == ["tool", "user"], second.reason
    assert messages(second)[0] == ("tool", "4")
    assert json.loads(messages(second)[1][1]) == {
        "role": "assistant", "content": call, "finish": "tool_calls",
        "calls": [["call_1_0", "calc", '{"expression": "2+2"}']], "usage": [9, 12, 21]}
    assert last.status == OK and last.done and last.reward == 1.0, last.reason


async def test_an_openai_agents_sdk_agent_streamed(tmp_path: Path) -> None:
    """`Runner.run_streamed` on the SDK's default model (the Responses API, streamed): the text and function-call
    deltas it receives are the actor's text and tool call, its function tool runs, its answer is the actor's,
    and the episode records the turns `Runner.run` records."""
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    async with reward_service(tmp_path, **STARTS) as stub:
        # 10 s: a worker's first streamed response builds the openai client's models of the stream's events
        first, second, third, last = await streamed_and_not(stub, AGENTS_SDK_STREAMED,
                                                            [(call, {}), ("4", {}), ("yes", {})], step_timeout_s=10.0)
    assert first.segment and messages(first) == [("system", "Use the calculator."), ("user", "2+2")], first.reason
    assert not second.segment and messages(second) == [("tool", "4")], second.reason
    assert third.segment and [role for role, _ in messages(third)] == ["system", "user"], third.reason
    assert json.loads(messages(third)[1][1]) == {
        "answer": "4", "received": [{"text": call, "calls": [["calculator", '{"expression": "2+2"}']]},
                                    {"text": "4", "calls": []}]}
    assert last.status == OK and last.done, last.reason
    assert dict(last.components) == {"answer": 1.0, "checked": 1.0, "received": 1.0}


@contextlib.asynccontextmanager
async def reward_process(mode: str) -> AsyncIterator[tuple[reward_pb2_grpc.RewardServiceStub, int]]:
    """A reward service process run as root or as an ordinary user (`launcher`, as the hostile tests run it):
    a stub, and the service's uid. Asserts it exits cleanly and leaves no process behind."""
    prefix, uid, gid = launcher(mode)
    run_dir = Path(tempfile.mkdtemp(prefix="fleetrl-agents-"))
    os.chown(run_dir, uid, gid)
    port = free_port()
    argv = [*prefix, sys.executable, "-m", "fleetrl.services.reward", "--listen", f"127.0.0.1:{port}",
            "--set", f"sandbox_uid_base={UID_BASE}", "--set", f"run_dir={run_dir}",
            *(arg for key, value in STARTS.items() for arg in ("--set", f"{key}={value:g}"))]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(run_dir), "PYTHONPATH": str(ROOT)}
    before = set(descendants())  # servers that other tests' session fixtures keep running
    with subreaper(), tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            await asyncio.to_thread(wait_for_port, "127.0.0.1", port, 60.0, proc)
            async with channel(f"127.0.0.1:{port}") as chan:
                yield reward_pb2_grpc.RewardServiceStub(chan), uid
        finally:
            proc.terminate()
            await asyncio.to_thread(proc.wait, 30)
        left = wait_gone(lambda: sorted(set(descendants()) - before) + sandbox_uid_processes(), within_s=10.0)
        log.seek(0)
        output = log.read().decode(errors="replace")
    shutil.rmtree(run_dir)
    assert proc.returncode == 0, output[-3000:]
    assert left == [], f"processes left behind: {left}"


@pytest.mark.parametrize("mode", ["root", "user"])
async def test_an_openai_agents_sdk_agent_on_its_default_model(mode: str) -> None:
    """The OpenAI Agents SDK (`Agent` + `Runner.run`, no model given) reaches the policy through the Responses API
    with a client built from the environment, in a service run as root and as an ordinary user. Its function
    tool runs in the sandbox (as the worker's sandbox uid under a root service, as the service's own uid under
    an ordinary user's), and its output is the next call's only new message (the SDK sends the whole input
    back: the call extends the one before); another agent's run starts a new segment; the reward comes back.
    What the worker refuses, the SDK surfaces as the 400 naming it: `previous_response_id`,
    `conversation_id`, a hosted tool."""
    async with reward_process(mode) as (stub, service_uid):
        (first,) = await open_session(stub, "a", agent_spec(AGENTS_SDK))
        assert first.status == OK and first.segment, first.reason
        assert messages(first) == [("system", "Use the calculator."), ("user", "2+2")]
        assert [t["function"]["name"] for t in json.loads(first.tools_json)] == ["calculator"]
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
        second = await act(stub, "a", 0, call)
        assert second.status == OK and not second.segment, second.reason
        assert messages(second) == [("tool", "4")]  # the tool ran in the sandbox; only its output is new
        third = await act(stub, "a", 1, "4")
        assert third.status == OK and third.segment, third.reason
        assert messages(third) == [("system", "Reply yes or no."), ("user", "Is 2+2 = 4?")]
        assert json.loads(third.tools_json or "[]") == []
        last = await act(stub, "a", 2, "yes")
        assert last.status == OK and last.done, last.reason
        components = dict(last.components)
        uid = components.pop("tool_uid")
        if mode == "root":
            assert UID_BASE <= uid < UID_BASE + 60_000  # the tool ran once, as the worker's sandbox uid
        else:
            assert uid == service_uid  # an ordinary user's service has no other uid to give its workers
        assert components == {"responses_api": 1.0, "answer": 1.0, "checked": 1.0, "previous_response_id": 1.0,
                              "conversation": 1.0, "hosted_tool": 1.0}
        assert last.reward == uid + 6.0


@pytest.mark.parametrize("pause", [False, True])
async def test_concurrent_calls_are_served_together(pause: bool, tmp_path: Path) -> None:
    """Three chains of calls under `asyncio.gather` reach the actor together: their first calls are the open's
    three results (segments), their second calls one step's three results, each extending its own chain's
    first call (only the new message goes out), whether or not the chains interleave (`asyncio.sleep(0)`)."""
    async with reward_service(tmp_path, **STARTS) as stub:
        first = await open_session(stub, "c", agent_spec(CONCURRENT, pause=pause))
        assert all(r.status == OK and not r.done for r in first), [r.reason for r in first]
        assert shape(first) == [(1, 0, True, [("user", "A1")]), (2, 0, True, [("user", "B1")]),
                                (3, 0, True, [("user", "C1")])]
        second = await answer(stub, "c", 0, first)
        assert shape(second) == [(4, 1, False, [("user", "A2")]), (5, 2, False, [("user", "B2")]),
                                 (6, 3, False, [("user", "C2")])]
        (last,) = await answer(stub, "c", 1, second)
        assert last.done and last.status == OK and last.reward == 1.0, last.reason


async def test_concurrent_calls_in_a_service_run_as_an_ordinary_user() -> None:
    """The same three interleaving chains, with the reward service run as an ordinary user (the sandbox then
    cannot use root's means): their calls still reach the actor together and extend their own chains."""
    async with reward_process("user") as (stub, _):
        first = await open_session(stub, "u", agent_spec(CONCURRENT, pause=True))
        assert shape(first) == [(1, 0, True, [("user", "A1")]), (2, 0, True, [("user", "B1")]),
                                (3, 0, True, [("user", "C1")])], [r.reason for r in first]
        second = await answer(stub, "u", 0, first)
        assert shape(second) == [(4, 1, False, [("user", "A2")]), (5, 2, False, [("user", "B2")]),
                                 (6, 3, False, [("user", "C2")])]
        (last,) = await answer(stub, "u", 1, second)
        assert last.done and last.status == OK and last.reward == 1.0, last.reason


async def test_concurrent_calls_past_max_parallel_calls_wait_their_turn(tmp_path: Path) -> None:
    """With `max_parallel_calls` 2, the three chains' calls go two by two in the order they were made, and each
    second call still extends its own chain; an action missing for a pending call is refused, naming both."""
    async with reward_service(tmp_path, **STARTS) as stub:
        first = await open_session(stub, "p", agent_spec(CONCURRENT, max_parallel_calls=2))
        assert shape(first) == [(1, 0, True, [("user", "A1")]), (2, 0, True, [("user", "B1")])]
        half = reward_pb2.StepEpisodesRequest(job_id="j", session_id="p", actions=[
            reward_pb2.Action(episode=0, turn=0, call=1, text="a1")])
        with pytest.raises(grpc.aio.AioRpcError, match=r"calls \[1, 2\] pending, the actions answer \[1\]"):
            await stub.StepEpisodes(half, timeout=20)
        second = await answer(stub, "p", 0, first)
        assert shape(second) == [(3, 0, True, [("user", "C1")]), (4, 1, False, [("user", "A2")])]
        third = await answer(stub, "p", 1, second)
        assert shape(third) == [(5, 2, False, [("user", "B2")]), (6, 3, False, [("user", "C2")])]
        (last,) = await answer(stub, "p", 2, third)
        assert last.done and last.reward == 1.0, last.reason


async def test_a_langgraph_graph_s_parallel_branches_are_served_together(tmp_path: Path) -> None:
    """A LangGraph `StateGraph` fanning out from START to two nodes that each call `ChatOpenAI` twice, run by
    `astream`: the open returns both branches' first calls (two results, two segments), one step answers them by
    id, and the next step returns both second calls, each extending its own branch's first; the graph's updates
    hold each branch's reply and the join of both."""
    async with reward_service(tmp_path, **STARTS) as stub:
        first = await open_session(stub, "g", agent_spec(LANGGRAPH_BRANCHES))
        assert all(r.status == OK and not r.done for r in first), [r.reason for r in first]
        assert shape(first) == [(1, 0, True, [("user", "A1")]), (2, 0, True, [("user", "B1")])]
        second = await answer(stub, "g", 0, first)
        assert shape(second) == [(3, 1, False, [("user", "A2")]), (4, 2, False, [("user", "B2")])]
        (last,) = await answer(stub, "g", 1, second)
        assert last.status == OK and last.done, last.reason
        assert dict(last.components) == {"a": 1.0, "b": 1.0, "join": 1.0}


async def test_a_streamed_langchain_chat_openai(tmp_path: Path) -> None:
    """LangChain's `ChatOpenAI(streaming=True)` (what LangGraph nodes call) gets server-sent events and assembles
    from them the reply it gets unstreamed: text, tool call (id, name, arguments), finish reason and usage; the
    reply sent back with the tool's output extends the call, and the episode records the turns it records
    unstreamed."""
    call = '<tool_call>{"name": "calc", "arguments": {"expression": "2+2"}}</tool_call>'
    async with reward_service(tmp_path, **STARTS) as stub:
        first, second, last = await streamed_and_not(stub, LANGCHAIN_STREAMED, [
            (call, {"prompt_tokens": 9, "completion_tokens": 12}), ("done", {})])
    assert first.segment and [t["function"]["name"] for t in json.loads(first.tools_json)] == ["calc"], first.reason
    assert not second.segment and [role for role, _ in messages(second)] == ["tool", "user"], second.reason
    assert messages(second)[0] == ("tool", "4")
    assert json.loads(messages(second)[1][1]) == {
        "content": call, "calls": [["call_1_0", "calc", {"expression": "2+2"}]], "finish": "tool_calls",
        "usage": [9, 12, 21]}
    assert last.status == OK and last.done and last.reward == 1.0, last.reason


async def test_a_flood_of_concurrent_calls_is_served_max_parallel_calls_at_a_time(tmp_path: Path) -> None:
    """1,000 calls at once: each step carries 8 of them (the default `max_parallel_calls`); closing the session
    kills the worker, whose `run` still waits inside calls, and the service keeps serving."""
    async with reward_server(tmp_path, workers_per_pool=1, **STARTS) as (stub, service):
        calls = await open_session(stub, "f", agent_spec(CONCURRENT_FLOOD, step_timeout_s=15.0))  # 1,000 requests
        for turn in range(3):
            assert [c.call for c in calls] == list(range(8 * turn + 1, 8 * turn + 9)), [c.reason for c in calls]
            calls = await answer(stub, "f", turn, calls)
        await stub.CloseEpisodes(reward_pb2.CloseEpisodesRequest(job_id="j", session_id="f"), timeout=10)
        restarts = "fleetrl_reward_worker_restarts_total"
        assert service.scorer.metrics.registry.get_sample_value(restarts, {"reason": "cancelled"}) == 1.0
        (fine,) = await open_session(stub, "fine", agent_spec(SCRIPTED))
        assert fine.status == OK and fine.segment, fine.reason


FORGED_CALLS = {
    # a worker's reply is user code's to forge: what the service refuses in one, and why
    "too_many": ([{"call": i, "segment": True} for i in range(1, 4)], "1 to 2 pending calls"),
    "none": ([], "1 to 2 pending calls"),
    "same_id": ([{"call": 1, "segment": True}, {"call": 1, "segment": True}], "distinct ids"),
    "id_zero": ([{"call": 0, "segment": True}], "an id >= 1"),
    "bool_id": ([{"call": True, "segment": True}], "ints in [0, 2**32)"),
    "segment_and_extends": ([{"call": 2, "segment": True, "extends": 1}], "or opens a segment"),
    "neither": ([{"call": 2}], "or opens a segment"),
    "not_a_list": ({"call": 2}, "1 to 2 pending calls"),
}


@pytest.mark.parametrize("case", sorted(FORGED_CALLS))
def test_forged_pending_calls_end_the_episode(case: str) -> None:
    calls, reason = FORGED_CALLS[case]
    (result,) = check_reply(3, Outcome("reply", {"calls": calls, "reward": 0.0, "done": False}), max_calls=2)
    assert (result.episode, result.done, result.status) == (3, True, Status.ERROR) and reason in result.reason


def test_checked_pending_calls_keep_their_ids_and_the_call_they_extend() -> None:
    reply = {"calls": [{"call": 4, "extends": 1, "observation": "x"}, {"call": 5, "segment": True}], "reward": 0.5,
             "done": False}
    results = check_reply(0, Outcome("reply", reply), max_calls=2)
    assert [(r.call, r.extends, r.segment, r.reward, r.done) for r in results] == [
        (4, 1, False, 0.5, False), (5, 0, True, 0.0, False)]
    # an environment's reply is one result, whatever it holds
    (env,) = check_reply(0, Outcome("reply", {**reply, "observation": "y"}))
    assert (env.call, env.observation) == (0, [{"role": "user", "content": "y"}])


async def test_a_bad_responses_input_is_named_as_sent(tmp_path: Path) -> None:
    """A Responses request's bad part, role or content is named by its place in the request's `input` and its
    field there (`input[2].content[1]`, `input[1].output[0]`), not by the chat message it would have become
    (instructions, a function call's assistant message and dropped reasoning items shift those)."""
    async with reward_service(tmp_path, **STARTS) as stub:
        (result,) = await open_session(stub, "b", agent_spec(RESPONSES_BAD_INPUT))
        assert result.status == OK and result.done, result.reason
        assert dict(result.components) == dict.fromkeys(BAD_RESPONSES_INPUT, 1.0)


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
