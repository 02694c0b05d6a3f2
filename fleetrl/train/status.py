"""The learner's status board: what each of its job runs is doing, read by the status servicer.

Plain data with no grpc; the job runs write it, `server.LearnerServicer` converts it. A learner runs
up to `max_jobs` jobs at once (`LearnerSettings.max_jobs`), each with its own `JobStatus`; the board
keeps every job this learner has run, so a finished job's last status can still be read.
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
class JobStatus:
    """Live state of one job run on this learner (what its `JobRun` writes)."""

    learner_id: str
    job_id: str
    step: int = 0
    policy_version: int = 0
    checkpoint_step: int = 0
    phase: str = "starting"
    last: StepRecord | None = None
    paused_reason: str = ""
    """Why the job waits on a full store (phase "paused"); empty when it does not."""

    def pause(self, reason: str) -> None:
        """The job waits on a full store: phase "paused", and why."""
        self.phase, self.paused_reason = "paused", reason


@dataclass
class StatusBoard:
    """Live state of one learner: its job runs, newest last, and why it claims nothing (if it is refused)."""

    learner_id: str
    jobs: dict[str, JobStatus] = field(default_factory=dict)
    """Every job run on this learner, by job id, in the order they (last) started."""
    running: set[str] = field(default_factory=set)
    """The ids of the jobs it runs now."""
    paused_reason: str = ""
    """Why its claims are refused (Redis refuses writes); empty when they are not."""

    def start_job(self, job_id: str) -> JobStatus:
        """A fresh status for a run of job_id (a job claimed again starts afresh), now running."""
        self.jobs.pop(job_id, None)
        status = self.jobs[job_id] = JobStatus(self.learner_id, job_id)
        self.running.add(job_id)
        return status

    def end_job(self, job_id: str) -> None:
        """The run of job_id stopped; its last status stays readable."""
        self.running.discard(job_id)

    def current(self) -> list[JobStatus]:
        """The statuses of the jobs running now, oldest claim first."""
        return [status for job_id, status in self.jobs.items() if job_id in self.running]

    def for_job(self, job_id: str) -> JobStatus:
        """The status of job_id ("" = the job started last); NotFound if this learner never ran it."""
        if not job_id:
            if not self.jobs:
                raise NotFound("this learner runs no job")
            return next(reversed(self.jobs.values()))
        if job_id in self.jobs:
            return self.jobs[job_id]
        raise NotFound(f"learner {self.learner_id} does not run job {job_id!r}")
