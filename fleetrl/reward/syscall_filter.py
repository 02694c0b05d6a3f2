"""The seccomp filter a jailed worker loads before any user code runs (libseccomp, via pyseccomp).

Allow by default, refuse (EPERM) what user code has no business doing and what would reach past
the jail: program execution, ptrace and reading or writing other processes' memory, namespaces
and mounts, kernel modules, keyrings, BPF, perf, userfaultfd, io_uring, handles to files by inode
and the like; every socket family but AF_UNIX (the network namespace has no route anywhere, and
the only Unix sockets reachable are the worker's own). Without `allow_fork` (reward files) process
creation is refused too: fork, vfork, clone without CLONE_THREAD (threads still work), and clone3
answers ENOSYS so the C library falls back to clone. `code_tests` built-ins fork a child per test,
so built-in workers may fork but not exec. A filter cannot be removed, is inherited by children,
and with no_new_privs needs no privilege. Syscalls of another architecture (int 0x80, x32) are
killed by libseccomp's default bad-arch action.
Stdlib plus pyseccomp: this runs inside the worker.
"""

from __future__ import annotations

import ctypes.util
import errno
import socket
from types import ModuleType

DENIED = (
    "execve", "execveat", "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd",
    "kcmp", "mount", "umount2", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig", "fspick",
    "mount_setattr", "pivot_root", "chroot", "unshare", "setns", "bpf", "perf_event_open", "userfaultfd",
    "keyctl", "add_key", "request_key", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon",
    "swapoff", "open_by_handle_at", "name_to_handle_at", "fanotify_init", "acct", "quotactl", "syslog",
    "settimeofday", "clock_settime", "adjtimex", "personality", "setdomainname", "sethostname", "vhangup",
)
PROCESS_CREATION = ("fork", "vfork")
CLONE_THREAD = 0x00010000
SONAMES = {"c": "libc.so.6", "seccomp": "libseccomp.so.2"}


def _pyseccomp() -> ModuleType:
    """Import pyseccomp, which looks its libraries up with ctypes.util.find_library at import: that
    runs gcc and ldconfig in subprocesses (slow, and under the worker's process limit it can hang),
    so the lookup is answered from SONAMES while it imports; the dynamic loader finds the files."""
    find_library = ctypes.util.find_library
    ctypes.util.find_library = SONAMES.get  # type: ignore[assignment]
    try:
        import pyseccomp
    finally:
        ctypes.util.find_library = find_library
    return pyseccomp


def load(allow_fork: bool) -> None:
    """Load the filter into this process (and every thread and child it starts from now on)."""
    sc = _pyseccomp()

    deny = sc.ERRNO(errno.EPERM)
    rules = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED:
        rules.add_rule(deny, name)
    for call in ("socket", "socketpair"):
        rules.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), call, sc.Arg(0, sc.NE, socket.AF_UNIX))
    if not allow_fork:
        for name in PROCESS_CREATION:
            rules.add_rule(deny, name)
        rules.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))
        rules.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    rules.load()
