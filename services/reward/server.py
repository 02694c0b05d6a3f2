"""The gRPC RewardService: a thin adapter over `Scorer` and `EpisodeSessions`, plus the process lifecycle.

Score, Validate, Describe (the sandbox found at start-up) and the episode RPCs convert the request
(`convert`), call the scorer or the sessions and convert back; `map_errors` maps domain errors to
status codes. `running` owns the scorer (all worker processes), the sessions, the gRPC server, the
reaper (idle pools, abandoned episode sessions) and the metrics endpoint; a failure of the reaper
stops the service instead of dying silently. Spans and per-RPC metrics come from
`observe.ObservingInterceptor`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from fleetrl.errors import ConfigError
from fleetrl.proto.fleetrl.v1 import reward_pb2, reward_pb2_grpc
from fleetrl.reward.scorer import Scorer
from fleetrl.reward.sessions import EpisodeSessions
from fleetrl.reward.settings import RewardSettings
from fleetrl.runtime import background, telemetry
from fleetrl.runtime.grpcutil import map_errors, start_server, stop_server
from fleetrl.runtime.observe import ObservingInterceptor, serve_metrics
from fleetrl.services.reward import convert

log = logging.getLogger(__name__)


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """RewardService RPCs over one Scorer and its episode sessions."""

    scorer: Scorer
    sessions: EpisodeSessions

    def __init__(self, scorer: Scorer, sessions: EpisodeSessions) -> None:
        self.scorer = scorer
        self.sessions = sessions

    @map_errors
    async def Score(self, request: reward_pb2.ScoreRequest,
                    context: grpc.aio.ServicerContext) -> reward_pb2.ScoreResponse:
        spec = convert.to_spec(request.spec)
        results = await self.scorer.score(request.job_id, spec, convert.to_items(request), tenant=request.tenant)
        return convert.score_response(results)

    @map_errors
    async def Validate(self, request: reward_pb2.ValidateRequest,
                       context: grpc.aio.ServicerContext) -> reward_pb2.ValidateResponse:
        sandbox = convert.sandbox_report(self.scorer.sandbox)  # environments are user code: never a fallback
        try:
            if request.HasField("environment"):
                spec = convert.to_environment(request.environment)
            else:
                spec = convert.to_spec(request.spec)
                sandbox = convert.sandbox_report(self.scorer.sandbox_for(spec.spec))
            await self.scorer.validate(spec)
        except ConfigError as error:  # a bad spec or file is a verdict, not a failed call
            return reward_pb2.ValidateResponse(ok=False, reason=str(error), sandbox=sandbox)
        return reward_pb2.ValidateResponse(ok=True, sandbox=sandbox)

    @map_errors
    async def Describe(self, request: reward_pb2.DescribeRequest,
                       context: grpc.aio.ServicerContext) -> reward_pb2.SandboxReport:
        return convert.sandbox_report(self.scorer.sandbox)

    @map_errors
    async def OpenEpisodes(self, request: reward_pb2.OpenEpisodesRequest,
                           context: grpc.aio.ServicerContext) -> reward_pb2.OpenEpisodesResponse:
        results = await self.sessions.open(request.session_id, request.job_id, convert.to_environment(request.spec),
                                           convert.to_task(request), request.count, tenant=request.tenant)
        return reward_pb2.OpenEpisodesResponse(episodes=[convert.episode_to_proto(r) for r in results])

    @map_errors
    async def StepEpisodes(self, request: reward_pb2.StepEpisodesRequest,
                           context: grpc.aio.ServicerContext) -> reward_pb2.StepEpisodesResponse:
        results = await self.sessions.step(request.job_id, request.session_id, convert.to_actions(request))
        return reward_pb2.StepEpisodesResponse(results=[convert.episode_to_proto(r) for r in results])

    @map_errors
    async def CloseEpisodes(self, request: reward_pb2.CloseEpisodesRequest,
                            context: grpc.aio.ServicerContext) -> reward_pb2.CloseEpisodesResponse:
        await self.sessions.close(request.job_id, request.session_id)
        return reward_pb2.CloseEpisodesResponse()


@dataclass
class Running:
    """A started reward service: its bound port, its scorer, its episode sessions and its reaper task."""

    port: int
    scorer: Scorer
    sessions: EpisodeSessions
    background: asyncio.Task[None]


def reap_interval_s(settings: RewardSettings) -> float:
    """How often the reaper looks: often enough for both idle limits."""
    return min(60.0, settings.pool_idle_s / 2, settings.episode_idle_timeout_s / 4)


async def reap_loop(scorer: Scorer, sessions: EpisodeSessions, interval_s: float) -> None:
    """Reap episode sessions idle for episode_idle_timeout_s, then close pools idle for pool_idle_s."""
    while True:
        await asyncio.sleep(interval_s)
        sessions.reap_idle()
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
        sessions = EpisodeSessions(scorer)
        stack.callback(sessions.close_all)
        servicer = RewardServicer(scorer, sessions)
        server, port, health = await start_server(
            settings.listen, [lambda s: _register(servicer, s)],
            interceptors=[ObservingInterceptor(scorer.metrics.registry)])
        stack.push_async_callback(stop_server, server, health, settings.grace_s)
        serve_metrics(settings.metrics_port, scorer.metrics.registry)
        reaper = asyncio.get_running_loop().create_task(reap_loop(scorer, sessions, reap_interval_s(settings)))
        stack.push_async_callback(background.stop, reaper)
        log.info("reward service listening on port %d", port)
        yield Running(port, scorer, sessions, reaper)


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
