"""LearnerService: the thin gRPC adapter over the status board (read-only job status)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health

from fleetrl.proto.fleetrl.v1 import learner_pb2, learner_pb2_grpc
from fleetrl.runtime.grpcutil import map_errors, start_server
from fleetrl.services.learner import convert
from fleetrl.train.status import StatusBoard


class LearnerServicer(learner_pb2_grpc.LearnerServiceServicer):
    """GetStatus reads the board the job loop writes."""

    board: StatusBoard

    def __init__(self, board: StatusBoard) -> None:
        self.board = board

    @map_errors
    async def GetStatus(self, request: learner_pb2.LearnerStatusRequest,
                        context: grpc.aio.ServicerContext) -> learner_pb2.LearnerStatus:
        return convert.status_to_proto(self.board.for_job(request.job_id))


async def start(board: StatusBoard, listen: str) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Serve LearnerService (with health and reflection) on listen; returns server, port, health."""
    servicer = LearnerServicer(board)

    def register(server: grpc.aio.Server) -> str:
        learner_pb2_grpc.add_LearnerServiceServicer_to_server(servicer, server)
        return str(learner_pb2.DESCRIPTOR.services_by_name["LearnerService"].full_name)

    return await start_server(listen, [register])
