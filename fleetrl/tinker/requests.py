"""Tinker's futures: every mutating request gets an id at once and its result later, exactly once.

A request is named by the client: (scope, seq_id), where the scope is a training run's model_id, a
sampling session, or a session's create_model counter, and seq_id the SDK's per-client counter. The
first submission of a name runs its work; a later submission of the same name (an SDK retry after a
lost response, or a replay) gets the first one's request id, and so its result, and runs nothing.
So an optim_step is applied at most once per (model_id, seq_id).

Work runs on one executor thread, in the order requests arrive (the SDK sends a training client's
requests in seq_id order); work that waits on other processes (a sample served by the fleet's actors,
`submit_async`) runs on the event loop instead, at once and concurrently. Work submitted with a `lane` (a
training run held by a learner: its calls wait on that learner) runs on the lane's own thread instead, in
arrival order within the lane, so one run's long call never holds another's, nor the process's thread.
Results are kept until their name leaves the table: each scope keeps its last `keep_per_scope` names, and
a name older than those is refused (InvalidArgument) instead of being run again, which keeps the at-most-once promise
after eviction.

Design choice: request ids are random (uuid4), never derived from the name, and each records its
tenant, so a request id from another tenant reads as unknown (NotFound) rather than leaking a result.

Each request's work is a span (`tinker.<kind>`, with the tenant, scope and seq_id; child of the HTTP
request's span) and is counted in `fleetrl_tinker_work_seconds{kind, outcome}`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from prometheus_client import Histogram

from fleetrl.errors import FieldViolation, InvalidArgument, NotFound
from fleetrl.runtime import telemetry
from fleetrl.runtime.observe import LATENCY_BUCKETS_S

Key = tuple[str, int]
"""(scope, seq_id): the client's name for a request."""
WORK_SECONDS = Histogram("fleetrl_tinker_work_seconds", "Seconds of each Tinker request's work, by primitive",
                         ["kind", "outcome"], buckets=LATENCY_BUCKETS_S)
_TRACER = telemetry.tracer("fleetrl.tinker")


@dataclass
class Request:
    """One submitted request and its eventual result."""

    id: str
    tenant: str
    kind: str
    """What it is (`ForwardBackward`, `OptimStep`, ...), for its result's encoding and for logs."""
    future: concurrent.futures.Future[Any]
    extra: dict[str, Any] = field(default_factory=dict)
    """What the submission answered besides the id (a sample's sequence ids), repeated on a replay."""


@dataclass
class _Scope:
    names: OrderedDict[int, str] = field(default_factory=OrderedDict)
    evicted_upto: int = -1
    """The highest seq_id whose name was evicted (-1: none)."""


