"""The Tinker API over HTTP (aiohttp): the routes the official SDK calls, auth, errors, lifecycle.

Each handler converts the body (`convert`), calls `TinkerService`, and answers. A mutating call
answers at once with the SDK's future (`{"request_id": ...}`); the SDK then polls
`/api/v1/retrieve_future`, which waits up to `poll_s` for the result and otherwise answers
`{"type": "try_again"}` (the SDK asks again at once). Results the SDK reads as protobuf
(forward/forward_backward outputs, samples) are sent as `application/x-protobuf`, the rest as JSON.

Auth: the SDK sends its API key as `X-API-Key`; the key is a tenant token of `fleetrl.runtime.tokens`
(the gateway's). Only `/api/v1/healthz` is open.

Every call is a server span and is counted in `fleetrl_tinker_http_seconds{route, status}` (`observed`
middleware); each request's work is a span under it (`fleetrl.tinker.requests`). The metrics port also
serves the operator's per-tenant gauges (`metrics.TenantGauges`: sessions, runs, requests, against the quotas).

With `sampling = "fleet"`, `serve` also connects to NATS and wires `FleetSampling` (samples served by the
fleet's actors; `fleetrl.tinker.fleet`); with `training = "fleet"`, `LearnerTraining` (training runs held by
the fleet's learners; `fleetrl.tinker.learners`). Both share one NATS connection.

Errors are mapped once (`errors` middleware): a bad request is 400 with the field's name (the SDK's
BadRequestError), an unknown or another tenant's id 404 (NotFoundError), a bad key 401
(AuthenticationError). A request that fails while running is answered through its future as
`{"error": ..., "category": "user" | "server"}` (the SDK's RequestFailedError). Unexpected errors are
500, which the SDK retries; they are logged with their traceback.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from opentelemetry import trace
from prometheus_client import Histogram

from fleetrl.errors import (
    ConfigError,
    FailedPrecondition,
    FieldViolation,
    FleetError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    grpc_code,
)
from fleetrl.runtime import background, telemetry
from fleetrl.runtime.observe import LATENCY_BUCKETS_S, serve_metrics
from fleetrl.runtime.tokens import TokenTable, auth_table
from fleetrl.services.tinker import convert
from fleetrl.services.tinker.config import TinkerSettings
from fleetrl.services.tinker.metrics import TenantGauges, registry
from fleetrl.spec.config import redacted
from fleetrl.tasks import bus
from fleetrl.tasks.samples import SampleRequester
from fleetrl.tinker.fleet import FleetSampling
from fleetrl.tinker.learners import LearnerTraining
from fleetrl.tinker.requests import Request, RequestLog
from fleetrl.tinker.service import Limits, RunInfo, TinkerService
from fleetrl.tinker.types import ForwardResult, SampleResult
from fleetrl.weights import factory
from fleetrl.weights.channel import WeightChannel

log = logging.getLogger("fleetrl.tinker")

OPEN_PATHS = ("/api/v1/healthz",)
TENANT = web.RequestKey("tenant", str)
"""The caller's tenant, set on each request by the auth middleware."""
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504}
"""HTTP status of each gRPC status a domain error maps to (`fleetrl.errors.grpc_code`, the one mapping of
domain errors); the SDK maps these to BadRequestError, NotFoundError, ... Any other is 500."""
USER_ERRORS = (InvalidArgument, NotFound, ConfigError, FailedPrecondition)
"""Errors of a queued request that are the caller's (RequestErrorCategory user), not the server's."""
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": True,
    "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}
"""The feature flags the SDK asks for at start: plain API keys, httpx, uncompressed protobuf, per-request polls."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
HTTP_SECONDS = Histogram("fleetrl_tinker_http_seconds", "Seconds to answer each Tinker API call, by route and status",
                         ["route", "status"], buckets=LATENCY_BUCKETS_S)
_TRACER = telemetry.tracer("fleetrl.tinker")


@web.middleware
async def observed(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A server span and HTTP_SECONDS for every call, named by its route (`POST /api/v1/optim_step`)."""
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unknown"
    start, status = time.perf_counter(), 500
    with _TRACER.start_as_current_span(f"{request.method} {route}", kind=trace.SpanKind.SERVER):
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as error:
            status = error.status
            raise
        finally:
            HTTP_SECONDS.labels(route, str(status)).observe(time.perf_counter() - start)


def status_of(error: FleetError) -> int:
    return HTTP_STATUS.get(grpc_code(error), 500)


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except FleetError as error:
        violations = [{"field": v.field, "description": v.description} for v in getattr(error, "violations", [])]
        # a quota does not free itself in the SDK's retry window: 429 without its retries (RateLimitError at once)
        headers = {"x-should-retry": "false"} if isinstance(error, ResourceExhausted) else None
        return web.json_response({"error": str(error), "field_violations": violations}, status=status_of(error),
                                 headers=headers)
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return web.json_response({"error": "internal error (logged by the server)"}, status=500)


