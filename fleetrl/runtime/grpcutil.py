"""gRPC plumbing shared by every service: servers, channels, error mapping, retries.

Servers are `grpc.aio` servers with the standard health service and server
reflection. `map_errors` turns domain errors into status codes (through
`errors.grpc_code`, the only mapping) with `google.rpc.BadRequest` field
violations attached, so servicers stay thin. Client calls always carry a
deadline; `retry` retries only the codes its `RetryPolicy` names, for a bounded number of
tries or a bounded time.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from fleetrl.errors import (
    RETRYABLE_CODES,
    ConfigError,
    FieldViolation,
    FleetError,
    InvalidArgument,
    from_grpc,
    grpc_code,
)

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.enable_retries", 0),
]
CLIENT_OPTIONS = [
    *CHANNEL_OPTIONS,
    # any ping unanswered this long closes the connection: grpc's default is 60 s, and a ping already in
    # flight when the server went silent (the flow-control one sent after a response) was waited out that
    # long, keepalive's own ping and timeout notwithstanding
    ("grpc.http2.ping_timeout_ms", 10_000),
]

T = TypeVar("T")
S = TypeVar("S")


def status_for(error: BaseException) -> status_pb2.Status:
    """The rich status of a domain error: code, message and BadRequest field violations."""
    code = grpc_code(error)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=str(error) or type(error).__name__)
    violations = getattr(error, "violations", None)
    if isinstance(error, ConfigError | InvalidArgument) and violations:
        bad = error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
            for v in violations
        ])
        detail = any_pb2.Any()
        detail.Pack(bad)
        status.details.append(detail)
    return status


def field_violations(error: grpc.RpcError) -> list[tuple[str, str]]:
    """(field, description) pairs of a failed call's BadRequest details, if any."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    out: list[tuple[str, str]] = []
    for detail in status.details if status else []:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            out.extend((v.field, v.description) for v in bad.field_violations)
    return out


