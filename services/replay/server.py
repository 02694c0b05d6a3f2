"""The gRPC ReplayService: a thin adapter over `ReplayTables`, plus the process lifecycle.

Each RPC converts its request (`convert`), calls the domain core and converts the
result; `map_errors` maps domain errors to status codes in one place. `serve`
owns Redis, the gRPC server, the lease-reclaim task and the metrics endpoint in
one AsyncExitStack; a failure of the background task stops the server instead
of dying silently. Spans and per-RPC metrics come from `observe.ObservingInterceptor`; the
background task also refreshes the table-size gauges every reclaim_interval_s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from fleetrl.errors import ResourceExhausted
from fleetrl.proto.fleetrl.v1 import replay_pb2, replay_pb2_grpc
from fleetrl.replay.table import ReplayTables
from fleetrl.runtime import background, redisutil, telemetry
from fleetrl.runtime.grpcutil import map_errors, start_server, stop_server
from fleetrl.runtime.observe import ObservingInterceptor, serve_metrics
from fleetrl.services.replay import convert
from fleetrl.services.replay.config import ReplaySettings
from fleetrl.spec.config import redacted

log = logging.getLogger(__name__)


class Metrics:
    """Prometheus metrics of this process, in a private registry."""

    registry: CollectorRegistry
    groups: Gauge
    leased: Gauge
    inserted: Counter
    duplicates: Counter
    evicted: Counter
    sampled: Counter
    committed: Counter
    stale_dropped: Counter
    expired_leases: Counter

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.groups = Gauge("fleetrl_replay_groups", "Groups stored per job", ["job"], registry=self.registry)
        self.leased = Gauge("fleetrl_replay_leased_groups", "Stored groups under a lease per job", ["job"],
                            registry=self.registry)
        for name, doc in [("inserted", "Groups inserted"), ("duplicates", "Inserts dropped as duplicates"),
                          ("evicted", "Groups evicted for capacity"), ("sampled", "Groups leased by Sample"),
                          ("committed", "Groups committed"), ("stale_dropped", "Groups dropped as stale")]:
            setattr(self, name, Counter(f"fleetrl_replay_{name}", doc, ["job"], registry=self.registry))
        self.expired_leases = Counter("fleetrl_replay_expired_leases", "Leases reclaimed by this process",
                                      registry=self.registry)


class ReplayServicer(replay_pb2_grpc.ReplayServiceServicer):
    """ReplayService RPCs over one ReplayTables."""

    tables: ReplayTables
    settings: ReplaySettings
    metrics: Metrics

    def __init__(self, tables: ReplayTables, settings: ReplaySettings, metrics: Metrics) -> None:
        self.tables = tables
        self.settings = settings
        self.metrics = metrics

    @map_errors
    async def ConfigureTable(self, request: replay_pb2.ConfigureTableRequest,
                             context: grpc.aio.ServicerContext) -> replay_pb2.TableInfo:
        cfg = convert.to_table_config(request)
        size = await self.tables.configure(request.job_id, cfg, request.lease_epoch)
        log.info("configured table of job %s: %s", request.job_id, cfg)
        return convert.table_info(request.job_id, cfg, size)

    @map_errors
    async def Insert(self, request: bytes, context: grpc.aio.ServicerContext) -> replay_pb2.InsertResponse:
        records = convert.to_records(request, self.settings.max_request_bytes)
        outcomes, evicted = await self.tables.insert(records)
        for record, ok in zip(records, outcomes, strict=True):
            (self.metrics.inserted if ok else self.metrics.duplicates).labels(record.job_id).inc()
        if evicted:
            self.metrics.evicted.labels(records[0].job_id).inc(evicted)
        return convert.insert_response(outcomes, evicted)

    @map_errors
    async def Sample(self, request: replay_pb2.SampleRequest,
                     context: grpc.aio.ServicerContext) -> bytes:
        job = convert.require_job(request.job_id)
        max_groups = min(request.max_groups or 1, self.settings.max_groups_per_sample)
        wait_s = max(0.0, min(request.wait_s, self.settings.max_wait_s))
        result = await self.tables.sample(job, max_groups, request.min_policy_version, wait_s, request.seed)
        self.metrics.sampled.labels(job).inc(len(result.payloads))
        self.metrics.stale_dropped.labels(job).inc(result.stale_dropped)
        return convert.sample_response(result)

    @map_errors
    async def Commit(self, request: replay_pb2.CommitRequest,
                     context: grpc.aio.ServicerContext) -> replay_pb2.CommitResponse:
        n = await self.tables.commit(convert.require_job(request.job_id), request.lease_id, request.lease_epoch)
        self.metrics.committed.labels(request.job_id).inc(n)
        return replay_pb2.CommitResponse(committed_groups=n)

    @map_errors
    async def Release(self, request: replay_pb2.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> replay_pb2.ReleaseResponse:
        n = await self.tables.release(convert.require_job(request.job_id), request.lease_id)
        return replay_pb2.ReleaseResponse(released_groups=n)

    @map_errors
    async def Renew(self, request: replay_pb2.RenewRequest,
                    context: grpc.aio.ServicerContext) -> replay_pb2.RenewResponse:
        missing, expires = await self.tables.renew(convert.require_job(request.job_id), list(request.lease_ids))
        return replay_pb2.RenewResponse(missing_lease_ids=missing, lease_expires_unix_ms=expires)

    @map_errors
    async def Stats(self, request: replay_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> replay_pb2.TableStats:
        stats = await self.tables.stats(convert.require_job(request.job_id))
        self.metrics.groups.labels(request.job_id).set(stats.size_groups)
        return convert.stats_to_proto(stats)

    @map_errors
    async def Query(self, request: replay_pb2.QueryRequest,
                    context: grpc.aio.ServicerContext) -> replay_pb2.QueryResponse:
        rows = await self.tables.query(request.job_id, *convert.query_args(request))
        return convert.query_response(rows)


RAW_REQUESTS = frozenset({"Insert"})
RAW_RESPONSES = frozenset({"Sample"})


def _identity(data: bytes) -> bytes:
    return data


def add_to_server(servicer: ReplayServicer, server: grpc.aio.Server) -> str:
    """Register the servicer like the generated code does, but with raw bytes for Insert's request
    and Sample's response (see `wire`). Returns the full service name."""
    service = replay_pb2.DESCRIPTOR.services_by_name["ReplayService"]
    handlers = {}
    for method in service.methods:
        request_cls = getattr(replay_pb2, method.input_type.name)
        response_cls = getattr(replay_pb2, method.output_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name),
            request_deserializer=_identity if method.name in RAW_REQUESTS else request_cls.FromString,
            response_serializer=_identity if method.name in RAW_RESPONSES else response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
    return str(service.full_name)


