"""Run a completion's program against tests, one forked child per test, inside a sandboxed worker.

Used by the `code_tests` built-in. The worker (already isolated: no network, its own uid, limits)
forks a child per test; the child closes the worker's protocol pipes, installs the audit hook,
redirects stdin/stdout to files in the worker's temp dir and runs the program. The verdict comes
from the child's exit status and output, read by the worker, so the program cannot forge its score.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from fleetrl.reward import guard

CHILD_CLOSE_FDS: list[int] = []
"""The worker's protocol descriptors, closed in each test child (set by the worker)."""


def _child(program: str, stdin_path: str, stdout_path: str) -> None:
    try:
        for fd in CHILD_CLOSE_FDS:
            os.close(fd)
        in_fd = os.open(stdin_path, os.O_RDONLY)
        out_fd = os.open(stdout_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(in_fd, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        import sys

        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = sys.stderr = open(1, "w", closefd=False)  # noqa: SIM115
        guard.install_hook(os.getcwd())
        exec(compile(program, "<completion>", "exec"), {"__name__": "__main__"})
        sys.stdout.flush()
        os._exit(0)
    except SystemExit as stop:
        os._exit(stop.code if isinstance(stop.code, int) else 1)
    except BaseException:  # the program failed this test
        os._exit(1)


def _wait(pid: int, timeout_s: float) -> int | None:
    """Exit status of pid, or None after killing it at the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def run_test(program: str, test: Any, timeout_s: float, max_output_bytes: int) -> bool:
    """True when program passes test: a statement (str) run after it, or {"input", "output"}."""
    if isinstance(test, str):
        program, stdin, expected = f"{program}\n\n{test}\n", "", None
    else:
        stdin, expected = str(test.get("input", "")), str(test.get("output", ""))
    stdin_path, stdout_path = "test_stdin.txt", "test_stdout.txt"  # relative: cwd is the private temp dir
    with open(stdin_path, "w") as handle:
        handle.write(stdin)
    pid = os.fork()
    if pid == 0:
        _child(program, stdin_path, stdout_path)
    status = _wait(pid, timeout_s)
    if status is None or os.waitstatus_to_exitcode(status) != 0:
        return False
    if expected is None:
        return True
    with open(stdout_path, "rb") as handle:
        output = handle.read(max_output_bytes).decode(errors="replace")
    return _normalise(output) == _normalise(expected)


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())
