"""Settings of the replay service (environment prefix FLEETRL_REPLAY_).

The per-job table settings (capacity, sampler, reuse, lease timeout) are not
here: they come from the job's `replay` section through ConfigureTable.
"""

from __future__ import annotations

from pydantic import Field

from fleetrl.spec.config import InfraSettings

ENV_PREFIX = "FLEETRL_REPLAY_"


class ReplaySettings(InfraSettings):
    """How one replay service process runs."""

    listen: str = "127.0.0.1:50052"
    """gRPC listen address host:port (port 0: a free port)."""
    max_request_bytes: int = Field(32 * 1024 * 1024, ge=1024, le=64 * 1024 * 1024)
    """Largest Insert request (sum of serialised groups); larger ones get RESOURCE_EXHAUSTED."""
    max_groups_per_sample: int = Field(4096, ge=1, le=65536)
    """Most groups one Sample call may lease."""
    max_wait_s: float = Field(60.0, ge=0, le=3600)
    """Cap on a Sample call's wait_s."""
    poll_interval_s: float = Field(0.02, gt=0, le=5)
    """How often a waiting Sample call re-checks the table."""
    reclaim_interval_s: float = Field(1.0, gt=0, le=3600)
    """Period of the background task that returns the groups of expired leases."""
    max_lineage_records: int = Field(1_000_000, ge=1, le=100_000_000)
    """Lineage records kept per job for Query (also after consumption); the lowest
    policy versions are trimmed first."""
    insert_fsync_timeout_s: float = Field(2.0, ge=0, le=60)
    """An Insert is answered only once Redis has fsynced its groups to the AOF (`WAITAOF 1 0`, group
    commit: under `appendfsync everysec` within about a second), so a crash of Redis loses no acknowledged
    group; past this many seconds it is answered UNAVAILABLE (the actor retries; the retry is answered
    duplicate once the groups are on disk). 0: answered once Redis applied them, as durable as its
    appendfsync (docs/guarantees.md). Needs `appendonly yes` and Redis >= 7.2 or Valkey; without them the
    service warns at start and answers once applied."""
    check_maxmemory_policy: bool = True
    """Refuse to start against a Redis whose maxmemory-policy may evict keys silently."""
    grace_s: float = Field(5.0, ge=0, le=600)
    """Seconds in-flight calls may finish after SIGTERM."""