async def abort_with(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    if not isinstance(error, FleetError):
        log.exception("unexpected error in servicer", exc_info=error)
    await context.abort_with_status(rpc_status.to_status(status_for(error)))


def map_errors(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Decorate a unary async servicer method: domain errors become their status code."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as error:  # the one place servicer errors become statuses
            await abort_with(context, error)
            raise AssertionError("unreachable: abort raises") from error

    return wrapper


def map_stream_errors(method: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    """Like map_errors, for server-streaming async generator methods."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[T]:
        try:
            async for item in method(self, request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as error:
            await abort_with(context, error)

    return wrapper


def server_options(max_receive_bytes: int | None = None) -> list[tuple[str, int]]:
    """CHANNEL_OPTIONS, with a smaller limit on received messages if given (the gateway's)."""
    if max_receive_bytes is None:
        return CHANNEL_OPTIONS
    return [*(o for o in CHANNEL_OPTIONS if o[0] != "grpc.max_receive_message_length"),
            ("grpc.max_receive_message_length", max_receive_bytes)]


async def start_server(
    address: str,
    register: Iterable[Callable[[grpc.aio.Server], str]],
    *,
    interceptors: list[grpc.aio.ServerInterceptor] | None = None,
    credentials: grpc.ServerCredentials | None = None,
    max_receive_bytes: int | None = None,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Start an aio server on address ("host:port", port 0 = free) with health and reflection.

    Each `register(server)` adds one servicer and returns its full service name.
    Returns the server, the bound port and the health servicer (set NOT_SERVING on shutdown).
    An address it cannot bind is a ConfigError naming the `listen` setting.
    """
    server = grpc.aio.server(options=server_options(max_receive_bytes), interceptors=interceptors or [])
    names = [add(server) for add in register]
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in [*names, ""]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # grpc's "Failed to bind": the port is taken, the address or the TLS pair is bad
        port = 0
    if port == 0:
        problem = "cannot listen there (is the port in use, the address valid"
        problem += ", and tls_cert/tls_key a PEM certificate chain and its key?)" if credentials else "?)"
        raise ConfigError("settings", [FieldViolation("listen", f"{address}: {problem}")])
    await server.start()
    return server, port, health_servicer


async def stop_server(server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, grace_s: float) -> None:
    """Report NOT_SERVING, then let in-flight calls finish for grace_s."""
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)


def channel(address: str, credentials: grpc.ChannelCredentials | None = None,
            extra_options: list[tuple[str, int]] | None = None) -> grpc.aio.Channel:
    """An aio channel with fleetrl's message limits, keepalive and ping timeout (and extra_options)."""
    options = [*CLIENT_OPTIONS, *(extra_options or [])]
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=options)
    return grpc.aio.insecure_channel(address, options=options)


class RenewingChannel(Generic[S]):
    """A channel to one address that is replaced by a fresh one when a call on it misses its deadline.

    A connection whose peer vanished without a FIN (a half-open connection: the host went away, a
    middlebox dropped the flow) stays established, so grpc sends every call down it and nothing comes back
    until a ping of its own goes unanswered for `grpc.http2.ping_timeout_ms`, and keepalive sends none for
    `grpc.keepalive_time_ms` after the last bytes read: up to 40 s. A call past its deadline is the first
    sign, so the next call goes on a new channel, with a connection of its own (a local subchannel pool,
    so that grpc's global one can never hand it the old channel's connection). The old channel is closed
    once its calls have ended, each within its deadline. A call that was merely slow costs one connection.
    `bind(channel)` builds the stubs the calls use; `call` runs one attempt on the current ones.
    """

    address: str
    stubs: S
    _channel: grpc.aio.Channel
    _bind: Callable[[grpc.aio.Channel], S]
    _credentials: grpc.ChannelCredentials | None
    _longest_deadline_s: float
    _retired: set[asyncio.Task[None]]

    def __init__(self, address: str, bind: Callable[[grpc.aio.Channel], S],
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.address = address
        self._bind = bind
        self._credentials = credentials
        self._longest_deadline_s = 0.0
        self._retired = set()
        self._open()

    def _open(self) -> None:
        self._channel = channel(self.address, self._credentials, [("grpc.use_local_subchannel_pool", 1)])
        self.stubs = self._bind(self._channel)

    async def call(self, attempt: Callable[[S], Awaitable[T]], deadline_s: float) -> T:
        """attempt(stubs), a call with deadline_s; DEADLINE_EXCEEDED moves later calls to a new channel."""
        self._longest_deadline_s = max(self._longest_deadline_s, deadline_s)
        used = self._channel
        try:
            return await attempt(self.stubs)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and used is self._channel:
                self._renew()
            raise

    def _renew(self) -> None:
        log.info("a call to %s missed its deadline: later calls go on a new connection", self.address)
        old = self._channel
        self._open()
        task = asyncio.get_running_loop().create_task(old.close(grace=self._longest_deadline_s))
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)

    async def close(self) -> None:
        for task in self._retired:
            task.cancel()
        await asyncio.gather(*self._retired, return_exceptions=True)
        await self._channel.close()


@dataclass(frozen=True)
class RetryPolicy:
    """When a failed client call is tried again: the codes that may pass, how many tries, until when.

    A call is retried while its code is in `codes`, fewer than `attempts` tries were made (None: no
    limit) and the next try would start before `deadline_s` from the first (None: no deadline). The
    delay doubles from base_delay_s up to max_delay_s, each one jittered by a factor in [0.5, 1.5).
    """

    attempts: int | None = 5
    deadline_s: float | None = None
    codes: frozenset[grpc.StatusCode] = RETRYABLE_CODES
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0


async def retry(call: Callable[[], Awaitable[T]], *, what: str, policy: RetryPolicy = RetryPolicy()) -> T:
    """Run call() until it succeeds or `policy` gives up; a failure raises as its domain error."""
    deadline = None if policy.deadline_s is None else time.monotonic() + policy.deadline_s
    delay = policy.base_delay_s
    attempt = 0
    while True:
        attempt += 1
        try:
            return await call()
        except grpc.aio.AioRpcError as error:
            if (error.code() not in policy.codes or (policy.attempts is not None and attempt >= policy.attempts)
                    or (deadline is not None and time.monotonic() + delay > deadline)):
                raise from_grpc(error) from error
            log.info("%s failed (%s), retry %d in %.2fs", what, error.code().name, attempt, delay)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(policy.max_delay_s, delay * 2)
