"""The Tinker API's sample requests over JetStream: the tinker service asks, any actor serving the base answers.

This module knows JetStream and nothing of models: a request and its result are bytes (their format is
`fleetrl.tinker.fleet`'s).

- `SampleRequester` (the tinker service): `request(model, payload, deadline_s)` publishes the payload to the
  base's subject (`bus.sample_subject`, stream FLEET_SAMPLES, work-queue retention) with `Nats-Msg-Id` the
  request's id (a re-publish after a lost ack is dropped), its results subject and its deadline in headers,
  then waits for the result on the process's results subject (stream FLEET_SAMPLE_RESULTS, read by an
  ordered consumer from the service's start). The first result of a request id answers it; any later one
  (or one after its deadline) is dropped and counted. Past the deadline: DeadlineExceeded, naming the base.
- `SampleQueue` (an actor): `fetch` one delivery of the base's shared durable consumer; `handle(msg, serve)`
  acks a request past its deadline unserved; otherwise runs `serve(payload)` with `in_progress()` beats every
  ack_wait / 3, publishes the result (JetStream's ack awaited, `Nats-Msg-Id: result/<request id>`) and only
  then acks the request. An actor killed before its ack leaves the request unacked: JetStream redelivers it
  after ack_wait to any actor serving the base, up to the consumer's max_deliver deliveries; a request served
  twice (killed between its result and its ack) publishes its result twice, and JetStream stores one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from prometheus_client import Counter

from fleetrl.errors import DeadlineExceeded
from fleetrl.tasks import bus
from fleetrl.tasks.queue import ack, keepalive, nak

log = logging.getLogger(__name__)

REPLY_HEADER = "Fleet-Reply-To"
DEADLINE_HEADER = "Fleet-Deadline-Ms"
REQUEST_HEADER = "Fleet-Request-Id"
ACTOR_HEADER = "Fleet-Actor-Id"
RESULTS_DROPPED = Counter("fleetrl_tinker_sample_results_dropped_total",
                          "Sample results dropped by the tinker service: a second result of a request, or one "
                          "that came after its deadline")
SAMPLES_SERVED = Counter("fleetrl_actor_tinker_samples_total", "Tinker sample requests an actor handled, by outcome "
                         "(served, expired, released)", ["outcome"])
Serve = Callable[[bytes], Awaitable[bytes]]
"""A request's payload to its result's payload (the domain's; it encodes its own errors as a result)."""


def _now_ms() -> int:
    return int(time.time() * 1000)


class SampleRequester:
    """The tinker service's side: requests out, results in, one result per request id."""

    service_id: str
    _js: JetStreamContext
    _waiting: dict[str, asyncio.Future[bytes]]
    _sub: JetStreamContext.PushSubscription | None

    def __init__(self, js: JetStreamContext, service_id: str) -> None:
        self.service_id = service_id
        self._js = js
        self._waiting = {}
        self._sub = None

    async def start(self) -> None:
        """Read this process's results subject from now on (an ordered consumer: it recovers from gaps)."""
        self._sub = await self._js.subscribe(bus.sample_results_subject(self.service_id), cb=self._on_result,
                                             ordered_consumer=True, deliver_policy=api.DeliverPolicy.NEW)

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def request(self, model: str, payload: bytes, deadline_s: float) -> bytes:
        """The result of one request to the actors serving `model`, within deadline_s (DeadlineExceeded)."""
        request_id = uuid.uuid4().hex
        deadline = time.monotonic() + deadline_s
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        headers = {"Nats-Msg-Id": request_id, REPLY_HEADER: bus.sample_results_subject(self.service_id),
                   DEADLINE_HEADER: str(_now_ms() + int(deadline_s * 1000))}
        try:
            async with asyncio.timeout(deadline_s):
                await bus.retry_outage(
                    lambda: self._js.publish(bus.sample_subject(model), payload, headers=headers,
                                             timeout=min(bus.REQUEST_TIMEOUT_S, max(0.1, deadline - time.monotonic()))),
                    what=f"sample request {request_id}", deadline_s=deadline_s)
                return await future
        except TimeoutError as error:
            raise DeadlineExceeded(f"sample request {request_id} was not answered within {deadline_s:g}s: no actor "
                                   f"serving base model {model!r} answered (actors serve a base when it is among "
                                   "their tinker_models)") from error
        finally:
            self._waiting.pop(request_id, None)

    async def _on_result(self, msg: Msg) -> None:
        request_id = (msg.headers or {}).get(REQUEST_HEADER, "")
        future = self._waiting.get(request_id)
        if future is None or future.done():
            RESULTS_DROPPED.inc()
            log.warning("sample result of %s dropped: its request is answered or past its deadline", request_id)
            return
        future.set_result(msg.data)


class SampleQueue:
    """An actor's share of one base's sample requests (the base's shared durable pull consumer)."""

    model: str
    actor_id: str
    ack_wait_s: float
    _js: JetStreamContext
    _sub: JetStreamContext.PullSubscription

    def __init__(self, model: str, js: JetStreamContext, sub: JetStreamContext.PullSubscription, ack_wait_s: float,
                 actor_id: str) -> None:
        self.model, self.actor_id, self.ack_wait_s = model, actor_id, ack_wait_s
        self._js, self._sub = js, sub

    async def fetch(self, most: int, timeout_s: float) -> list[Msg]:
        """Up to `most` deliveries: those waiting now, or the first to come within timeout_s ([] when none)."""
        try:
            return list(await self._sub.fetch(most, timeout=timeout_s))
        except TimeoutError:
            return []

    async def handle(self, msg: Msg, serve: Serve) -> None:
        """Serve one delivery: result published, then acked; unserved (expired) acked; failed released."""
        headers = msg.headers or {}
        request_id, attempt = headers.get("Nats-Msg-Id", ""), int(msg.metadata.num_delivered)
        left_s = (int(headers.get(DEADLINE_HEADER, "0")) - _now_ms()) / 1000
        log.info("tinker sample %s of %s delivery %d received", request_id, self.model, attempt)
        if left_s <= 0:
            log.warning("tinker sample %s is past its deadline: dropped unserved", request_id)
            SAMPLES_SERVED.labels("expired").inc()
            await ack(msg)
            return
        try:
            async with keepalive(msg, self.ack_wait_s / 3):
                result = await serve(msg.data)
                await bus.retry_outage(lambda: self._reply(headers, request_id, result),
                                       what=f"result of sample {request_id}", deadline_s=left_s)
        except (asyncio.CancelledError, KeyboardInterrupt):
            await nak(msg, 0.0)
            raise
        except Exception as error:  # NATS gone past the deadline, or a bug: another delivery may do better
            log.warning("tinker sample %s delivery %d failed (%s: %s); released", request_id, attempt,
                        type(error).__name__, error)
            SAMPLES_SERVED.labels("released").inc()
            await nak(msg, 1.0)
            return
        SAMPLES_SERVED.labels("served").inc()
        log.info("tinker sample %s delivery %d served", request_id, attempt)
        await ack(msg)

    async def _reply(self, headers: dict[str, str], request_id: str, result: bytes) -> None:
        await self._js.publish(headers[REPLY_HEADER], result, timeout=bus.REQUEST_TIMEOUT_S, headers={
            "Nats-Msg-Id": bus.sample_result_msg_id(request_id), REQUEST_HEADER: request_id,
            ACTOR_HEADER: self.actor_id})

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()
