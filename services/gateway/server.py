"""The gRPC JobService: a thin adapter over `service.Gateway`, plus the process lifecycle.

Each RPC converts its request, calls the core as the caller's tenant (`auth.current_tenant`) and
converts the result; `map_errors` maps domain errors to status codes in one place. Requests are
deserialised by a wrapper that turns undecodable bytes into INVALID_ARGUMENT instead of gRPC's
INTERNAL. `serve` owns Redis, NATS, the reward channel and the gRPC server in one AsyncExitStack.
Every call is traced and counted by `observe.ObservingInterceptor` (outside the auth interceptor, so
refused calls count too); /metrics is served on metrics_port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from prometheus_client import Gauge

from fleetrl.errors import InvalidArgument
from fleetrl.jobs.store import JobStore
from fleetrl.proto.fleetrl.v1 import gateway_pb2, gateway_pb2_grpc
from fleetrl.reward.client import RewardClient
from fleetrl.runtime import background, grpcutil, telemetry
from fleetrl.runtime.grpcutil import map_errors, map_stream_errors
from fleetrl.runtime.observe import ObservingInterceptor, serve_metrics
from fleetrl.runtime.tokens import auth_table
from fleetrl.services.gateway import convert
from fleetrl.services.gateway.adapters import FleetProbe, JetStreamEvents, JetStreamPurger, StoreDeleter
from fleetrl.services.gateway.auth import AuthInterceptor, TokenTable, current_tenant
from fleetrl.services.gateway.checks import Admission, Limits
from fleetrl.services.gateway.config import GatewaySettings
from fleetrl.services.gateway.service import Gateway
from fleetrl.spec.config import read_bytes
from fleetrl.tasks import bus
from fleetrl.weights import factory

log = logging.getLogger(__name__)
RETENTION_CHECK_S = 60.0
"""How often the gateway looks for finished jobs past their retention."""
BACKLOG_CHECK_S = 5.0
"""How often the gateway reads every active job's queue into TASK_BACKLOG (KEDA polls every 15 s)."""
TASK_BACKLOG = Gauge("fleetrl_gateway_task_backlog",
                     "Tasks queued or in flight over every active job, read every few seconds: the actors' "
                     "autoscaling metric (deploy/k8s/base/actor.yaml)")
SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["JobService"].full_name


class Undecodable:
    """Stands in for a request whose bytes do not parse; the servicer answers INVALID_ARGUMENT."""

    type_name: str
    error: str

    def __init__(self, type_name: str, error: str) -> None:
        self.type_name, self.error = type_name, error


def _require(request: Any) -> None:
    if isinstance(request, Undecodable):
        raise InvalidArgument(f"request is not a valid {request.type_name}: {request.error}")


class JobServicer(gateway_pb2_grpc.JobServiceServicer):
    """JobService RPCs over one Gateway."""

    gateway: Gateway
    max_list: int
    tokens: TokenTable
    """Who may list every tenant's rows (`TokenTable.viewer`)."""

    def __init__(self, gateway: Gateway, max_list: int, tokens: TokenTable) -> None:
        self.gateway, self.max_list, self.tokens = gateway, max_list, tokens

    @map_errors
    async def SubmitJob(self, request: gateway_pb2.SubmitJobRequest, context: Any) -> gateway_pb2.Job:
        _require(request)
        return convert.job_to_proto(await self.gateway.submit(current_tenant(), convert.to_submission(request)))

    @map_errors
    async def GetJob(self, request: gateway_pb2.GetJobRequest, context: Any) -> gateway_pb2.Job:
        _require(request)
        return convert.job_to_proto(await self.gateway.get(current_tenant(), request.job_id))

    @map_errors
    async def ListJobs(self, request: gateway_pb2.ListJobsRequest, context: Any) -> gateway_pb2.ListJobsResponse:
        _require(request)
        viewer = self.tokens.viewer(current_tenant(), request.all_tenants)
        records = await self.gateway.list_jobs(viewer, min(request.limit or 50, self.max_list))
        return gateway_pb2.ListJobsResponse(jobs=[convert.job_to_proto(r) for r in records])

    @map_errors
    async def DeleteJob(self, request: gateway_pb2.DeleteJobRequest, context: Any) -> gateway_pb2.DeleteJobResponse:
        _require(request)
        held = await self.gateway.delete(current_tenant(), request.job_id)
        return gateway_pb2.DeleteJobResponse(
            redis_keys=held.redis_keys, redis_bytes=held.redis_bytes, nats_messages=held.nats_messages,
            nats_bytes=held.nats_bytes, disk_files=held.disk_files, disk_bytes=held.disk_bytes)

    @map_errors
    async def CancelJob(self, request: gateway_pb2.CancelJobRequest, context: Any) -> gateway_pb2.Job:
        _require(request)
        return convert.job_to_proto(await self.gateway.cancel(current_tenant(), request.job_id, request.reason))

    @map_stream_errors
    async def WatchJob(self, request: gateway_pb2.WatchJobRequest, context: Any) -> AsyncIterator[gateway_pb2.JobEvent]:
        _require(request)
        async for event in self.gateway.watch(current_tenant(), request.job_id, request.from_step):
            yield convert.event_to_proto(event)

    @map_errors
    async def GetFleet(self, request: gateway_pb2.GetFleetRequest, context: Any) -> gateway_pb2.FleetStatus:
        _require(request)
        viewer = self.tokens.viewer(current_tenant(), request.all_tenants)
        return convert.fleet_to_proto(await self.gateway.fleet(viewer))

    @map_errors
    async def GetJobAccounting(self, request: gateway_pb2.GetJobAccountingRequest,
                               context: Any) -> gateway_pb2.JobAccounting:
        _require(request)
        accounting = await self.gateway.accounting(current_tenant(), request.job_id)
        return convert.accounting_to_proto(accounting, request.include_tasks)

    @map_stream_errors
    async def DownloadModel(self, request: gateway_pb2.DownloadModelRequest,
                            context: Any) -> AsyncIterator[gateway_pb2.FileChunk]:
        _require(request)
        async for chunk in self.gateway.model_chunks(current_tenant(), request.job_id, request.merged):
            yield convert.chunk_to_proto(chunk)


