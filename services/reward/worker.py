"""The sandboxed worker process: isolate, load one reward spec, then score items until stdin closes.

Started by `sandbox.Worker.start` as `python -I -c "...worker.main()"` in a new session. The
first frame on stdin is the boot message (mode, spec or source, limits, uid, temp dir, the service's
pid, whether to enter namespaces); the worker answers one ready frame ({"ok": true, "isolation":
{...}} naming the active layers, or {"ok": false, "reason": traceback}),
then answers each item frame with {"value": x} | {"components": {...}} | {"error": reason} and
its CPU seconds so far. User code sees /dev/null as stdin/stdout, so printing cannot corrupt the
protocol. Stdlib only, except the built-in registry in "builtin" mode (imported before the uid drop).
"""

from __future__ import annotations

import math
import os
import resource
import sys
import traceback
from collections.abc import Callable
from typing import Any

from services.reward import guard, protocol

RewardFn = Callable[..., Any]


def _private_pipes() -> tuple[int, int]:
    rfd, wfd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - lives as long as the process
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115
    return rfd, wfd


def _supervise(child: int, fds: tuple[int, int]) -> None:
    """Outer process of a PID namespace: wait for the item loop (PID 1 inside) and mirror its end."""
    for fd in fds:
        os.close(fd)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def isolate(boot: dict[str, Any], fds: tuple[int, int]) -> dict[str, Any]:
    """Enter namespaces, apply limits, drop to the worker's uid; returns the active layers."""
    isolation, parent = _enter_namespaces(boot, fds)
    limits = boot["limits"]
    os.chdir(boot["tmpdir"])
    if boot["mode"] == "builtin":
        _preload_builtins(boot)
    guard.set_limits(limits["memory_mb"], limits["cpu_s"], limits["file_mb"], limits["open_files"],
                     limits["processes"])
    uid = int(boot.get("uid") or 0)
    if uid and os.geteuid() == 0:
        isolation["mountns"] = guard.expose_paths(_python_paths(boot))
    isolation["dropped_uid"] = guard.drop_privileges(uid)
    guard.die_with_parent(parent)  # again: the uid change (and a fork) cleared it
    guard.forbid_new_privileges()
    isolation.update(uid=os.getuid(), audit_hook=boot["mode"] == "file")
    return isolation


def _enter_namespaces(boot: dict[str, Any], fds: tuple[int, int]) -> tuple[dict[str, Any], int]:
    """The namespaces entered, and the pid of the item loop's parent (the service, or the outer process)."""
    parent = int(boot["parent_pid"])
    guard.die_with_parent(parent)
    isolation: dict[str, Any] = guard.unshare_namespaces(bool(boot["namespaces"]))
    if isolation["pidns"]:
        parent = os.getpid()
        child = os.fork()
        if child:
            _supervise(child, fds)
    return isolation, parent


def _python_paths(boot: dict[str, Any]) -> list[str]:
    paths = [p for p in sys.path if p and p != boot["root"]]
    return [*paths, sys.prefix, sys.base_prefix, sys.executable, boot["tmpdir"]]


def _preload_builtins(boot: dict[str, Any]) -> None:
    from services.reward import builtins

    builtins.preload(boot["spec"]["builtin"], boot["spec"]["params"])


def load_file(source: str, tmpdir: str, root: str) -> RewardFn:
    """Execute a user's reward file under the audit hook and return its `reward` callable."""
    sys.path[:] = [p for p in sys.path if p != root]
    guard.install_hook(tmpdir)
    namespace: dict[str, Any] = {"__name__": "reward_file", "__file__": "reward_file.py"}
    exec(compile(source, "reward_file.py", "exec"), namespace)
    fn = namespace.get("reward")
    if not callable(fn):
        raise TypeError("the reward file does not define a callable `reward(completion, prompt, **metadata)`")
    return fn


def load(boot: dict[str, Any], fds: tuple[int, int]) -> RewardFn:
    """The function scoring one item, for either mode."""
    if boot["mode"] == "file":
        fn = load_file(boot["source"], boot["tmpdir"], boot["root"])
        params = boot["spec"].get("params") or {}
        if params:
            return lambda completion, prompt, **meta: fn(completion, prompt, params=params, **meta)
        return fn
    from services.reward import builtins, codeexec

    codeexec.CHILD_CLOSE_FDS[:] = list(fds)
    return builtins.resolve(boot["spec"]["builtin"], boot["spec"]["params"])


def _number(value: Any) -> float | None:
    if isinstance(value, bool | int | float):
        return float(value)
    return None


def encode_value(value: Any) -> dict[str, Any]:
    """The reply for a reward function's return value (the service re-checks it)."""
    number = _number(value)
    if number is not None:
        return {"value": number if math.isfinite(number) else repr(number)}
    if isinstance(value, dict):
        components = {str(k): _number(v) for k, v in value.items()}
        bad = [k for k, v in components.items() if v is None or not math.isfinite(v)]
        if bad:
            return {"error": f"reward dict has non-finite or non-numeric entries: {bad[:5]}"}
        return {"components": components}
    return {"error": f"reward returned {type(value).__name__} {str(value)[:80]!r}, expected a float or dict"}


def score_one(fn: RewardFn, request: dict[str, Any]) -> dict[str, Any]:
    """Call fn on one item; an exception becomes an error reply with its last frames."""
    try:
        value = fn(request["completion"], request["prompt"], **request["metadata"])
    except BaseException as error:  # user code: anything it raises is this item's error
        tail = traceback.format_exception(error, limit=-2)
        return {"error": "".join(tail)[-2000:].strip()}
    return encode_value(value)


def serve(fn: RewardFn, rfd: int, wfd: int) -> None:
    while True:
        try:
            request = protocol.read_fd(rfd)
        except EOFError:
            return
        reply = score_one(fn, request)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        reply["cpu_s"] = usage.ru_utime + usage.ru_stime
        protocol.write_fd(wfd, reply)


def main() -> None:
    rfd, wfd = _private_pipes()
    boot = protocol.read_fd(rfd)
    try:
        isolation = isolate(boot, (rfd, wfd))
        fn = load(boot, (rfd, wfd))
    except BaseException as error:  # report why the spec cannot load, then exit
        reason = "".join(traceback.format_exception(error, limit=-3))[-4000:].strip()
        protocol.write_fd(wfd, {"ok": False, "reason": reason})
        os._exit(3)
    protocol.write_fd(wfd, {"ok": True, "isolation": isolation})
    serve(fn, rfd, wfd)
    os._exit(0)
