"""The tool-use helper of environment files: the tag format, both call forms, errors the model can read,
and a ToolEnv run in the reward service's sandbox, where its file imports it from `fleetrl.env`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetrl.env import Observation, ToolEnv
from fleetrl.env.tools import ToolCall, describe_tools, parse_tool_calls, run_tool_call, tool_schemas
from fleetrl.proto.fleetrl.v1 import common_pb2, reward_pb2
from tests.reward.conftest import reward_service
from tests.reward.test_reward_episodes import env_spec, open_session, step


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return str(eval(expression, {"__builtins__": {}}))


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_parse_both_forms_and_errors() -> None:
    text = ('First <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call> then '
            "<tool_call> calc(12 * 7) </tool_call> and <tool_call>{oops</tool_call> <tool_call>add(1)</tool_call>")
    calls = parse_tool_calls(text, [calc, add])
    assert calls[:2] == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("calc", {"expression": "12 * 7"})]
    assert "not JSON" in calls[2].error and "exactly one parameter" in calls[3].error
    assert [run_tool_call(c, [calc, add]) for c in calls[:2]] == ["5", "84"]
    assert run_tool_call(ToolCall("nope"), [calc]) == "error: no tool named 'nope' (tools: calc)"
    assert run_tool_call(ToolCall("calc", {"expression": "1/0"}), [calc]).startswith("error: ZeroDivisionError")
    assert parse_tool_calls("no tools here", [calc]) == []
    prompt = describe_tools([calc, add])
    assert "<tool_call>" in prompt and "- calc(expression: str) -> str: Evaluate an arithmetic expression." in prompt


def test_untagged_short_calls_only_when_asked() -> None:
    text = "To find it, use calculator.calc(83 * (57 + 11)) then add(2, 3) and recalc(1); calc(7 * "
    assert parse_tool_calls(text, [calc, add]) == []  # the tag format alone by default
    assert parse_tool_calls(text, [calc, add], untagged=True) == [ToolCall("calc", {"expression": "83 * (57 + 11)"})]
    tagged = "<tool_call>calc(1 + 1)</tool_call> and calc(2 + 2)"  # tags present: only they count
    assert parse_tool_calls(tagged, [calc], untagged=True) == [ToolCall("calc", {"expression": "1 + 1"})]


def test_the_formats_chat_templates_use_parse_too() -> None:
    """Hermes/Qwen tags with "parameters", and Llama 3.1's bare JSON call (only when it is the whole action)."""
    tagged = '<tool_call>{"name": "add", "parameters": {"a": 1, "b": 2}}</tool_call>'
    assert parse_tool_calls(tagged, [add]) == [ToolCall("add", {"a": 1, "b": 2})]
    assert parse_tool_calls(' {"name": "calc", "parameters": {"expression": "6 * 7"}}\n', [calc]) == \
        [ToolCall("calc", {"expression": "6 * 7"})]
    assert parse_tool_calls('{"name": "calc"}', [calc]) == []  # no arguments: an answer, not a call
    assert parse_tool_calls('The call is {"name": "calc", "arguments": {}} here', [calc]) == []
    bad = parse_tool_calls('{"name": "add", "arguments": [1, 2]}', [add])
    assert bad == [ToolCall("add", error="arguments must be an object")]


def test_tool_schemas_are_what_chat_templates_take() -> None:
    def search(query: str, limit: int = 5, exact=False) -> list:
        """Search the notes.

        More text the schema leaves out."""
        return []

    assert tool_schemas([add, search]) == [
        {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"]}}},
        {"type": "function", "function": {"name": "search", "description": "Search the notes.", "parameters": {
            "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}, "exact": {}},
            "required": ["query"]}}},
    ]


CALCULATOR_ENV = '''
from fleetrl.env import ToolEnv

def calc(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return str(eval(expression, {"__builtins__": {}}))

class Env(ToolEnv):
    tools = [calc]

    def reset(self):
        return [{"role": "system", "content": self.system_prompt()}, {"role": "user", "content": self.task["prompt"]}]

    def finish(self, action):
        return None, float(action.strip() == self.task["answer"]), True
'''


async def test_tool_env_runs_in_the_sandbox(tmp_path: Path) -> None:
    async with reward_service(tmp_path) as stub:
        opened = await open_session(stub, "t", env_spec(CALCULATOR_ENV), 1)
        first = opened.episodes[0]
        assert first.status == common_pb2.REWARD_STATUS_OK, first.reason
        assert [m.role for m in first.observation] == ["system", "user"] and "calc(" in first.observation[0].content
        assert json.loads(first.tools_json) == tool_schemas([calc])  # for a chat template with a tool format
        called = (await stub.StepEpisodes(step("t", (0, 0, "<tool_call>calc(2 + 2)</tool_call>")), timeout=10)).results
        assert [(m.role, m.content) for m in called[0].observation] == [("tool", "4")] and not called[0].done
        final = (await stub.StepEpisodes(step("t", (0, 1, "4")), timeout=10)).results[0]
        assert (final.reward, final.done) == (1.0, True)  # open_session's task has answer "4"


async def test_an_env_tools_import_still_loads_with_a_deprecation_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    legacy = CALCULATOR_ENV.replace("from fleetrl.env import ToolEnv", "from env_tools import ToolEnv")
    async with reward_service(tmp_path) as stub:
        opened = await open_session(stub, "legacy", env_spec(legacy), 1)
        assert opened.episodes[0].status == common_pb2.REWARD_STATUS_OK, opened.episodes[0].reason
    warned = [r.getMessage() for r in caplog.records if "env_tools is deprecated" in r.getMessage()]
    assert warned and "from fleetrl.env import ToolEnv" in warned[0], caplog.text[-2000:]


TYPED_ENV = '''
from fleetrl.env import Env, Observation, StepResult

class Echo(Env):
    def reset(self) -> Observation:
        return [{"role": "user", "content": self.task["prompt"]}]

    def step(self, action: str) -> StepResult:
        return None, float(action == self.params["word"]), True
'''


async def test_a_subclass_of_the_typed_base_is_the_environment(tmp_path: Path) -> None:
    async with reward_service(tmp_path) as stub:
        opened = await open_session(stub, "typed", env_spec(TYPED_ENV, word="hi"), 1)
        assert opened.episodes[0].status == common_pb2.REWARD_STATUS_OK, opened.episodes[0].reason
        assert opened.episodes[0].observation[0].content == "2+2"
        (done,) = (await stub.StepEpisodes(step("typed", (0, 0, "hi")), timeout=10)).results
        assert done.done and done.reward == 1.0
        missing = TYPED_ENV.replace("    def step(self, action: str) -> StepResult:\n"
                                    "        return None, float(action == self.params[\"word\"]), True\n", "")
        verdict = await stub.Validate(reward_pb2.ValidateRequest(environment=env_spec(missing)), timeout=20)
        assert not verdict.ok and "class Echo does not define step" in verdict.reason, verdict.reason


def test_the_typed_bases_refuse_an_incomplete_environment() -> None:
    class NoFinish(ToolEnv):
        def reset(self) -> Observation:
            return "go"

    with pytest.raises(TypeError, match="finish"):
        NoFinish({"prompt": "p"})  # type: ignore[abstract]
