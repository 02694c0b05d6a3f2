"""The gRPC RewardService: a thin adapter over `Scorer`, plus the process lifecycle.

Score, Validate and Describe (the sandbox found at start-up) convert the request (`convert`), call
the scorer and convert back; `map_errors` maps domain errors to status codes. `running` owns the
scorer (all worker processes), the gRPC server, the idle-pool reaper and the metrics endpoint; a
failure of the reaper stops the service instead of dying silently. Spans and per-RPC metrics come
from `observe.ObservingInterceptor`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from services.common import telemetry
from services.common.errors import ConfigError
from services.common.grpcutil import map_errors, start_server, stop_server
from services.common.observe import ObservingInterceptor, serve_metrics
from services.proto.fleetrl.v1 import reward_pb2, reward_pb2_grpc
from services.reward import convert
from services.reward.config import RewardSettings
from services.reward.scorer import Scorer

log = logging.getLogger(__name__)


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """RewardService RPCs over one Scorer."""

    scorer: Scorer

    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer

    @map_errors
    async def Score(self, request: reward_pb2.ScoreRequest,
                    context: grpc.aio.ServicerContext) -> reward_pb2.ScoreResponse:
        spec = convert.to_spec(request.spec)
        results = await self.scorer.score(request.job_id, spec, convert.to_items(request))
        return convert.score_response(results)

    @map_errors
    async def Validate(self, request: reward_pb2.ValidateRequest,
                       context: grpc.aio.ServicerContext) -> reward_pb2.ValidateResponse:
        spec = convert.to_spec(request.spec)
        sandbox = convert.sandbox_report(self.scorer.sandbox_for(spec.spec))
        try:
            await self.scorer.validate(spec)
        except ConfigError as error:
            return reward_pb2.ValidateResponse(ok=False, reason=str(error), sandbox=sandbox)
        return reward_pb2.ValidateResponse(ok=True, sandbox=sandbox)

    @map_errors
    async def Describe(self, request: reward_pb2.DescribeRequest,
                       context: grpc.aio.ServicerContext) -> reward_pb2.SandboxReport:
        return convert.sandbox_report(self.scorer.sandbox)


@dataclass
class Running:
    """A started reward service: its bound port, its scorer and its reaper task."""

    port: int
    scorer: Scorer
    background: asyncio.Task[None]


async def reap_loop(scorer: Scorer, interval_s: float) -> None:
    """Close pools that have been idle for pool_idle_s."""
    while True:
        await asyncio.sleep(interval_s)
        closed = await scorer.reap_idle()
        if closed:
            log.info("closed %d idle reward pool(s)", closed)


@contextlib.asynccontextmanager
async def running(settings: RewardSettings) -> AsyncIterator[Running]:
    """Run the service until the context exits, then stop gracefully and kill every worker."""
    async with contextlib.AsyncExitStack() as stack:
        telemetry.setup_tracing("reward", settings.run_dir)
        scorer = Scorer(settings)
        stack.push_async_callback(scorer.close)
        servicer = RewardServicer(scorer)
        server, port, health = await start_server(
            settings.listen, [lambda s: _register(servicer, s)],
            interceptors=[ObservingInterceptor(scorer.metrics.registry)])
        stack.push_async_callback(stop_server, server, health, settings.grace_s)
        serve_metrics(settings.metrics_port, scorer.metrics.registry)
        background = asyncio.get_running_loop().create_task(
            reap_loop(scorer, min(60.0, settings.pool_idle_s / 2)))
        stack.callback(background.cancel)
        log.info("reward service listening on port %d", port)
        yield Running(port, scorer, background)


def _register(servicer: RewardServicer, server: grpc.aio.Server) -> str:
    reward_pb2_grpc.add_RewardServiceServicer_to_server(servicer, server)
    return str(reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name)


async def serve(settings: RewardSettings, stop: asyncio.Event) -> None:
    """Serve until stop is set or the reaper fails."""
    async with running(settings) as service:
        stopper = asyncio.get_running_loop().create_task(stop.wait())
        done, _ = await asyncio.wait({stopper, service.background}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if service.background in done and not service.background.cancelled():
            service.background.result()
