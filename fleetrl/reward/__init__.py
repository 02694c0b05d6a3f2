"""Scoring: built-in verifiers and the sandbox user code runs in.

Components (none references the others' internals; `scorer.Scorer` wires them):
- `verifiers`: the registry of built-in verifiers, each a function with a strict params model.
- `guard`, `protocol`, `worker_main`, `codeexec`, `procfs`: the stdlib-only side that runs inside a
  sandboxed worker process (isolation set-up, audit hook, length-prefixed JSON framing, the item loop,
  `code_tests`' children) and the census that finds a worker's processes.
- `jail`, `syscall_filter`: the bubblewrap jail a worker runs in and the seccomp filter it loads.
- `sandbox`: the service side of a worker (start under limits, call with a timeout, kill, replace);
  `pool.WorkerPool` keeps N of them for one job's spec.
- `scorer`: validates specs, keeps one pool per job and spec, turns replies into `Result`s.
- `sessions`: `EpisodeSessions`, the multi-turn environments of actors' rollouts.
- `client`: the reward service's client (actors Score and play episodes, the gateway Validates).
- `metrics`, `settings`: its Prometheus metrics and `RewardSettings`.

Every spec, built-in or user file, is scored in sandboxed worker processes, never in the service
process: built-ins parse untrusted text (sympy can hang) or run untrusted code (`code_tests`). The
worker-side modules (and `fleetrl.env`) are bound into the jail: they import only the standard library.
"""
