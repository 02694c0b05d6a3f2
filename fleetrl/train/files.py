"""Writing the learner's files (checkpoints, metrics.jsonl) so that a full file system is named.

Design choice: a write that fails for want of space raises `NoSpace`, an OSError with errno ENOSPC
and the file's path, whatever library wrote the file: safetensors keeps only the OS error's text
("No space left on device (os error 28)"), and torch.save given a path keeps nothing of it (an
iostream error), so files are written through `write_file`, and torch.save into a file of ours. The
learner waits a full disk out with the job paused (`fleetrl.train.full_stores`).
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

import torch

from fleetrl.errors import FleetError


class NoSpace(FleetError, OSError):
    """A file could not be written: its file system (or the user's quota there) is full. An OSError with
    errno ENOSPC and the file's path, so its text names both."""


def write_file(path: Path, write: Callable[[Path], object]) -> None:
    """write(path); NoSpace naming path when it failed for want of space."""
    try:
        write(path)
    except Exception as error:
        if not no_space(error):
            raise
        raise NoSpace(errno.ENOSPC, "no space left on device (ENOSPC) writing", str(path)) from error


def torch_save(obj: object) -> Callable[[Path], None]:
    """torch.save to a file object of ours, where the OSError of a full disk stays in the error's context."""

    def save(path: Path) -> None:
        with path.open("wb") as handle:
            torch.save(obj, handle)

    return save


def no_space(error: BaseException | None) -> bool:
    """Whether error, or an error it was raised from or during, is a full file system: an OSError with
    ENOSPC or EDQUOT, or safetensors' own error, which carries only the OS error's text."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if f"(os error {errno.ENOSPC})" in str(error) or f"(os error {errno.EDQUOT})" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False