def authenticate(table: TokenTable) -> Any:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            request[TENANT] = table.tenant_for_token(request.headers.get("X-API-Key"))
        return await handler(request)

    return auth


async def _json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read() or b"{}")
    except ValueError as error:
        raise InvalidArgument(f"the body is not JSON: {error}") from None


def _answer(request: Request) -> web.Response:
    return web.json_response(convert.future(request.id, request.extra))


class Routes:
    """The handlers, over one TinkerService."""

    service: TinkerService
    poll_s: float
    tokens: TokenTable
    """Who may list every tenant's sessions (`TokenTable.viewer`)."""

    def __init__(self, service: TinkerService, poll_s: float, tokens: TokenTable) -> None:
        self.service, self.poll_s, self.tokens = service, poll_s, tokens

    def table(self) -> list[web.RouteDef]:
        v1 = "/api/v1"
        return [
            web.get(f"{v1}/healthz", self.healthz),
            web.post(f"{v1}/client/config", self.client_config),
            web.post(f"{v1}/client/dynamic_config", self.dynamic_config),
            web.post(f"{v1}/telemetry", self.telemetry),
            web.get(f"{v1}/get_server_capabilities", self.capabilities),
            web.post(f"{v1}/create_session", self.create_session),
            web.post(f"{v1}/session_heartbeat", self.heartbeat),
            web.get(f"{v1}/sessions", self.list_sessions),
            web.post(f"{v1}/sessions/{{session_id}}/finish", self.finish_session),
            web.post(f"{v1}/create_model", self.create_model),
            web.post(f"{v1}/get_info", self.get_info),
            web.post(f"{v1}/forward_backward", self.forward_backward),
            web.post(f"{v1}/optim_step", self.optim_step),
            web.post(f"{v1}/save_weights", self.save_weights),
            web.post(f"{v1}/load_weights", self.load_weights),
            web.post(f"{v1}/save_weights_for_sampler", self.save_for_sampler),
            web.post(f"{v1}/create_sampling_session", self.create_sampling_session),
            web.get(f"{v1}/samplers/{{sampler_id}}", self.get_sampler),
            web.get(f"{v1}/training_runs/{{model_id}}", self.get_training_run),
            web.get(f"{v1}/training_runs/{{model_id}}/checkpoints", self.list_checkpoints),
            web.delete(f"{v1}/training_runs/{{model_id}}/checkpoints/{{checkpoint_id:.+}}", self.delete_checkpoint),
            web.post(f"{v1}/asample", self.sample),
            web.post(f"{v1}/retrieve_future", self.retrieve_future),
        ]

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def client_config(self, request: web.Request) -> web.Response:
        return web.json_response(CLIENT_CONFIG)

    async def dynamic_config(self, request: web.Request) -> web.Response:
        return web.json_response({"sample_cancel_enabled": False})

    async def telemetry(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "accepted"})  # the SDK's own diagnostics; not kept

    async def capabilities(self, request: web.Request) -> web.Response:
        models = [{"model_name": name, "trainable": True, "sampleable": True} for name in self.service.capabilities()]
        return web.json_response({"supported_models": models})

    async def create_session(self, request: web.Request) -> web.Response:
        convert.parse(convert.CreateSession, await _json(request))
        session_id = self.service.create_session(request[TENANT])
        return web.json_response({"type": "create_session", "session_id": session_id})

    async def heartbeat(self, request: web.Request) -> web.Response:
        body = convert.parse(convert.SessionRef, await _json(request))
        if self.service.heartbeat(request[TENANT], body.session_id).finished:
            raise web.HTTPGone(text="session finished")
        return web.json_response({"type": "session_heartbeat"})

    async def list_sessions(self, request: web.Request) -> web.Response:
        page = convert.parse(convert.ListSessions, dict(request.query))
        viewer = self.tokens.viewer(request[TENANT], page.all_tenants)
        return web.json_response(convert.sessions_page(self.service.sessions(viewer), page))

    async def finish_session(self, request: web.Request) -> web.Response:
        self.service.finish_session(request[TENANT], request.match_info["session_id"])
        return web.json_response({})

    async def create_model(self, request: web.Request) -> web.Response:
        body = convert.parse(convert.CreateModel, await _json(request))
        return _answer(self.service.create_model(request[TENANT], body.session_id, body.model_seq_id,
                                                 body.base_model, body.lora()))

    async def get_info(self, request: web.Request) -> web.Response:
        body = convert.parse(convert.ModelRef, await _json(request))
        run = self.service.model_info(request[TENANT], body.model_id)
        return web.json_response({
            "type": "get_info", "model_id": run.model_id, "model_name": run.base_model, "is_lora": True,
            "lora_rank": run.lora.rank, "optimizer_config": {"type": "adamw"},
            "model_data": {"arch": run.arch, "model_name": run.base_model, "tokenizer_id": run.tokenizer_id}})

    async def forward_backward(self, request: web.Request) -> web.Response:
        message = convert.forward_backward(await request.read(), request.headers.get("Content-Encoding"))
        return _answer(self.service.forward_backward(
            request[TENANT], message.model_id, message.seq_id, convert.datums(message), message.loss_fn,
            convert.loss_settings(message), message.forward_only))

    async def optim_step(self, request: web.Request) -> web.Response:
        body = convert.parse(convert.OptimStep, await _json(request))
        return _answer(self.service.optim_step(request[TENANT], body.model_id, body.seq_id, body.adam()))

    async def save_weights(self, request: web.Request) -> web.Response:
        body = convert.parse(convert.SaveWeights, await _json(request))
        return _answer(self.service.save_state(request[TENANT], body.model_id, body.seq_id, body.path))

    async def load_weights(self, request: web.Request) -> web.Response:
        body = convert.parse(convert.LoadWeights, await _json(request))
        tenant = request[TENANT]
        if body.session_id is not None and body.model_seq_id is not None:
            return _answer(self.service.create_from_state(tenant, body.session_id, body.model_seq_id, body.path,
                                                          body.optimizer))
        if body.model_id is None or body.seq_id is None:
            raise InvalidArgument("load_weights needs model_id and seq_id, or session_id and model_seq_id")
        return _answer(self.service.load_state(tenant, body.model_id, body.seq_id, body.path, body.optimizer))

    async def save_for_sampler(self, request: web.Request) -> web.Response:
        body = convert.parse(convert.SaveForSampler, await _json(request)).checked()
        return _answer(self.service.save_for_sampler(request[TENANT], body.model_id, body.seq_id, body.path))

    async def create_sampling_session(self, request: web.Request) -> web.Response:
        body = convert.parse(convert.CreateSamplingSession, await _json(request))
        session = await asyncio.get_running_loop().run_in_executor(  # reads a checkpoint from disk
            None, self.service.create_sampling_session, request[TENANT], body.session_id, body.base_model,
            body.model_path)
        return web.json_response({"type": "create_sampling_session", "sampling_session_id": session.id})

    async def get_sampler(self, request: web.Request) -> web.Response:
        session = self.service.sampler(request[TENANT], request.match_info["sampler_id"])
        return web.json_response({"sampler_id": session.id, "base_model": session.weights.base_model,
                                  "model_path": session.model_path})

    async def get_training_run(self, request: web.Request) -> web.Response:
        info = await self._run_info(request)
        return web.json_response(convert.training_run(info))

    async def list_checkpoints(self, request: web.Request) -> web.Response:
        info = await self._run_info(request)
        return web.json_response({"checkpoints": [convert.checkpoint(c) for c in info.checkpoints]})

    async def _run_info(self, request: web.Request) -> RunInfo:
        return await asyncio.get_running_loop().run_in_executor(  # lists checkpoints on disk
            None, self.service.run_info, request[TENANT], request.match_info["model_id"])

    async def delete_checkpoint(self, request: web.Request) -> web.Response:
        await asyncio.get_running_loop().run_in_executor(
            None, self.service.delete_checkpoint, request[TENANT], request.match_info["model_id"],
            request.match_info["checkpoint_id"])
        return web.json_response(None)

    async def sample(self, request: web.Request) -> web.Response:
        body = convert.parse(convert.Sample, await _json(request))
        if body.sampling_session_id is None or body.seq_id is None:
            raise convert.unsupported("sampling_session_id", "required (with seq_id): sample through a SamplingClient")
        return _answer(self.service.sample(request[TENANT], body.sampling_session_id, body.seq_id, body.params()))

    async def retrieve_future(self, request: web.Request) -> web.Response:
        body = convert.parse(convert.Retrieve, await _json(request))
        queued = self.service.log.get(request[TENANT], body.request_id)
        if not await self.service.log.wait(queued, self.poll_s):
            return web.json_response({"type": "try_again", "request_id": queued.id, "queue_state": "active"})
        error = queued.future.exception()
        if error is not None:
            user = isinstance(error, USER_ERRORS)
            if not user:
                log.error("%s %s failed", queued.kind, queued.id, exc_info=error)
            return web.json_response({"error": str(error) if user else f"{type(error).__name__}: {error}",
                                      "category": "user" if user else "server"})
        result = queued.future.result()
        if isinstance(result, ForwardResult):
            return web.Response(body=convert.forward_output(result), content_type=convert.PROTO)
        if isinstance(result, SampleResult):
            return web.Response(body=convert.sample_output(result), content_type=convert.PROTO)
        return web.json_response(result)


