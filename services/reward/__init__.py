"""Reward service: scores completions with built-in verifiers or sandboxed user reward files.

Components (none references the others' internals; `scorer.Scorer` wires them):
- `verifiers`: the registry of built-in verifiers, each a function with a strict params model.
- `guard`, `protocol`, `worker_main`: the stdlib-only side that runs inside a sandboxed worker process
  (isolation set-up, audit hook, length-prefixed JSON framing, the item loop).
- `jail`, `syscall_filter`: the bubblewrap jail a worker runs in (command line, start-up probe) and
  the seccomp filter the worker loads inside it before any user code.
- `sandbox`: the service side of the workers: start under limits, call with a wall-clock timeout,
  kill every process of a worker (children by pidfd, process group, private uid; `procfs` finds
  them), replace; `pool.WorkerPool` keeps N of them per reward spec.
- `scorer`: validates specs, caches one pool per spec digest (bounded, idle pools reaped), turns
  worker replies into `Result`s and records metrics.
- `server` + `convert`: the thin gRPC adapter; `__main__`: `python -m services.reward` / `fleetrl reward`.
- `client`: the published client (actors call Score, the gateway Validate) and `spec_to_proto`.

Every spec, built-in or user file, is scored in sandboxed worker processes, never in the service
process: built-ins parse untrusted text (sympy can hang) or run untrusted code (`code_tests`).
"""
