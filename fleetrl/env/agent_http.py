"""The HTTP side of an agent worker: every httpx request of the process answered by the policy, through the
episode's `fleetrl.env.agent.AgentHost` (`serve_httpx` patches the default transports of `httpx` and openai 3's
`httpx2`, so the openai SDK's clients and any framework's reach it), and the reply to one request
(`answer_request`): a chat completion, a Responses API response (`fleetrl.env.agent_responses`), as JSON or
server-sent events (`fleetrl.env.agent_stream`); other endpoints answer 404.

Stdlib only here (the httpx modules are patched by name); imported only by agent workers.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

from fleetrl.env import agent_stream
from fleetrl.env.agent import AgentHost, CallError
from fleetrl.env.agent_responses import chat_request, response_of

JSON = "application/json"


def answer_request(host: AgentHost, method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
    """The HTTP status, media type and body answering one request of the agent: a chat completion, or a
    response of the Responses API (`POST /responses`, carried as the chat completion it stands for); as JSON,
    or as server-sent events when the request asks for `stream` (`fleetrl.env.agent_stream`: the same reply,
    whole, in the stream's format)."""
    try:
        responses, request = _route(method, path, body)
        return _render(responses, request, host.complete(chat_request(request) if responses else request))
    except CallError as error:
        return _error(error)


async def answer_request_async(host: AgentHost, method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
    """`answer_request` for an async client while an async `run` runs: the call waits for its turn together
    with the calls the agent's other tasks make (`AgentHost.complete_async`)."""
    try:
        responses, request = _route(method, path, body)
        return _render(responses, request, await host.complete_async(chat_request(request) if responses else request))
    except CallError as error:
        return _error(error)


def _route(method: str, path: str, body: bytes) -> tuple[bool, dict[str, Any]]:
    """Whether a request is the Responses API's (else a chat completion), and its JSON body; CallError for
    another endpoint (404) or a body that is not a JSON object (400)."""
    responses = path.endswith("/responses")
    if method != "POST" or not (path.endswith("/chat/completions") or responses):
        raise CallError(404, f"{method} {path}: agent episodes serve POST /chat/completions and POST /responses only")
    try:
        request = json.loads(body or b"{}")
    except ValueError as error:
        raise CallError(400, f"the request body is not JSON: {error}") from None
    if not isinstance(request, dict):
        raise CallError(400, "the request body is not a JSON object")
    return responses, request


def _render(responses: bool, request: dict[str, Any], completion: dict[str, Any]) -> tuple[int, str, bytes]:
    """A call's completion as the request asked for it: a chat completion or a response, JSON or streamed."""
    if responses:
        response = response_of(completion, request)
        if request.get("stream"):
            return 200, agent_stream.MEDIA_TYPE, agent_stream.response_events(response)
        return _json(200, response)
    if request.get("stream"):
        include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
        return 200, agent_stream.MEDIA_TYPE, agent_stream.chat_chunks(completion, include_usage)
    return _json(200, completion)


def _error(error: CallError) -> tuple[int, str, bytes]:
    kind = "not_found" if error.status == 404 else "invalid_request_error"
    return _json(error.status, {"error": {"message": str(error), "type": kind}})


def _json(status: int, body: dict[str, Any]) -> tuple[int, str, bytes]:
    return status, JSON, json.dumps(body).encode()


HTTPX_MODULES = ("httpx", "httpx2")
"""The httpx distributions whose transports are served (openai 2 uses httpx, openai 3 its fork httpx2)."""


def serve_httpx(host: AgentHost) -> list[str]:
    """Answer every httpx request of this process with the policy: the default transports of every httpx
    client (the openai SDK's, a framework's) answer through `host` instead of the network. The names
    of the httpx modules served."""
    served = []
    for name in HTTPX_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        _patch(module, host)
        served.append(name)
    return served


def _patch(module: Any, host: AgentHost) -> None:
    def response(answer: tuple[int, str, bytes]) -> Any:
        # a body given as bytes is read the same by a sync and an async client, streamed or not
        status, media_type, body = answer
        return module.Response(status, headers={"content-type": media_type}, content=body)

    def handle(self: Any, request: Any) -> Any:
        return response(answer_request(host, request.method, request.url.path, request.read()))

    async def handle_async(self: Any, request: Any) -> Any:
        if not host.driving():  # an async client run by hand inside a sync `run`: answered at once
            return response(answer_request(host, request.method, request.url.path, request.read()))
        return response(await answer_request_async(host, request.method, request.url.path, request.read()))

    module.HTTPTransport.handle_request = handle
    module.AsyncHTTPTransport.handle_async_request = handle_async
