"""The learner's status board: what the job loop is doing, read by the status servicer.

Plain data with no grpc; the job loop writes it, `server.LearnerServicer` converts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetrl.errors import NotFound

PHASES = ("idle", "starting", "waiting_for_data", "training", "publishing", "checkpointing", "exporting", "done",
          "paused")


@dataclass
class StepRecord:
    step: int
    policy_version: int
    values: dict[str, float]
    unix_ms: int


@dataclass
class StatusBoard:
    """Live state of one learner; one job at a time."""

    learner_id: str
    job_id: str = ""
    step: int = 0
    policy_version: int = 0
    checkpoint_step: int = 0
    phase: str = "idle"
    last: StepRecord | None = None
    paused_reason: str = ""
    """Why the job waits on a full store (phase "paused"); empty when it does not."""
    history: dict[str, StatusBoard] = field(default_factory=dict, repr=False)

    def start_job(self, job_id: str) -> None:
        if self.job_id:
            self.history[self.job_id] = StatusBoard(
                self.learner_id, self.job_id, self.step, self.policy_version, self.checkpoint_step,
                self.phase, self.last, self.paused_reason,
            )
        self.job_id, self.step, self.policy_version, self.checkpoint_step = job_id, 0, 0, 0
        self.phase, self.last, self.paused_reason = "starting", None, ""

    def pause(self, reason: str) -> None:
        """The job waits on a full store: phase "paused", and why."""
        self.phase, self.paused_reason = "paused", reason

    def for_job(self, job_id: str) -> StatusBoard:
        """The status of job_id ("" = the current job); NotFound if this learner never ran it."""
        if not job_id or job_id == self.job_id:
            if not self.job_id:
                raise NotFound("this learner runs no job")
            return self
        if job_id in self.history:
            return self.history[job_id]
        raise NotFound(f"learner {self.learner_id} does not run job {job_id!r}")
