"""Compute threads for each process of a local fleet, so the fleet never runs more than the machine's cores.

Every child of `fleetrl up` / `fleetrl demo` gets a thread budget: its torch intra-op threads
(`FLEETRL_<SERVICE>_TORCH_THREADS`, which the learner and the actor apply with
`torch.set_num_threads` at start) and the OpenMP / MKL / OpenBLAS pools of anything it loads
(`OMP_NUM_THREADS`, `MKL_NUM_THREADS`, `OPENBLAS_NUM_THREADS`). Without it each of the learner and
the actors runs torch's default, one thread per core, and on 2 cores the learner and an actor
run four compute threads during every overlap (22% less work per second than two, measured).

Three ways to divide them (`mode`):

- "split": a fixed, learner-heavy split. The actors share `ACTOR_SHARE` of the cores (at least one
  thread each) and the learner takes the rest (at least one): 2 cores and 1 actor -> learner 1,
  actor 1; 8 cores and 1 actor -> learner 5, actor 3. A core an idle actor leaves stays idle.
- "lend": the actors keep that share, and the learner runs one thread per core at the lowest CPU
  priority (`LENT_NICE`, on its compute thread and the OpenMP threads it starts): it computes on the
  actors' cores whenever they are idle, and the kernel's scheduler hands those cores back the moment
  an actor generates. Nothing is exchanged between the processes, so a dead actor only leaves its
  cores to the learner.
- "turns": the same, but the actors share every core: while they generate they take the machine and
  the learner waits; between their turns the learner has it all (a colocated "hybrid engine", kept
  asynchronous: rewards, replay and weight publishing still overlap).

Where the learner and the actors share cores ("lend", "turns") their OpenMP threads wait
passively (`SHARED_CORES_ENV`): a thread spinning for a sibling that the other process displaced
burns the core that sibling needs.

"split" is the default by measurement (bench.pipeline --job on the demo's job, 2 cores, all modes in
one run, 2026-12-05): split 1.44x the single-process loop, lend 1.30x, turns 1.39x. Before the
passive wait the same command gave split 1.52x, lend 1.09x, turns 0.31x (a step 34.7 s with the
cores 97% busy). Lending keeps the cores busier but gets a little less work out of each CPU second.

The small services (gateway, replay, reward) wait on the network and get one thread each, outside
the compute budget. With more compute processes than cores every one still gets a thread, and the
sum exceeds the cores (`oversubscribed`; lending counts only the actors' threads, since the learner
yields). Flags (`--learner-threads`, `--actor-threads`, `--cores`) override the rule; a given
learner count leaves the rest to the actors and vice versa.
"""

from __future__ import annotations

import os

SMALL_SERVICES = ("gateway", "replay", "reward")
"""Services that wait on the network: one compute thread each."""
ACTOR_SHARE = 0.4
"""Fraction of the cores the actors share together; the learner takes the rest."""
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
"""Thread-pool sizes of OpenMP and the BLAS libraries, read when a library loads."""
TORCH_THREADS_SERVICES = ("learner", "actor", "tinker")
"""Services with a `torch_threads` setting."""
MODES = ("split", "lend", "turns")
"""How the learner and the actors divide the cores (see the module's docstring)."""
DEFAULT_MODE = "split"
LENT_NICE = 19
"""Niceness of a lending learner's compute threads: the lowest priority, so actors come first."""
SHARED_CORES_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Where the learner and the actors share cores ("lend", "turns"): OpenMP threads that wait sleep
instead of spinning on a core that a descheduled sibling, or the other process, needs (figures in
the module's docstring)."""


def machine_cores() -> int:
    """CPUs this process may run on (its affinity mask, which a container's cpuset narrows)."""
    return len(os.sched_getaffinity(0))


def budget(cores: int, actors: int, learner_threads: int | None = None,
           actor_threads: int | None = None, mode: str = "split") -> dict[str, int]:
    """Threads per process: {"learner": n, "actor": n (each actor), "gateway": 1, "replay": 1, "reward": 1}.

    cores: the cores to divide (>= 1); actors: actor processes (>= 0); learner_threads /
    actor_threads: fixed counts that override the rule (in "split", the other one takes what is
    left); mode: one of MODES (a lending learner runs on every core unless told otherwise).
    """
    if cores < 1 or actors < 0:
        raise ValueError(f"need cores >= 1 and actors >= 0, got cores={cores}, actors={actors}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if actor_threads is None:
        if mode == "turns":
            pool = cores
        elif mode == "split" and learner_threads is not None:
            pool = cores - learner_threads
        else:  # the rule's share; a lending learner's count takes nothing from the actors
            pool = int(cores * ACTOR_SHARE)
        actor_threads = max(1, pool // actors) if actors else 1
    if learner_threads is None:
        learner_threads = cores if lends(mode) else max(1, cores - actors * actor_threads)
    return {"learner": learner_threads, "actor": actor_threads, **dict.fromkeys(SMALL_SERVICES, 1)}


def lends(mode: str) -> bool:
    """Whether the learner computes on the actors' idle cores at the lowest priority."""
    return mode != "split"


def oversubscribed(threads: dict[str, int], cores: int, actors: int, mode: str = "split") -> bool:
    """Whether the processes at normal priority run more compute threads than cores (a lending
    learner yields its cores to the actors, so only theirs count)."""
    learner = 0 if lends(mode) else threads["learner"]
    return learner + actors * threads["actor"] > cores


def thread_env(service: str, threads: int, mode: str = "split") -> dict[str, str]:
    """Environment that gives one child `threads` compute threads (a lending learner's at LENT_NICE)."""
    env = dict.fromkeys(THREAD_ENV, str(threads))
    if service in TORCH_THREADS_SERVICES:
        env[f"FLEETRL_{service.upper()}_TORCH_THREADS"] = str(threads)
    if service in TORCH_THREADS_SERVICES and lends(mode):
        env.update(SHARED_CORES_ENV)
        if service == "learner":
            env["FLEETRL_LEARNER_COMPUTE_NICE"] = str(LENT_NICE)
    return env
