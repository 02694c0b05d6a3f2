"""Tool use for environment files: declare Python functions as tools, parse the model's calls, run them.

An environment file imports it from `fleetrl.env` (`from fleetrl.env import ToolEnv, describe_tools`);
`import env_tools`, the name it had before, still works for one release with a DeprecationWarning.
Its tools run where the environment runs: in the reward service's sandbox. The tag format, which
`describe_tools` explains to the model in a system prompt, is the Hermes / Qwen one that many chat templates use:

    <tool_call>{"name": "calc", "arguments": {"expression": "12 * 7"}}</tool_call>

and, for a tool with one string parameter, a short form small models follow more easily:

    <tool_call>calc(12 * 7)</tool_call>

Each call's output comes back to the model as a message of role "tool" (the chat template renders
it). Where a chat template has a tool-call format of its own, the model's calls in it parse too: the
Hermes/Qwen tag above with `"parameters"` for `"arguments"`, and, with no tag in the action, a bare
JSON object `{"name": ..., "parameters" | "arguments": {...}}` (Llama 3.1's). A `ToolEnv` also hands
its tools' JSON schemas (`tool_schemas`) to the actor, which renders them with the tokenizer's chat
template where that template takes `tools` (e.g. Qwen2.5's, SmolLM3's); SmolLM2's does not, and
`describe_tools`' system prompt is what tells its model about them.

Untagged calls (`parse_tool_calls(..., untagged=True)`, `ToolEnv.untagged_calls`): with no tag in
the action, a one-parameter tool's short form written in the text, `calc(83 * 57)` (also
`calculator.calc(...)`), is a call too. Small models drop the tags: SmolLM2-135M-Instruct, given
calculator_agent's system prompt, wrote `calculator.calc(83 * 57 + 11 * 37)` but never a tagged
call in 256 episodes. Off by default: a prose answer that mentions `f(x)` would become a call.

`ToolEnv` is an `Env` base class: its `step` runs the calls an action makes and returns their
outputs, or, when the action calls no tool, hands it to the subclass's `finish(action)`.
Stdlib only: it is imported inside the worker.
"""

from __future__ import annotations

import abc
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleetrl.env.base import Env, Message, StepResult

TAG = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
SHORT = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\((.*)\)\s*$", re.DOTALL)
MAX_OUTPUT_CHARS = 4000
"""A tool's output is cut to this many characters before it reaches the model."""

Tool = Callable[..., Any]


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and arguments, or why the call could not be parsed."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def _one_string_parameter(tool: Tool) -> str | None:
    parameters = list(inspect.signature(tool).parameters.values())
    return parameters[0].name if len(parameters) == 1 else None


def parse_tool_calls(text: str, tools: list[Tool] | None = None, *, untagged: bool = False) -> list[ToolCall]:
    """Every <tool_call> of text, in order. The short form `name(text)` needs `tools` to know the
    parameter's name (the tool must have exactly one parameter). With no tag: a bare JSON call, or,
    when `untagged`, the short forms of `tools` written in the text (module docstring)."""
    by_name = {t.__name__: t for t in tools or []}
    bodies = TAG.findall(text)
    if not bodies:
        bare = _bare_json_call(text)
        if bare is None and untagged:
            return _untagged_calls(text, by_name)
        return [bare] if bare is not None else []
    return [_parse_one(body.strip(), by_name) for body in bodies]


def _untagged_calls(text: str, by_name: dict[str, Tool]) -> list[ToolCall]:
    """`name(argument)` for each one-parameter tool name in text, the argument up to the matching
    parenthesis; a call left unclosed (the turn ran out of tokens) is not a call."""
    names = [name for name, tool in by_name.items() if _one_string_parameter(tool) is not None]
    if not names:
        return []
    calls = []
    for match in re.finditer(rf"(?<![A-Za-z0-9_])({'|'.join(map(re.escape, names))})\s*\(", text):
        depth, end = 1, match.end()
        while end < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        if depth == 0:
            name = match.group(1)
            calls.append(ToolCall(name, {str(_one_string_parameter(by_name[name])): text[match.end():end - 1].strip()}))
    return calls


def _bare_json_call(text: str) -> ToolCall | None:
    """An action that is nothing but a JSON tool call (no tags), as Llama 3.1's template asks for; else None."""
    stripped = text.strip()
    if not (stripped.startswith("{") and stripped.endswith("}")):
        return None
    try:
        data = json.loads(stripped)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or \
            not ({"arguments", "parameters"} & set(data)):
        return None
    return _json_call(data)


def _json_call(data: Any) -> ToolCall:
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall("", error='a tool call needs {"name": ..., "arguments": {...}}')
    arguments = data.get("arguments", data.get("parameters", {}))
    if not isinstance(arguments, dict):
        return ToolCall(data["name"], error="arguments must be an object")
    return ToolCall(data["name"], arguments)


