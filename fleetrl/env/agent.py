"""The agent side of a sandboxed worker (boot mode "agent"): an agent file's `run`, whose chat
completions are the episode's turns.

An agent file defines `run(client, task, **params)`: an `async def` gets an `openai.AsyncOpenAI`, a
plain `def` an `openai.OpenAI`. It returns the episode's reward (a finite number), a dict of named
reward components (the reward is their sum), or, in a job with a built-in verifier (`[reward]
builtin`), the final answer as a str for the verifier to score. Every chat completion it asks for
is one turn: the request's messages go to the actor as an observation, the actor generates the
assistant's reply with the policy being trained, and the call returns it as a `ChatCompletion`.
Tools the agent runs itself run here, in the sandbox. Any library that talks to an OpenAI-compatible
server through httpx is served the same way: every httpx request in this worker is answered by the
host (`fleetrl.env.agent_http`; there is no network), and `ENVIRONMENT` is set before the agent file
runs (`OPENAI_BASE_URL` is `BASE_URL`, `OPENAI_API_KEY` is set), so `openai.OpenAI()` with no
arguments, LangChain's `ChatOpenAI`, smolagents' `OpenAIServerModel` or the OpenAI Agents SDK's default
model (`OpenAIResponsesModel`) reach the policy too. What frameworks run in the event loop's default
executor (a sync tool in `asyncio.to_thread`) runs inline (`InlineExecutor`): the sandbox allows no
thread to outlive a call.

The protocol with the service is the environment's (`fleetrl.env.host`), with calls in place of
observations: a reset runs `run` until its first call(s), which are the reset's reply (`{"calls": [...]}`);
a step's actions (one per call, by call id) are the replies to the pending calls, and the step is
answered by the next calls, or by the end of `run` (done, with its reward). A sync `run` makes one call at
a time. An async `run`'s calls wait together: once its event loop has run SETTLE_HOPS rounds with no new
call, the calls its tasks have pending (`asyncio.gather`, parallel branches of a graph), up to the job's
`max_parallel_calls`, go to the service as one step, and the actor generates them in one batch.
What the service needs to keep the training tokens exact is decided here, where both the request and
the replies the agent was given are known. Each answered call is a branch: its messages, then the
assistant message it returned. A call whose messages are a branch's, then new user, tool or system
messages, is sent with only the new messages and `extends` naming that call (the actor appends their
tokens to what it generated for it: nothing is re-tokenized); a branch is extended once. Any other call
(the agent rewrote, cut or summarised its history, changed its tools, or a second call continues the
same reply) is sent with its whole conversation and `"segment": true` (the actor starts a new segment).

Supported: `POST .../chat/completions` with `messages` (text content, or lists of text parts), `tools`
(their schemas go to the chat template), `max_tokens` / `max_completion_tokens` (a cap below the
job's `rollout.max_new_tokens`); the job's sampling settings, not the request's, are used (the
behaviour log-probs must be the policy's). Refused with a clear 400: `n` > 1, non-text content.
`POST .../responses` (the Responses API, the OpenAI Agents SDK's default model) is served as the chat
completion it stands for (`fleetrl.env.agent_responses`): text input, function tools, `function_call`
and `function_call_output` items; server-side state (`previous_response_id`, `conversation`, a stored
`prompt`) and other tools are refused with a 400. Other endpoints answer 404. A completion's text that
holds `<tool_call>` tags (the format `fleetrl.env.tools` parses) also comes back as `tool_calls`
(function_call items) when the request declared tools. `stream: true` on either endpoint is answered
as server-sent events (`fleetrl.env.agent_stream`): `chat.completion.chunk`s then `[DONE]` (the usage
in a last chunk when `stream_options.include_usage` asks), or the Responses streaming events from
`response.created` to `response.completed`. The actor still generates the turn whole and returns it
at once: streaming is the wire format only (the text is one delta, each tool call one), and the turn
recorded is the one an unstreamed call records.

Here: the host (`AgentHost`: episodes, pending calls, and the branches that decide append or segment), a
chat completion request's checks, and `run`'s final reply. Stdlib only; imported only by agent workers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleetrl.env import tools as env_tools
from fleetrl.env.host import ROLES, EnvError, empty_dir
from fleetrl.reward import protocol

BASE_URL = "http://policy.fleetrl/v1"
"""The OpenAI-compatible base URL an agent's client points at (any URL works: nothing leaves the worker)."""
API_KEY = "fleetrl-agent"
ENVIRONMENT = {"OPENAI_BASE_URL": BASE_URL, "OPENAI_API_KEY": API_KEY, "OPENAI_AGENTS_DISABLE_TRACING": "1"}
"""Set in the worker before the agent file runs: a client built from the environment reaches the policy,
and the OpenAI Agents SDK keeps its tracing off (its exporter is a thread that would outlive the call,
posting to a network the sandbox does not have)."""
DRAIN_S = 1.0
"""How long tasks an async `run` left pending get to finish cancelling after it returned."""
SETTLE_HOPS = 16
"""Rounds of the event loop with no new call after which an async `run`'s pending calls are sent together:
tasks started together (`asyncio.gather`) reach their calls within a few rounds; a task waiting on a timer or
on something else comes later, and its call goes with the next turn."""