@dataclass
class Running:
    """A started replay service: its bound port, its core, its background task and its metrics."""

    port: int
    tables: ReplayTables
    background: asyncio.Task[None]
    metrics: Metrics


async def reclaim_loop(tables: ReplayTables, metrics: Metrics, interval_s: float) -> None:
    """Return expired leases' groups even when nobody samples; Redis restarting or full: the next period
    tries again."""
    async def reclaim() -> None:
        metrics.expired_leases.inc(await tables.reclaim_all())
        await refresh_sizes(tables, metrics)

    await background.repeat(reclaim, interval_s, what="lease reclaim", retried=(ConnectionError, ResourceExhausted),
                            first_after=True)


async def refresh_sizes(tables: ReplayTables, metrics: Metrics) -> None:
    """Set the stored and leased gauges of every job's table."""
    for job in await tables.jobs():
        stats = await tables.stats(job)
        metrics.groups.labels(job).set(stats.size_groups)
        metrics.leased.labels(job).set(stats.leased_groups)


@contextlib.asynccontextmanager
async def running(settings: ReplaySettings) -> AsyncIterator[Running]:
    """Run the service until the context exits (then stop gracefully)."""
    async with contextlib.AsyncExitStack() as stack:
        client = redisutil.client(settings.redis_url, tls_ca_file=settings.tls_ca_file, health_check_interval=10,
                                  socket_timeout=30, retry_on_timeout=False)
        stack.push_async_callback(client.aclose)
        tables = ReplayTables(client, max_lineage_records=settings.max_lineage_records,
                              poll_interval_s=settings.poll_interval_s, fsync_timeout_s=settings.insert_fsync_timeout_s)
        if settings.check_maxmemory_policy:
            await tables.check_redis()
        await tables.check_fsync()
        telemetry.setup_tracing("replay", settings.run_dir)
        metrics = Metrics()
        serve_metrics(settings.metrics_port, metrics.registry)
        servicer = ReplayServicer(tables, settings, metrics)

        server, port, health = await start_server(settings.listen, [lambda s: add_to_server(servicer, s)],
                                                  interceptors=[ObservingInterceptor(metrics.registry)])
        stack.push_async_callback(stop_server, server, health, settings.grace_s)
        reclaim = asyncio.create_task(reclaim_loop(tables, metrics, settings.reclaim_interval_s))
        stack.push_async_callback(background.stop, reclaim)
        log.info("replay service on port %d, redis %s", port, redacted(settings.redis_url))
        yield Running(port, tables, reclaim, metrics)


async def serve(settings: ReplaySettings, stop: asyncio.Event) -> None:
    """Serve until `stop` is set or the background task fails."""
    async with running(settings) as svc:
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait([stopped, svc.background], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if svc.background.done():
            svc.background.result()