def _parse_one(body: str, by_name: dict[str, Tool]) -> ToolCall:
    if body.startswith("{"):
        try:
            return _json_call(json.loads(body))
        except json.JSONDecodeError as error:
            return ToolCall("", error=f"the tool call is not JSON: {error}")
    short = SHORT.match(body)
    if short is None:
        return ToolCall("", error='write <tool_call>{"name": ..., "arguments": {...}}</tool_call>')
    name, argument = short.group(1), short.group(2).strip()
    parameter = _one_string_parameter(by_name[name]) if name in by_name else None
    if parameter is None:
        return ToolCall(name, error=f"{name}(...) needs a tool with exactly one parameter; use the JSON form")
    return ToolCall(name, {parameter: argument})


def run_tool_call(call: ToolCall, tools: list[Tool]) -> str:
    """The output of one call as text; an unknown tool, bad arguments or an exception becomes an error text."""
    if call.error:
        return f"error: {call.error}"
    by_name = {t.__name__: t for t in tools}
    if call.name not in by_name:
        return f"error: no tool named {call.name!r} (tools: {', '.join(sorted(by_name))})"
    try:
        output = by_name[call.name](**call.arguments)
    except Exception as error:  # the tool's failure is the model's to read
        return f"error: {type(error).__name__}: {error}"[:MAX_OUTPUT_CHARS]
    return str(output)[:MAX_OUTPUT_CHARS]


def describe_tools(tools: list[Tool]) -> str:
    """A system prompt that lists the tools (signature and docstring) and the tag format."""
    lines = ["You can call tools. To call one, write on its own:",
             '<tool_call>{"name": "<tool>", "arguments": {<arguments as JSON>}}</tool_call>',
             "A tool with one parameter can also be called as <tool_call>name(argument)</tool_call>.",
             "Each call's result comes back in the next message. When you are done, answer without a tool call.",
             "Tools:"]
    for tool in tools:
        doc = inspect.getdoc(tool) or ""
        lines.append(f"- {tool.__name__}{_signature(tool)}: {doc.splitlines()[0] if doc else ''}".rstrip(": "))
    return "\n".join(lines)


JSON_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "array",
              "dict": "object"}


def tool_schemas(tools: list[Tool]) -> list[dict[str, Any]]:
    """The tools as the JSON function schemas chat templates take (`apply_chat_template(..., tools=...)`):
    name, the docstring's first line, and each parameter with its JSON type when annotated."""
    schemas = []
    for tool in tools:
        parameters = inspect.signature(tool).parameters.values()
        properties = {p.name: ({"type": JSON_TYPES[_annotation(p.annotation)]}
                               if _annotation(p.annotation) in JSON_TYPES else {}) for p in parameters}
        doc = inspect.getdoc(tool) or ""
        schemas.append({"type": "function", "function": {
            "name": tool.__name__, "description": doc.splitlines()[0] if doc else "",
            "parameters": {"type": "object", "properties": properties,
                           "required": [p.name for p in parameters if p.default is p.empty]}}})
    return schemas


def _annotation(value: Any) -> str:
    return value if isinstance(value, str) else getattr(value, "__name__", str(value))


def _signature(tool: Tool) -> str:
    """`(a: int, b: int) -> int`, whether the annotations are types or (postponed) strings."""
    signature = inspect.signature(tool)
    parts = [p.name if p.annotation is p.empty else f"{p.name}: {_annotation(p.annotation)}"
             for p in signature.parameters.values()]
    returned = signature.return_annotation
    returns = "" if returned is signature.empty else f" -> {_annotation(returned)}"
    return f"({', '.join(parts)}){returns}"


class ToolEnv(Env):
    """An `Env` whose actions may call tools. Subclasses set `tools` and define `reset` and `finish(action)`.

    `step(action)`: when the action makes tool calls, each is run and its output returned as a message
    of role "tool" (reward 0, not done), unless the episode has used `max_tool_calls`; otherwise
    `finish(action)` gives (observation, reward, done) for the answer. `system_prompt()` is
    `describe_tools(tools)`, for `reset` to put first.
    """

    tools: list[Tool] = []
    max_tool_calls: int = 8
    untagged_calls: bool = False
    """Also take a one-parameter tool's `name(argument)` written without tags as a call (module docstring)."""

    tool_calls: int
    """Tool calls the episode has made so far."""

    def __init__(self, task: dict[str, Any], **params: Any) -> None:
        super().__init__(task, **params)
        self.tool_calls = 0

    def system_prompt(self) -> str:
        return describe_tools(self.tools)

    @abc.abstractmethod
    def finish(self, action: str) -> StepResult:
        """(observation, reward, done) for an action that calls no tool: the episode's answer."""

    def step(self, action: str) -> StepResult:
        calls = parse_tool_calls(action, self.tools, untagged=self.untagged_calls)
        if not calls or self.tool_calls >= self.max_tool_calls:
            return self.finish(action)
        self.tool_calls += len(calls)
        outputs: list[Message] = [{"role": "tool", "content": run_tool_call(call, self.tools)} for call in calls]
        return outputs, 0.0, False
