"""The Responses API (`POST .../responses`, the OpenAI Agents SDK's default model) on an agent's chat
completions: a request as the chat-completions request it stands for (`chat_request`), and the chat completion
that answers it as a `Response` (`response_of`).

Design choice: a Responses call is served as the one chat completion it stands for, so it is one turn of the
episode like any other and `fleetrl.env.agent` decides append or segment for both alike. Server-side state
(`previous_response_id`, `conversation`, a stored `prompt`) and tools other than functions are refused with a
400 rather than ignored.

Stdlib only; imported only by agent workers.
"""

from __future__ import annotations

from typing import Any

from fleetrl.env.agent import CallError, text_of

RESPONSES_ROLES = ("user", "assistant", "system", "developer")
"""The roles of a Responses API message item."""
RESPONSES_TEXT_PARTS = ("input_text", "output_text", "text")
"""The content part types the Responses API carries as text (in a message's content, a tool's output)."""
SERVER_STATE = ("previous_response_id", "conversation", "prompt")
"""Responses API fields that name state kept on the server (an earlier response, a conversation, a stored
prompt template): refused, since ignoring one would serve the call without the context it names. The OpenAI
Agents SDK sends them for `Runner.run(previous_response_id=..., conversation_id=...,
auto_previous_response_id=True)` and an `Agent(prompt=...)`."""


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses API request (`POST /responses`) as the chat-completions request it stands for:
    `instructions` a system message first; `input` a str (one user message) or a list of items, where
    a message item is a message, an assistant message's `function_call` items become its tool calls (an
    assistant message of their own when none precedes them), a `function_call_output` a tool message,
    and `reasoning` items are dropped; function tools in the chat form; `max_output_tokens` the cap.
    CallError naming what it cannot carry: `SERVER_STATE` (`previous_response_id`,
    `conversation`, `prompt`: send the whole input), tools other than functions, other items and non-text
    parts; settings with no bearing on the tokens (`store`, `include`, `reasoning`, `text`) are ignored.
    Items are checked and their content made text here, so an error names the place the agent gave
    (`input[2].content[1]`), not the chat message it became (instructions and merged function calls
    shift those)."""
    for field in SERVER_STATE:
        if body.get(field):
            raise CallError(400, f"{field} is not supported in agent episodes: nothing is stored between calls; "
                                 "send the instructions and the whole conversation as input")
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": text_of(body["instructions"], "instructions",
                                                              RESPONSES_TEXT_PARTS)})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise CallError(400, "input must be a non-empty str or list of items")
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            if item.get("role") not in RESPONSES_ROLES:
                raise CallError(400, f"{where}.role is {item.get('role')!r}, expected {', '.join(RESPONSES_ROLES)}")
            messages.append({"role": item["role"],
                             "content": text_of(item.get("content"), f"{where}.content", RESPONSES_TEXT_PARTS)})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", ""))}}
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                             "content": text_of(item.get("output"), f"{where}.output", RESPONSES_TEXT_PARTS)})
        elif kind != "reasoning":
            raise CallError(400, f"{where} is a {kind!r} item; messages, function calls and their outputs are "
                                 "supported")
    if not messages:
        raise CallError(400, "input holds no message, function call or function call output")
    tools = []
    for index, tool in enumerate(body.get("tools") or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise CallError(400, f"tools[{index}] is a {kind!r} tool; only function tools are supported")
        tools.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                       if k in tool}})
    request: dict[str, Any] = {"model": body.get("model", "policy"), "messages": messages, "tools": tools}
    if body.get("max_output_tokens"):
        request["max_tokens"] = body["max_output_tokens"]
    return request


def response_of(completion: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """A chat completion as the Responses API's `Response`: the assistant's text as a message item, then
    each tool call as a `function_call` item (an agent that sends both back extends the call, as with
    chat completions)."""
    choice = completion["choices"][0]
    message, calls = choice["message"], choice["message"].get("tool_calls") or []
    number = completion["id"].rsplit("-", 1)[-1]
    output: list[dict[str, Any]] = [{
        "type": "message", "id": f"msg_fleetrl_{number}", "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "text": message["content"], "annotations": []}]}]
    output += [{"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}
               for call in calls]
    usage = completion["usage"]
    cut = choice["finish_reason"] == "length"
    return {"id": f"resp_fleetrl_{number}", "object": "response", "created_at": float(completion["created"]),
            "model": completion["model"], "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
            "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
            "output": output, "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "temperature": None, "top_p": None,
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                      "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}