Exchange = Callable[[dict[str, Any]], dict[str, Any]]
"""Answers the request in hand with a message and returns the next request ({} when the service hung up)."""


class EpisodeClosed(BaseException):
    """The service closed the episode while the agent waited on a call: unwinds `run` (user code that
    catches Exception does not stop it)."""


class CallError(Exception):
    """A chat-completion request this service cannot answer; the agent's client sees an HTTP error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


TEXT_PARTS = ("text",)
"""The content part types chat completions carry as text."""


def text_of(content: Any, where: str, kinds: tuple[str, ...] = TEXT_PARTS) -> str:
    """A content field as text: a str, None (empty), or a list of text parts ({"type": one of kinds, "text":
    ...}); CallError naming the field (`where`, as the request spells it) or the part."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise CallError(400, f"{where}[{index}] is a {kind!r} part; only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise CallError(400, f"{where} is {type(content).__name__}, expected a str or a list of text parts")


def _tool_calls(message: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, arguments JSON) of an assistant message's tool calls."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            calls.append((str(function.get("name", "")), str(function.get("arguments", ""))))
    return calls


def request_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's messages as {"role", "content"} (plus "tool_calls" of an assistant message, kept
    to compare with the reply it echoes); CallError naming the first bad one."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise CallError(400, "messages must be a non-empty list")
    out = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise CallError(400, f"{where} is not an object")
        role = message.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise CallError(400, f"{where}.role is {role!r}, expected system, user, assistant or tool")
        entry: dict[str, Any] = {"role": role, "content": text_of(message.get("content"), f"{where}.content")}
        if role == "assistant":
            entry["tool_calls"] = _tool_calls(message)
        out.append(entry)
    return out


def _checked_request(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[Any], int]:
    """A request's messages, tools and max_tokens (0: none); CallError for what is not supported."""
    if body.get("n") not in (None, 1):
        raise CallError(400, f"n={body.get('n')!r}: one choice per call is supported")
    if not isinstance(body.get("stream_options") or {}, dict):
        raise CallError(400, "stream_options must be an object")
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise CallError(400, "tools must be a list")
    cap = body.get("max_completion_tokens") or body.get("max_tokens") or 0
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise CallError(400, f"max_tokens is {cap!r}, expected a positive int")
    return request_messages(body), tools, cap


def _same(sent: dict[str, Any], echoed: dict[str, Any]) -> bool:
    """Whether the agent's copy of a reply it was given is that reply: same text, and the same tool
    calls unless the agent dropped them (their text is in the content it kept)."""
    return (echoed["role"] == "assistant" and echoed["content"] == sent["content"]
            and (not echoed["tool_calls"] or echoed["tool_calls"] == sent["tool_calls"]))