class RequestLog:
    """Requests by id and by name; their work on one thread, in arrival order."""

    keep_per_scope: int
    _executor: concurrent.futures.Executor
    _lanes: dict[str, concurrent.futures.ThreadPoolExecutor]
    """One thread per lane, made at its first work and ended by `end_lanes`."""
    _requests: dict[str, Request]
    _scopes: dict[str, _Scope]
    _unfinished: dict[str, Request]
    """Requests queued or running, by id, kept until their work ends even after their scope is forgotten."""

    def __init__(self, executor: concurrent.futures.Executor, keep_per_scope: int = 4096) -> None:
        self.keep_per_scope = keep_per_scope
        self._executor = executor
        self._lanes = {}
        self._requests = {}
        self._scopes = {}
        self._unfinished = {}

    def queues(self, key: Key) -> bool:
        """Whether `submit` would queue new work for this name: it is neither known nor too old."""
        scope, seq_id = key
        known = self._scopes.get(scope)
        return known is None or (seq_id not in known.names and seq_id > known.evicted_upto)

    def submit(self, tenant: str, key: Key, kind: str, work: Callable[[], Any],
               extra: dict[str, Any] | None = None, lane: str | None = None) -> Request:
        """The request named `key`: the first submission's, or a new one whose work is queued on the thread (the
        lane's, when given)."""
        known = self._named(key)
        if isinstance(known, Request):
            return known
        traced = _traced(work, kind, {"tenant": tenant, "scope": key[0], "seq_id": key[1]})
        executor = self._executor if lane is None else self._lane(lane)
        return self._added(known, key[1], Request(uuid.uuid4().hex, tenant, kind, executor.submit(traced),
                                                   dict(extra or {})))

    def _lane(self, lane: str) -> concurrent.futures.ThreadPoolExecutor:
        executor = self._lanes.get(lane)
        if executor is None:
            executor = self._lanes[lane] = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tinker-lane")
        return executor

    def lanes(self) -> int:
        return len(self._lanes)

    def submit_async(self, tenant: str, key: Key, kind: str, work: Callable[[], Coroutine[Any, Any, Any]],
                     loop: asyncio.AbstractEventLoop, extra: dict[str, Any] | None = None) -> Request:
        """As `submit`, for work that waits on other processes (a sample served by an actor): it runs on
        `loop` at once, beside the thread's work, not queued behind it."""
        known = self._named(key)
        if isinstance(known, Request):
            return known
        traced = _traced_async(work, kind, {"tenant": tenant, "scope": key[0], "seq_id": key[1]})
        return self._added(known, key[1], Request(uuid.uuid4().hex, tenant, kind,
                                                   asyncio.run_coroutine_threadsafe(traced(), loop), dict(extra or {})))

    def _named(self, key: Key) -> Request | _Scope:
        """The request already named `key`, or its scope (InvalidArgument when the name is too old to run)."""
        scope, seq_id = key
        known = self._scopes.setdefault(scope, _Scope())
        if seq_id in known.names:
            return self._requests[known.names[seq_id]]
        if seq_id <= known.evicted_upto:
            raise InvalidArgument(f"request {seq_id} of {scope} is older than the last {self.keep_per_scope} "
                                  "kept; it is not run again", [FieldViolation("seq_id", "too old to replay")])
        return known

    def _added(self, known: _Scope, seq_id: int, request: Request) -> Request:
        self._requests[request.id] = request
        self._unfinished[request.id] = request
        request.future.add_done_callback(lambda _: self._unfinished.pop(request.id, None))
        known.names[seq_id] = request.id
        while len(known.names) > self.keep_per_scope:
            old_seq, old_id = known.names.popitem(last=False)
            known.evicted_upto = max(known.evicted_upto, old_seq)
            self._requests.pop(old_id, None)
        return request

    def get(self, tenant: str, request_id: str) -> Request:
        """The tenant's request `request_id`; NotFound for an unknown id or another tenant's."""
        request = self._requests.get(request_id)
        if request is None or request.tenant != tenant:
            raise NotFound(f"request {request_id!r} not found")
        return request

    async def wait(self, request: Request, timeout_s: float) -> bool:
        """True once the request has finished, False when `timeout_s` passed first."""
        if request.future.done():
            return True
        done, _ = await asyncio.wait([asyncio.wrap_future(request.future)], timeout=timeout_s)
        return bool(done)

    def unfinished(self, scope: str) -> int:
        """How many of the scope's kept requests are queued or running."""
        known = self._scopes.get(scope)
        requests = [self._requests.get(request_id) for request_id in (known.names.values() if known else ())]
        return sum(1 for request in requests if request is not None and not request.future.done())

    def in_flight(self) -> dict[str, tuple[int, int]]:
        """Each tenant's requests now (queued, running); a tenant with none is not listed."""
        counts: dict[str, tuple[int, int]] = {}
        for request in list(self._unfinished.values()):  # list(...) first: the work thread removes finished ones
            queued, running = counts.get(request.tenant, (0, 0))
            counts[request.tenant] = (queued, running + 1) if request.future.running() else (queued + 1, running)
        return counts

    def end_lanes(self, prefix: str) -> None:
        """End every lane whose name starts with prefix (a session's runs, created or not), once its work has run."""
        for lane in [name for name in self._lanes if name.startswith(prefix)]:
            self._lanes.pop(lane).shutdown(wait=False)

    def forget(self, scope: str) -> None:
        """Drop a scope's names and results (its training run or sampling session is gone)."""
        known = self._scopes.pop(scope, None)
        for request_id in (known.names.values() if known else ()):
            self._requests.pop(request_id, None)


@contextlib.contextmanager
def _work_span(kind: str, parent: otel_context.Context, attributes: dict[str, Any]) -> Iterator[None]:
    """A request's work: a span under the submitter's context, timed into WORK_SECONDS ("ok" unless it raised)."""
    outcome, start = "error", time.perf_counter()
    with _TRACER.start_as_current_span(f"tinker.{kind}", context=parent, attributes=attributes):
        try:
            yield
            outcome = "ok"
        finally:
            WORK_SECONDS.labels(kind, outcome).observe(time.perf_counter() - start)


def _traced_async(work: Callable[[], Coroutine[Any, Any, Any]], kind: str,
                  attributes: dict[str, Any]) -> Callable[[], Coroutine[Any, Any, Any]]:
    """As `_traced`, for work on the event loop."""
    parent = otel_context.get_current()

    async def run() -> Any:
        with _work_span(kind, parent, attributes):
            return await work()

    return run


def _traced(work: Callable[[], Any], kind: str, attributes: dict[str, Any]) -> Callable[[], Any]:
    """work, run in a span under the submitter's context, timed into WORK_SECONDS."""
    parent = otel_context.get_current()

    def run() -> Any:
        with _work_span(kind, parent, attributes):
            return work()

    return run