def _safe_deserializer(message_cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except Exception as error:  # protobuf's DecodeError, or a string field that is not UTF-8
            return Undecodable(message_cls.DESCRIPTOR.full_name, str(error) or type(error).__name__)

    return parse


def add_job_service(servicer: JobServicer) -> Callable[[grpc.aio.Server], str]:
    """A register function for start_server, with undecodable requests kept away from gRPC's INTERNAL."""

    def register(server: grpc.aio.Server) -> str:
        service = gateway_pb2.DESCRIPTOR.services_by_name["JobService"]
        handlers = {}
        for method in service.methods:
            request_cls = getattr(gateway_pb2, method.input_type.name)
            response_cls = getattr(gateway_pb2, method.output_type.name)
            make = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                    else grpc.unary_unary_rpc_method_handler)
            handlers[method.name] = make(getattr(servicer, method.name),
                                         request_deserializer=_safe_deserializer(request_cls),
                                         response_serializer=response_cls.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
        return service.full_name

    return register


def server_credentials(settings: GatewaySettings) -> grpc.ServerCredentials | None:
    """TLS credentials from tls_key and tls_cert; ConfigError naming the file that cannot be read."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    key, cert = read_bytes(settings.tls_key, "tls_key"), read_bytes(settings.tls_cert, "tls_cert")
    return grpc.ssl_server_credentials([(key, cert)])


def token_table(settings: GatewaySettings) -> TokenTable:
    """The auth table; refuses a closed gateway without tokens, shouts about open mode."""
    return auth_table(settings, "gateway", log)


async def retention_loop(gateway: Gateway, retention_s: float) -> None:
    """Delete finished jobs older than retention_s, every RETENTION_CHECK_S (a failed pass is retried)."""
    async def expire() -> None:
        deleted = await gateway.expire(retention_s)
        if deleted:
            log.info("retention: deleted %d finished jobs older than %gs: %s", len(deleted), retention_s, deleted)

    await background.repeat(expire, min(RETENTION_CHECK_S, retention_s), what="retention pass")


async def backlog_loop(gateway: Gateway) -> None:
    """Keep TASK_BACKLOG current. A failed read (NATS away) leaves the last figure: the autoscaler then holds
    the actor count rather than scaling the fleet down in an outage."""
    async def read() -> None:
        TASK_BACKLOG.set(await gateway.backlog())

    await background.repeat(read, BACKLOG_CHECK_S, what="task backlog read")


async def serve(settings: GatewaySettings, stop: asyncio.Event,
                on_start: Callable[[int], None] | None = None) -> None:
    """Run the gateway until stop is set."""
    table = token_table(settings)
    telemetry.setup_tracing("gateway", settings.run_dir)
    serve_metrics(settings.metrics_port)
    async with contextlib.AsyncExitStack() as stack:
        store = JobStore.from_url(settings.redis_url, tls_ca_file=settings.tls_ca_file)
        stack.push_async_callback(store.close)
        nc = await bus.connect(settings.nats_url, "gateway", tls_ca_file=settings.tls_ca_file)
        stack.push_async_callback(nc.drain)
        js = bus.jetstream(nc)
        await bus.ensure_streams(js)
        reward = RewardClient(settings.reward_addr, timeout_s=settings.reward_validate_timeout_s)
        stack.push_async_callback(reward.close)
        gateway = Gateway(
            store, reward,
            JetStreamPurger(js), JetStreamEvents(js), FleetProbe(store.redis, js),
            Limits(int(settings.max_prompts_mb * 1024 * 1024), int(settings.max_reward_file_kb * 1024)),
            Admission.of(settings),
            deleter=StoreDeleter(store.redis, js, settings.run_dir, factory.transport(settings.weights_dir, nc, js)),
            poll_s=settings.watch_poll_s, chunk_bytes=settings.download_chunk_kb * 1024,
        )
        backlog = asyncio.create_task(backlog_loop(gateway))
        stack.push_async_callback(background.stop, backlog)
        if settings.retention_s is not None:
            expiring = asyncio.create_task(retention_loop(gateway, settings.retention_s))
            stack.push_async_callback(background.stop, expiring)
        server, port, health_servicer = await grpcutil.start_server(
            settings.listen, [add_job_service(JobServicer(gateway, settings.max_list_jobs, table))],
            interceptors=[ObservingInterceptor(), AuthInterceptor(table)], credentials=server_credentials(settings),
            max_receive_bytes=int(settings.max_message_mb * 1024 * 1024))
        log.info("gateway listening on %s (port %d, %s)", settings.listen, port,
                 "TLS" if settings.tls_cert else "plaintext")
        if on_start is not None:
            on_start(port)
        await stop.wait()
        log.info("gateway stopping (grace %.1fs)", settings.grace_s)
        await grpcutil.stop_server(server, health_servicer, settings.grace_s)
