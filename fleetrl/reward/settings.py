"""Settings of the reward service (`FLEETRL_REWARD_*`, TOML, `--set`), on top of InfraSettings."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from fleetrl.spec.config import InfraSettings

ENV_PREFIX = "FLEETRL_REWARD_"


class RewardSettings(InfraSettings):
    """How the reward service listens, and how many sandboxed workers it keeps under which limits."""

    listen: str = "127.0.0.1:50053"
    """gRPC listen address (host:port; port 0 picks a free one)."""
    workers_per_pool: int = Field(4, ge=1, le=512)
    """Sandboxed worker processes per reward spec; throughput grows with it."""
    burst_workers_per_pool: int = Field(4, ge=0, le=512)
    """Extra workers a pool may start while items run past a quarter of their timeout, one per such
    item, so that slow or hanging items do not take the capacity of the rest (0: never)."""
    worker_respawn_burst: int = Field(8, ge=1, le=10_000)
    """Workers a pool may start back to back to replace ones that timed out, crashed or were recycled;
    past it the pool starts replacements at most `worker_respawns_per_s` a second. Starts for demand
    (the workers episodes hold, bursts for overrunning items) are not counted: `max_episodes` and
    `burst_workers_per_pool` bound those."""
    worker_respawns_per_s: float = Field(2.0, gt=0, le=1000)
    """Sustained rate at which a pool may start replacements once its `worker_respawn_burst` is spent, so a
    reward file that kills its worker on every item cannot make the service spend its CPU on starting
    workers. While a pool waits for it with no worker to run on, its items fail at once, naming why."""
    max_pools: int = Field(16, ge=1, le=1024)
    """Most worker pools (one per job and spec: jobs never share one) with live workers; the least recently
    used idle pool is closed beyond it."""
    max_pools_per_tenant: int = Field(8, ge=1, le=1024)
    """Most worker pools one tenant's jobs hold: a new one first closes that tenant's least recently used
    idle pool, and is refused (RESOURCE_EXHAUSTED) when each of them is busy with episodes. With
    `workers_per_pool` it bounds the sandboxed processes one tenant keeps."""
    pool_idle_s: float = Field(600.0, gt=0, le=86400)
    """A pool unused this long is closed (its workers killed)."""
    worker_start_timeout_s: float = Field(30.0, gt=0, le=600)
    """Limit for a worker to start and isolate itself (the jail, Python, the service's own modules and
    the built-ins' imports such as sympy), before any submitted code runs."""
    worker_load_timeout_s: float = Field(30.0, gt=0, le=600)
    """Limit for a started worker to load its spec: a reward or environment file's top-level code (its
    imports). A spec slower than this does not load (Validate says so). A Score call waits for a load at
    most its items' timeout (`reward.timeout_per_item_s`): items whose spec is still loading then score as
    errors naming why, while the load goes on in the background for the next call."""
    worker_max_processes: int = Field(2, ge=1, le=1024)
    """RLIMIT_NPROC of a worker's private uid (the worker plus one code_tests child)."""
    worker_max_open_files: int = Field(64, ge=16, le=65536)
    """RLIMIT_NOFILE of a worker."""
    worker_max_file_mb: int = Field(16, ge=1, le=65536)
    """RLIMIT_FSIZE of a worker: the largest file it may write, in MiB."""
    worker_cpu_limit_s: int = Field(600, ge=1, le=86400)
    """RLIMIT_CPU of a worker over its life; it is replaced once it has used half."""
    max_items_per_worker: int = Field(100_000, ge=1)
    """A worker is replaced after this many items."""
    sandbox_uid_base: int = Field(200_000, ge=0, le=2**31 - 2**17)
    """When the service runs as root, workers run as private uids/gids in [base, base+60000) (0: stay root)."""
    sandbox_mode: Literal["jail", "legacy"] = "jail"
    """jail: every worker runs in a bubblewrap jail with a seccomp filter (see fleetrl/reward/jail.py),
    and the service refuses to run reward code when a start-up probe finds a layer of it missing;
    legacy: the explicit weaker mode without the jail (namespaces entered by the worker where the
    kernel allows, rlimits, private uid, audit hook), for machines where bwrap cannot run."""
    worker_tmp_mb: int = Field(64, ge=1, le=65536)
    """Size of a jailed worker's private temp dir (a tmpfs, counted in memory)."""
    max_memory_limit_mb: int = Field(4096, ge=64, le=65536)
    """Largest `reward.memory_limit_mb` a job may ask for; a job asking more is refused."""
    max_timeout_per_item_s: float = Field(60.0, gt=0, le=600)
    """Largest `reward.timeout_per_item_s` a job may ask for; a job asking more is refused."""
    worker_namespaces: bool = True
    """Legacy sandbox only: put each worker in new network and PID namespaces where the kernel allows;
    False keeps only the fallback layers (rlimits, private uid, audit hook, killing by group and uid)."""
    sandbox_dir: Path | None = None
    """Legacy sandbox only: where workers' private temp dirs are made (None: the system temp dir).
    Dirs a SIGKILLed service left there are removed when the next service starts."""
    max_items_per_request: int = Field(4096, ge=1, le=1_000_000)
    """Largest batch one Score call may carry."""
    max_reply_bytes: int = Field(1 << 20, ge=1024, le=64 << 20)
    """Largest reply frame a worker may send for one item."""
    max_episodes: int = Field(256, ge=1, le=100_000)
    """Most episodes (each holding one sandboxed worker) open at once; OpenEpisodes beyond it is
    RESOURCE_EXHAUSTED."""
    max_episodes_per_job: int = Field(64, ge=1, le=100_000)
    """Most episodes one job holds open at once, so one job cannot take every slot of `max_episodes`;
    OpenEpisodes beyond it is RESOURCE_EXHAUSTED naming this setting (the actor releases the task)."""
    max_episodes_per_tenant: int = Field(128, ge=1, le=100_000)
    """Most episodes all jobs of one tenant hold open at once."""
    episode_idle_timeout_s: float = Field(120.0, gt=0, le=86_400)
    """A session of episodes not stepped for this long (its actor died) is reaped: its workers are
    killed, counted as abandoned. Keep it above the longest generation of one turn."""
    grace_s: float = Field(5.0, ge=0, le=600)
    """On SIGTERM, in-flight calls get this long to finish."""
