"""Streamed replies to an agent's calls (`stream: true`): a chat completion as `chat.completion.chunk`
server-sent events, a Responses API `Response` as the Responses streaming events, both as the `openai`
client parses them.

The actor generates a turn whole (`fleetrl.env.agent`), so a stream is only the wire format of a reply
already complete: each piece of it (the text, each tool call's arguments) goes out as one delta, and the
stream ends at once. What the agent assembles from the deltas is the reply it would have got without
streaming, so the turns an episode records are the same either way.

Stdlib only; imported only by agent workers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

MEDIA_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
"""The end of a chat-completions stream (a Responses stream ends at its terminal event)."""


def chat_chunks(completion: dict[str, Any], include_usage: bool) -> bytes:
    """A `ChatCompletion` as the body of its stream, as OpenAI's server sends it: a chunk with the role, one
    with the content, one per tool call (its id, name and whole arguments), one with the finish reason, the
    usage in a last chunk with no choices when `stream_options.include_usage` asks for it, then `[DONE]`."""
    choice = completion["choices"][0]
    message = choice["message"]
    head = {key: completion[key] for key in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    if include_usage:
        head["usage"] = None

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    if message["content"]:
        chunks.append(chunk({"content": message["content"]}))
    chunks += [chunk({"tool_calls": [{"index": index, **call}]})
               for index, call in enumerate(message.get("tool_calls") or [])]
    chunks.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        chunks.append({**head, "choices": [], "usage": completion["usage"]})
    return b"".join(_event(None, c) for c in chunks) + DONE


def response_events(response: dict[str, Any]) -> bytes:
    """A Responses API `Response` as the body of its stream: `response.created` and `response.in_progress`
    (the response with no output yet), each output item's events (`response.output_item.added`, then a
    message's content part, its text as one `response.output_text.delta` and `.done`, or a function call's
    arguments as one `response.function_call_arguments.delta` and `.done`, then `response.output_item.done`),
    and the whole response in `response.completed` (`response.incomplete` when the cap cut it: the terminal
    event the OpenAI Agents SDK raises on, as it raises on an incomplete response unstreamed)."""
    pending = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    terminal = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    events = [("response.created", {"response": pending}), ("response.in_progress", {"response": pending})]
    for index, item in enumerate(response["output"]):
        events += _item_events(index, item)
    events.append((terminal, {"response": response}))
    return b"".join(_event(kind, {"type": kind, "sequence_number": number, **fields})
                    for number, (kind, fields) in enumerate(events))


def _item_events(index: int, item: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The events of one output item (a message or a function call), whole."""
    at = {"item_id": item["id"], "output_index": index}
    if item["type"] == "message":
        yield "response.output_item.added", {"output_index": index,
                                             "item": {**item, "status": "in_progress", "content": []}}
        for part_index, part in enumerate(item["content"]):
            part_at = {**at, "content_index": part_index}
            yield "response.content_part.added", {**part_at, "part": {**part, "text": ""}}
            if part["text"]:
                yield "response.output_text.delta", {**part_at, "delta": part["text"], "logprobs": []}
            yield "response.output_text.done", {**part_at, "text": part["text"], "logprobs": []}
            yield "response.content_part.done", {**part_at, "part": part}
    else:
        yield "response.output_item.added", {"output_index": index,
                                             "item": {**item, "status": "in_progress", "arguments": ""}}
        if item["arguments"]:
            yield "response.function_call_arguments.delta", {**at, "delta": item["arguments"]}
        yield "response.function_call_arguments.done", {**at, "arguments": item["arguments"]}
    yield "response.output_item.done", {"output_index": index, "item": item}


def _event(kind: str | None, data: dict[str, Any]) -> bytes:
    """One server-sent event: its `event:` line when it has a kind, its JSON `data:` line."""
    head = f"event: {kind}\n" if kind else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


__all__ = ["MEDIA_TYPE", "chat_chunks", "response_events"]
