"""Sandbox uid ranges of the test processes: each pytest process claims its own, by a lock file.

Reward-service tests count the processes of their sandbox uid range at teardown. A range fixed in the
source is shared by every pytest process on the machine (two xdist workers, or two checkouts' suites at
once), and each would count the other's workers as its own leftovers. `claim()` takes the first range
whose lock no live process holds and keeps the lock until this process exits.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

SPAN = 65_536  # more than fleetrl.reward.sandbox.UidPool.SPAN, the uids one service walks from its base
FIRST = 1_000_000  # clear of the service's default base (200_000) that other tests' services use
LAST = 2**31 - 2**17  # RewardSettings.sandbox_uid_base's bound
LOCKS = Path(tempfile.gettempdir()) / f"fleetrl-test-sandbox-uids-{os.getuid()}"  # per user: another's is not writable
_held: list[int] = []  # the claimed ranges' lock fds, open for this process's life


def claim() -> int:
    """The base of a uid range [base, base + SPAN) that no other live process has claimed."""
    LOCKS.mkdir(exist_ok=True)
    for base in range(FIRST, LAST, SPAN):
        fd = os.open(LOCKS / f"{base}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _held.append(fd)
        return base
    raise RuntimeError(f"every sandbox uid range under {LOCKS} is claimed")
