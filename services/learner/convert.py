"""Domain <-> proto conversions of the learner service (the status board to LearnerStatus)."""

from __future__ import annotations

from fleetrl.proto.fleetrl.v1 import learner_pb2
from fleetrl.train.status import JobStatus, StepRecord


def step_to_proto(record: StepRecord) -> learner_pb2.StepMetrics:
    return learner_pb2.StepMetrics(step=record.step, policy_version=record.policy_version,
                                   values=record.values, unix_ms=record.unix_ms)


def status_to_proto(board: JobStatus) -> learner_pb2.LearnerStatus:
    status = learner_pb2.LearnerStatus(
        job_id=board.job_id, learner_id=board.learner_id, step=board.step,
        policy_version=board.policy_version, checkpoint_step=board.checkpoint_step, phase=board.phase,
        paused_reason=board.paused_reason,
    )
    if board.last is not None:
        status.last.CopyFrom(step_to_proto(board.last))
    return status
