"""Tinker's futures: every mutating request gets an id at once and its result later, exactly once.

A request is named by the client: (scope, seq_id), where the scope is a training run's model_id, a
sampling session, or a session's create_model counter, and seq_id the SDK's per-client counter. The
first submission of a name runs its work; a later submission of the same name (an SDK retry after a
lost response, or a replay) gets the first one's request id, and so its result, and runs nothing.
So an optim_step is applied at most once per (model_id, seq_id).

Work runs on one executor thread, in the order requests arrive (the SDK sends a training client's
requests in seq_id order). Results are kept until their name leaves the table: each scope keeps its
last `keep_per_scope` names, and a name older than those is refused (InvalidArgument) instead of
being run again, which keeps the at-most-once promise after eviction.

Design choice: request ids are random (uuid4), never derived from the name, and each records its
tenant, so a request id from another tenant reads as unknown (NotFound) rather than leaking a result.

Each request's work is a span (`tinker.<kind>`, with the tenant, scope and seq_id; child of the HTTP
request's span) and is counted in `fleetrl_tinker_work_seconds{kind, outcome}`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
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
    _requests: dict[str, Request]
    _scopes: dict[str, _Scope]

    def __init__(self, executor: concurrent.futures.Executor, keep_per_scope: int = 4096) -> None:
        self.keep_per_scope = keep_per_scope
        self._executor = executor
        self._requests = {}
        self._scopes = {}

    def queues(self, key: Key) -> bool:
        """Whether `submit` would queue new work for this name: it is neither known nor too old."""
        scope, seq_id = key
        known = self._scopes.get(scope)
        return known is None or (seq_id not in known.names and seq_id > known.evicted_upto)

    def submit(self, tenant: str, key: Key, kind: str, work: Callable[[], Any],
               extra: dict[str, Any] | None = None) -> Request:
        """The request named `key`: the first submission's, or a new one whose work is queued."""
        scope, seq_id = key
        known = self._scopes.setdefault(scope, _Scope())
        if seq_id in known.names:
            return self._requests[known.names[seq_id]]
        if seq_id <= known.evicted_upto:
            raise InvalidArgument(f"request {seq_id} of {scope} is older than the last {self.keep_per_scope} "
                                  "kept; it is not run again", [FieldViolation("seq_id", "too old to replay")])
        traced = _traced(work, kind, {"tenant": tenant, "scope": scope, "seq_id": seq_id})
        request = Request(uuid.uuid4().hex, tenant, kind, self._executor.submit(traced), dict(extra or {}))
        self._requests[request.id] = request
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

    def forget(self, scope: str) -> None:
        """Drop a scope's names and results (its training run or sampling session is gone)."""
        known = self._scopes.pop(scope, None)
        for request_id in (known.names.values() if known else ()):
            self._requests.pop(request_id, None)


def _traced(work: Callable[[], Any], kind: str, attributes: dict[str, Any]) -> Callable[[], Any]:
    """work, run in a span under the submitter's context, timed into WORK_SECONDS."""
    parent = otel_context.get_current()

    def run() -> Any:
        outcome, start = "error", time.perf_counter()
        with _TRACER.start_as_current_span(f"tinker.{kind}", context=parent, attributes=attributes):
            try:
                result = work()
                outcome = "ok"
                return result
            finally:
                WORK_SECONDS.labels(kind, outcome).observe(time.perf_counter() - start)

    return run