def plain(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Messages as the episode protocol carries them: role and content only."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class InlineExecutor(concurrent.futures.ThreadPoolExecutor):
    """The event loop's default executor (`asyncio.to_thread`, `run_in_executor(None, ...)`: where the OpenAI
    Agents SDK runs a sync tool and LangChain a sync tool or callback): each call runs at once in the calling
    thread. A pool's idle threads would outlive the call, which the sandbox counts as threads left running,
    and a worker's process limit leaves room for one thread besides its own at most."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)  # the pool itself never starts a thread

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # handed to the awaiting task, as a pool's thread would
            future.set_exception(error)
        return future


@dataclass
class Call:
    """One chat completion the agent asked for, and what the service is sent for it."""

    id: int
    messages: list[dict[str, Any]]
    tools: list[Any]
    model: str
    """The model the request named, which its completion repeats."""
    sent: dict[str, Any]
    """The call as the service gets it (`_observation`, plus its id and cap)."""


class AgentHost:
    """Runs the episodes of one agent file, one at a time; `handle` answers a request, and `complete`
    (a sync client's call) and `complete_async` (an async client's, while an async `run` runs) are the
    agent's chat-completion endpoint."""

    def __init__(self, run: Callable[..., Any], tmpdir: str, exchange: Exchange, loop: asyncio.AbstractEventLoop,
                 clients: tuple[Any, Any]) -> None:
        self.run, self.tmpdir, self.exchange, self.loop = run, tmpdir, exchange, loop
        self.sync_client, self.async_client = clients
        loop.set_default_executor(InlineExecutor())
        self.in_episode = False
        self.closed = False
        self.calls = 0
        self.max_parallel = 1
        self.branches: dict[int, tuple[list[dict[str, Any]], list[Any]]] = {}
        """Calls answered and not extended yet, by id: their messages then the reply given, and their tools."""
        self.pending: list[tuple[Call, asyncio.Future[dict[str, Any]]]] = []
        """Async calls waiting to be sent, in the order they were made, with the futures their completions go to."""
        self.async_run = False
        """An async `run` is running: its async calls wait to be sent together (`_drive`)."""
        self._wake: asyncio.Future[None] | None = None
        """What `_drive` waits on while no call is pending: done when a call is made."""

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """The reply to a request outside a call; anything the agent raises ends the episode as an error."""
        op = request.get("op")
        if op == "close":
            return {"closed": True}
        if op == "step":
            return {"error": "a step with no call of the agent waiting for it"}
        if op != "reset":
            return {"error": f"unknown op {op!r}"}
        empty_dir(self.tmpdir)
        self.in_episode, self.closed, self.calls, self.branches, self.pending = True, False, 0, {}, []
        self.max_parallel = max(1, int(request.get("max_parallel_calls", 1)))
        try:
            return final_reply(self._run(request["task"], request["params"]))
        except EpisodeClosed:
            return {"closed": True}
        except BaseException as error:  # user code: anything it raises ends this episode
            if isinstance(error, EnvError):
                return {"error": str(error)}
            return {"error": "".join(traceback.format_exception(error, limit=-2))[-2000:].strip()}
        finally:
            self.in_episode, self.async_run, self._wake = False, False, None

    def _run(self, task: dict[str, Any], params: dict[str, Any]) -> Any:
        if inspect.iscoroutinefunction(self.run):
            self.async_run = True
            main = self.loop.create_task(self.run(self.async_client, task, **params))
            try:
                return self.loop.run_until_complete(self._drive(main))
            finally:
                self._cancel_leftovers()
        return self.run(self.sync_client, task, **params)

    async def _drive(self, main: asyncio.Task[Any]) -> Any:
        """Run an async `run` to its end, sending the calls its tasks have pending together: once the loop has
        run SETTLE_HOPS rounds with no new call, up to max_parallel of them go to the service as one step (the
        loop waits meanwhile), and each completion is set on its call's future."""
        while True:
            if not self.pending:
                self._wake = self.loop.create_future()
                await asyncio.wait({main, self._wake}, return_when=asyncio.FIRST_COMPLETED)
            quiet, seen = 0, len(self.pending)
            while quiet < SETTLE_HOPS and not main.done():
                await asyncio.sleep(0)
                quiet, seen = (quiet + 1 if len(self.pending) == seen else 0), len(self.pending)
            if main.done():
                return main.result()
            batch = [(call, future) for call, future in self.pending[:self.max_parallel] if not future.cancelled()]
            del self.pending[:self.max_parallel]
            if batch:
                for (_, future), completion in zip(batch, self._send([call for call, _ in batch]), strict=True):
                    future.set_result(completion)

    def _cancel_leftovers(self) -> None:
        """Cancel the tasks `run` left pending, and give them DRAIN_S to finish."""
        pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            with contextlib.suppress(BaseException):
                self.loop.run_until_complete(asyncio.wait(pending, timeout=DRAIN_S))

    def driving(self) -> bool:
        """Whether an async call made now can wait for its turn: an async `run` is being driven in this loop."""
        with contextlib.suppress(RuntimeError):
            return self.async_run and asyncio.get_running_loop() is self.loop
        return False

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """The ChatCompletion answering one request of the agent at once: the episode's next turn."""
        call = self._call(body)
        (completion,) = self._send([call])
        return completion

    async def complete_async(self, body: dict[str, Any]) -> dict[str, Any]:
        """The ChatCompletion answering one request of an async `run`, generated with the calls its other tasks
        have pending at the same time."""
        future: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        self.pending.append((self._call(body), future))
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
        return await future

    def _call(self, body: dict[str, Any]) -> Call:
        if self.closed:
            raise EpisodeClosed()
        if not self.in_episode:
            raise CallError(400, "a chat completion outside an episode (after run returned)")
        messages, tools, cap = _checked_request(body)
        self.calls += 1
        sent = {**self._observation(messages, tools), "call": self.calls, "max_new_tokens": cap}
        return Call(self.calls, messages, tools, str(body.get("model", "policy")), sent)

    def _send(self, calls: list[Call]) -> list[dict[str, Any]]:
        """Send calls to the service as one step's reply and wait for their actions: their completions."""
        step = self.exchange({"calls": [call.sent for call in calls], "reward": 0.0, "done": False})
        actions = {a.get("call"): a for a in step.get("actions") or [] if isinstance(a, dict)}
        if step.get("op") != "step" or set(actions) != {call.id for call in calls}:
            self.closed = True
            raise EpisodeClosed()
        return [self._completion(call, actions[call.id]) for call in calls]

    def _completion(self, call: Call, action: dict[str, Any]) -> dict[str, Any]:
        """The ChatCompletion for a call's action; the call becomes a branch a later call can extend."""
        text = str(action.get("action", ""))
        parsed = [c for c in env_tools.parse_tool_calls(text) if not c.error] if call.tools else []
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if parsed:
            message["tool_calls"] = [{"id": f"call_{call.id}_{i}", "type": "function",
                                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                     for i, c in enumerate(parsed)]
        reply = {"role": "assistant", "content": text, "tool_calls": _tool_calls(message)}
        self.branches[call.id] = ([*call.messages, reply], call.tools)
        finish = "length" if action.get("finish_reason") == "length" else "tool_calls" if parsed else "stop"
        prompt, completion = int(action.get("prompt_tokens", 0)), int(action.get("completion_tokens", 0))
        return {"id": f"chatcmpl-fleetrl-{call.id}", "object": "chat.completion", "created": int(time.time()),
                "model": call.model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}

    def _observation(self, messages: list[dict[str, Any]], tools: list[Any]) -> dict[str, Any]:
        """What the actor needs of a call: only its new messages when it extends an earlier call and the reply
        it was given (that call's branch, which it takes: a second call extending it starts a segment), else
        its whole conversation as a new segment."""
        for id_, (before, before_tools) in reversed(self.branches.items()):
            if (tools == before_tools and len(messages) > len(before)
                    and messages[:len(before) - 1] == before[:-1] and _same(before[-1], messages[len(before) - 1])
                    and all(m["role"] in ROLES for m in messages[len(before):])):
                del self.branches[id_]
                return {"observation": plain(messages[len(before):]), "extends": id_}
        return {"observation": plain(messages), "segment": True, "tools": tools}


def final_reply(value: Any) -> dict[str, Any]:
    """The reply for what `run` returned: its reward, its reward components, or its final answer."""
    if isinstance(value, str):
        return {"observation": [], "reward": 0.0, "done": True, "answer": value}
    if isinstance(value, dict):
        numbers = {str(k): protocol.finite_number(float(v) if isinstance(v, bool) else v) for k, v in value.items()}
        bad = sorted(k for k, v in numbers.items() if v is None)
        if bad or not numbers:
            raise EnvError(f"run returned a dict with non-finite or non-numeric entries {bad[:5]}" if bad
                           else "run returned an empty dict")
        total = protocol.finite_number(sum(v for v in numbers.values() if v is not None))
        if total is None:
            raise EnvError("run's reward components sum to a non-finite total")
        return {"observation": [], "reward": total, "done": True, "components": numbers}
    number = protocol.finite_number(float(value) if isinstance(value, bool) else value)
    if number is None:
        raise EnvError(f"run returned {type(value).__name__} {str(value)[:80]!r}: expected a finite number, a dict "
                       "of reward components, or a str answer for the job's verifier")
    return {"observation": [], "reward": number, "done": True}


def agent_run(namespace: dict[str, Any]) -> Callable[..., Any]:
    """The `run` an agent file defines; TypeError when it has none."""
    run = namespace.get("run")
    if not callable(run):
        raise TypeError("the agent file does not define `run(client, task)` (an async def gets an openai.AsyncOpenAI, "
                        "a def an openai.OpenAI)")
    return run


__all__ = ["API_KEY", "BASE_URL", "ENVIRONMENT", "AgentHost", "CallError", "EpisodeClosed", "InlineExecutor",
           "agent_run", "final_reply"]