async def reap_loop(service: TinkerService, idle_s: float) -> None:
    """Finish sessions whose client stopped sending heartbeats, every idle_s / 4 (freeing their runs)."""
    while True:
        await asyncio.sleep(idle_s / 4)
        reaped = service.reap(idle_s)
        if reaped:
            log.info("finished %d sessions silent for over %gs: %s", len(reaped), idle_s, reaped)


def limits_of(settings: TinkerSettings) -> Limits:
    return Limits(settings.allowed_models, settings.allowed_model_roots, settings.run_dir, settings.max_lora_rank,
                  settings.max_sample_tokens, settings.max_num_samples, settings.max_sessions_per_tenant,
                  settings.max_training_runs_per_tenant)


async def serve(settings: TinkerSettings, stop: asyncio.Event,
                on_start: Callable[[int], None] | None = None) -> None:
    """Serve the Tinker API until stop is set; on_start gets the bound port."""
    async with contextlib.AsyncExitStack() as stack:
        fleet = learners = None
        if "fleet" in (settings.sampling, settings.training):
            nc = await bus.connect(settings.nats_url, "tinker", tls_ca_file=settings.tls_ca_file)
            stack.push_async_callback(_drain, nc)
            js = bus.jetstream(nc)
            weights = WeightChannel(factory.transport(settings.weights_dir, nc, js))
            service_id = f"tinker-{uuid.uuid4().hex[:16]}"
            if settings.sampling == "fleet":
                fleet = await fleet_sampling(settings, stack, js, weights, service_id)
            if settings.training == "fleet":
                learners = LearnerTraining(nc, weights.transport, asyncio.get_running_loop(), service_id,
                                           timeout_s=settings.train_timeout_s)
                stack.push_async_callback(_purged, learners)
                log.info("training runs live on the fleet's learners (NATS %s)", redacted(settings.nats_url))
        await _serve(settings, stop, on_start, fleet, learners)


