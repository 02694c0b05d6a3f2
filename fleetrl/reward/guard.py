"""Isolation of a sandboxed worker: namespaces, resource limits, dropped uid and an audit hook.

In the jail (`jail`), bubblewrap provides the namespaces and the filesystem, and `syscall_filter`
the seccomp filter; from here the worker then takes the rlimits, the private uid, no_new_privs, the
parent-death signal, non-dumpability and the audit hook. The legacy sandbox (`sandbox_mode =
"legacy"`, an explicit weaker mode) has only the layers below.
Layers of the legacy sandbox, strongest first (each one is applied where the machine allows it):
1. Network namespace (`unshare(CLONE_NEWNET)`, via ctypes since Python 3.11 has no os.unshare): the
   worker sees only a down loopback, so no socket reaches anything. As root it works directly; as
   another user it is tried together with CLONE_NEWUSER (unprivileged user namespaces).
2. PID namespace (CLONE_NEWPID): the worker forks once and the item loop runs as PID 1 of a new
   namespace, so when it dies the kernel kills every process it left, even ones that called setsid.
   The item loop dies with the outer process (PR_SET_PDEATHSIG), and the service also kills it by
   its pidfd: leaving the process group (setsid, setpgid raise no audit event) does not save it.
3. rlimits: address space, CPU seconds, file size, open files, processes, no core files.
4. A private uid when the service runs as root (RLIMIT_NPROC is not enforced for root): one uid per
   worker, taken from `sandbox_uid_base`, so the process limit counts that worker alone and the
   service can kill every process of the worker by its uid, wherever it went. No new privileges
   (PR_SET_NO_NEW_PRIVS), so no setuid program takes a process out of that uid. When the Python
   installation sits under a private directory (a 0700 /root), a private mount namespace puts a
   tmpfs over that directory and binds back only what Python needs, so the dropped uid can import
   the stdlib while the rest of root's home (keys, tokens) is hidden.
5. An audit hook (`sys.addaudithook`) installed before user code runs. It denies sockets, process
   creation (fork, exec, spawn, system, subprocess), signals, ctypes, rlimit changes and any write,
   rename, delete, link or mkdir outside the worker's temp dir. It is defence in depth, not the
   boundary: Python-level hooks can be bypassed by code that reaches C, which layers 1-4 contain.
   Some calls raise no audit event at all: os.setsid, os.setpgid and `_posixsubprocess.fork_exec`
   (which subprocess calls, and which sympy imports, so it cannot be denied at import).
Fallback without namespaces: layers 3-5 plus the service's wall-clock kill of the worker's process
group and, as root, of every process of its uid. Unprivileged, workers share the service's uid: the
service then makes itself non-dumpable, so they cannot read its environment or memory through
/proc, and RLIMIT_NPROC counts every process of that user, so with the default
`worker_max_processes` a worker cannot start any process. `isolation` in the worker's ready
message says which layers are active, and the service logs it when it starts a pool.
Stdlib only: this runs in the worker before any user code.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
from collections.abc import Callable
from typing import Any

from fleetrl.reward import procfs  # stdlib only, like this module

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000

DENIED_EVENTS = (
    "socket.", "subprocess.", "os.fork", "os.forkpty", "os.exec", "os.spawn", "os.posix_spawn",
    "os.system", "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.", "resource.setrlimit",
    "resource.prlimit", "os.chown", "os.link", "os.symlink", "pty.", "mmap.", "winreg.", "webbrowser.",
    "ftplib.", "http.", "smtplib.", "urllib.", "imaplib.", "poplib.", "nntplib.", "telnetlib.",
)
PATH_EVENTS = {"os.rename": 2, "os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1,
               "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1, "shutil.copyfile": 2,
               "shutil.copytree": 2, "shutil.move": 2, "os.chflags": 1, "os.lchmod": 1}
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


LIBC = ctypes.CDLL(None, use_errno=True)


def _unshare(flags: int) -> bool:
    return bool(LIBC.unshare(flags) == 0)


def unshare_namespaces(wanted: bool) -> dict[str, bool]:
    """Enter new network and PID namespaces if wanted and allowed; returns which ones were entered."""
    none = {"netns": False, "pidns": False, "userns": False}
    if not wanted:
        return none
    if os.geteuid() == 0 and _unshare(CLONE_NEWNET | CLONE_NEWPID):
        return {"netns": True, "pidns": True, "userns": False}
    if _unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID):
        return {"netns": True, "pidns": True, "userns": True}
    if os.geteuid() == 0 and _unshare(CLONE_NEWNET):
        return {**none, "netns": True}
    return none


def _prctl(option: int, value: int) -> None:
    if LIBC.prctl(option, ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value}) failed")


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when parent ends (PR_SET_PDEATHSIG); exit if it has.

    A fork and a uid change both clear the setting, so it is set again after each. The parent is
    read from /proc, which numbers processes as the service does (getppid() is 0 for PID 1 of a
    new namespace); if it is no longer parent, the parent ended before the prctl took effect.
    """
    set_parent_death_signal()
    if procfs.parent_of("self") != parent:
        os._exit(1)


