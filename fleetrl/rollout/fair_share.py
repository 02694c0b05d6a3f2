"""Which job an actor serves next: weighted fair queueing of the actor's time across jobs.

Each served job has a weight: its tenant's weight (`JobRecord.weight`, the operator's
`TenantQuota.weight` recorded at submission) split equally among the tenant's jobs this actor serves,
so tenants share the actor by weight and a tenant's jobs share its part equally. The actor runs one
task at a time and charges the job the wall-clock seconds the task took, divided by the job's weight:
the job's virtual time. The next job is the one with the least virtual time that has a task (start-time
fair queueing over measured service, so a job whose tasks take longer gets fewer of them, not more of
the actor). A job found without a task is moved up to the virtual time of the job served instead, so it
banks no credit while idle and cannot take the actor over when its tasks return; a job the actor starts
serving begins at the least virtual time of the others.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


def job_weights(owners: Mapping[str, tuple[str, float]]) -> dict[str, float]:
    """Each job's weight, from job -> (tenant, the tenant's weight): the tenant's weight over its jobs here."""
    jobs_of = Counter(tenant for tenant, _ in owners.values())
    return {job: weight / jobs_of[tenant] for job, (tenant, weight) in owners.items()}


@dataclass
class FairShare:
    """The virtual time of each job an actor serves."""

    virtual: dict[str, float] = field(default_factory=dict)

    def order(self, jobs: Iterable[str]) -> list[str]:
        """The jobs, least virtual time first (ties by name); a job new here starts at the least virtual
        time of the others."""
        jobs = list(jobs)
        floor = min((self.virtual[job] for job in jobs if job in self.virtual), default=0.0)
        for job in jobs:
            self.virtual.setdefault(job, floor)
        return sorted(jobs, key=lambda job: (self.virtual[job], job))

    def served(self, job: str, seconds: float, weight: float, idle: Iterable[str] = ()) -> None:
        """Charge job for a task that took seconds; the jobs found idle before it move up to its start."""
        start = self.virtual[job]
        for other in idle:
            self.virtual[other] = max(self.virtual[other], start)
        self.virtual[job] = start + seconds / weight

    def forget(self, job: str) -> None:
        self.virtual.pop(job, None)