async def fleet_sampling(settings: TinkerSettings, stack: contextlib.AsyncExitStack, js: JetStreamContext,
                         weights: WeightChannel, service_id: str) -> FleetSampling:
    """Samples on the fleet's actors: the sample streams, this process's results subject."""
    await bus.ensure_sample_streams(js)
    requester = SampleRequester(js, service_id)
    await requester.start()
    stack.push_async_callback(requester.close)
    log.info("samples are served by the fleet's actors (NATS %s)", redacted(settings.nats_url))
    return FleetSampling(weights, requester, asyncio.get_running_loop(),
                         keep=settings.sampler_versions_kept, timeout_s=settings.sample_timeout_s)


async def _purged(learners: LearnerTraining) -> None:
    """Delete what is left in the exchange namespace (bodies whose reader died), bounded."""
    try:
        await asyncio.wait_for(learners.purge(), bus.REQUEST_TIMEOUT_S)
    except Exception as error:  # stopping either way
        log.warning("purging the exchange namespace %s failed: %s", learners.namespace, error)


async def _drain(nc: NATS) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.drain(), bus.REQUEST_TIMEOUT_S)


async def _serve(settings: TinkerSettings, stop: asyncio.Event, on_start: Callable[[int], None] | None,
                 fleet: FleetSampling | None, learners: LearnerTraining | None) -> None:
    table = auth_table(settings, "tinker", log)
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tinker-work")
    service = TinkerService(limits_of(settings), RequestLog(executor, settings.keep_requests_per_scope), fleet,
                            learners)
    telemetry.setup_tracing("tinker", settings.run_dir)
    metrics = serve_metrics(settings.metrics_port, registry(TenantGauges(service, table.tenants())))
    app = web.Application(middlewares=[observed, errors, authenticate(table)],
                          client_max_size=int(settings.max_request_mb * 1024 * 1024))
    app.add_routes(Routes(service, settings.poll_s, table).table())
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=settings.grace_s)
    await runner.setup()
    host, _, port = settings.listen.rpartition(":")
    try:
        site = web.TCPSite(runner, host or "127.0.0.1", int(port))
        try:
            await site.start()
        except OSError as error:
            raise ConfigError("tinker settings", [FieldViolation("listen", f"{settings.listen}: {error}")]) from None
        bound = runner.addresses[0][1]
        log.info("tinker API on http://%s:%d (checkpoints under %s)", host or "127.0.0.1", bound,
                 settings.run_dir / "tinker")
        if on_start is not None:
            on_start(bound)
        reaper = asyncio.create_task(reap_loop(service, settings.session_idle_s))
        await stop.wait()
        await background.stop(reaper)
    finally:
        await runner.cleanup()
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()
        executor.shutdown(wait=False, cancel_futures=True)