def set_parent_death_signal() -> None:
    """PR_SET_PDEATHSIG SIGKILL: the kernel kills this process when the thread that started it ends."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def forbid_new_privileges() -> None:
    """PR_SET_NO_NEW_PRIVS: exec'ing a setuid program no longer changes the uid (inherited, irreversible)."""
    _prctl(PR_SET_NO_NEW_PRIVS, 1)


def hide_from_same_uid() -> None:
    """PR_SET_DUMPABLE 0 for the calling process (the service, when workers share its uid): other
    processes of that uid can no longer read its /proc environ or memory, or ptrace it."""
    _prctl(PR_SET_DUMPABLE, 0)


def _enc(value: str | None) -> bytes | None:
    return value.encode() if value is not None else None


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    if LIBC.mount(_enc(source), _enc(target), _enc(fstype), flags, _enc(data)) != 0:
        raise OSError(ctypes.get_errno(), f"mount {source} on {target} failed")


def _blocked_ancestor(path: str) -> str | None:
    """The first ancestor of path that other users cannot traverse (e.g. a 0700 /root)."""
    parts = os.path.realpath(path).split(os.sep)[1:]
    for i in range(1, len(parts)):
        ancestor = os.sep + os.sep.join(parts[:i])
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def expose_paths(paths: list[str]) -> bool:
    """Make paths readable to an unprivileged uid although an ancestor is private (0700 /root).

    In a private mount namespace, a tmpfs (mode 0755) is mounted over each private ancestor, which
    also hides the rest of it (credentials in root's home), and the needed child directories are
    bind-mounted back. Needs root; returns False when there was nothing to do.
    """
    needed: dict[str, set[str]] = {}
    for path in paths:
        ancestor = _blocked_ancestor(path) if os.path.exists(path) else None
        if ancestor:
            child = os.path.relpath(os.path.realpath(path), ancestor).split(os.sep)[0]
            needed.setdefault(ancestor, set()).add(child)
    if not needed:
        return False
    if not _unshare(CLONE_NEWNS):
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed")
    _mount("none", "/", None, MS_REC | MS_PRIVATE, None)
    for ancestor, children in needed.items():
        fds = {child: os.open(os.path.join(ancestor, child), os.O_RDONLY) for child in children}
        _mount("tmpfs", ancestor, "tmpfs", 0, "mode=0755,size=64k")
        for child, fd in fds.items():
            os.mkdir(os.path.join(ancestor, child))
            _mount(f"/proc/self/fd/{fd}", os.path.join(ancestor, child), None, MS_BIND | MS_REC, None)
            os.close(fd)
    return True


def forget_ctypes() -> None:
    """Drop ctypes from sys.modules so a later `import ctypes` raises its (denied) dlopen event."""
    for name in [n for n in sys.modules if n == "ctypes" or n.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]


def set_limits(memory_mb: int, cpu_s: int, file_mb: int, open_files: int, processes: int) -> None:
    """Apply the worker's rlimits (soft = hard, so user code cannot raise them)."""
    limits = {
        resource.RLIMIT_AS: memory_mb * 1024 * 1024,
        resource.RLIMIT_CPU: cpu_s,
        resource.RLIMIT_FSIZE: file_mb * 1024 * 1024,
        resource.RLIMIT_NOFILE: open_files,
        resource.RLIMIT_CORE: 0,
    }
    if processes > 0:
        limits[resource.RLIMIT_NPROC] = processes
    for which, value in limits.items():
        resource.setrlimit(which, (value, value))


def drop_privileges(uid: int) -> bool:
    """Become uid (and gid uid) with no supplementary groups; only possible as root."""
    if os.geteuid() != 0 or uid <= 0:
        return False
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    return True


def _inside(path: Any, root: str) -> bool:
    if isinstance(path, int):
        return True  # an already-open descriptor; its open was checked
    real = os.path.realpath(os.fsdecode(path))
    return real == root or real.startswith(root + os.sep)


def _is_write(mode: Any, flags: Any) -> bool:
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    return isinstance(flags, int) and bool(flags & WRITE_FLAGS)


def make_hook(root: str) -> Callable[[str, tuple[Any, ...]], None]:
    """The audit hook confining Python-level side effects to root (the worker's temp dir)."""
    root = os.path.realpath(root)

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event.startswith(DENIED_EVENTS):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and len(args) >= 3 and _is_write(args[1], args[2]) and not _inside(args[0], root):
            raise PermissionError(f"sandbox: writing {args[0]!r} outside the temp dir is not allowed")
        count = PATH_EVENTS.get(event, 0)
        for path in args[:count]:
            if not _inside(path, root):
                raise PermissionError(f"sandbox: {event} on {path!r} outside the temp dir is not allowed")

    return hook


def install_hook(root: str) -> None:
    """Install the audit hook (irreversible for this process and its forks)."""
    forget_ctypes()
    sys.addaudithook(make_hook(root))
