"""A `Transport` on a file system: a directory per job, for one box or a volume every process mounts.

What it is for: a learner and actors on one machine, or on machines that share a volume, with no NATS between
them; and proof that `fleetrl.weights.transport` is the whole contract (the weights tests run the same
round trips through it and through NATS). The services use it when `weights_dir` is set
(`fleetrl.weights.factory`).

Layout under `root`: `<job>/objects/<name>`, each payload a file holding the 64 hex characters of its sha256,
then its bytes; `<job>/pointer`, the pointer's revision on the first line and its value after it;
`<job>/resync`, the resync note; `<job>/pointer.lock`, the lock file. `purge` removes `<job>/` whole.

Design choices:
- Every file is written under a temporary name (a dot file), flushed to disk and renamed into place, the
  directory flushed after: a reader finds the old file or the whole new one, never part of one, and a put
  that returned survives a crash of the machine. A put that fails removes its temporary file; one whose
  process was killed leaves it, and the job's next put removes it (a job's payloads have one writer, the
  learner that fenced its pointer, as `jetstream.NatsTransport.sweep_stray_chunks` argues). A killed write of
  the pointer or the note leaves a temporary file of a few bytes, which stays.
- The pointer's compare-and-swap holds an exclusive `flock` on `pointer.lock` while it reads the revision,
  compares and renames the new pointer into place; readers take no lock (the rename is atomic). With the
  channel's check of the lease epoch on the pointer it read before the swap, a stale learner is fenced.
- `watch_pointer` polls the pointer file every WATCH_POLL_S: the standard library has no portable file
  watch, and one does not see a remote machine's writes on a shared volume anyway.

What it does not guarantee:
- No deadlines: a call waits as long as the file system does, so a hung mount hangs `put` and the pointer
  operations (`get` is bounded by the channel's pull deadline, its thread left reading).
- The lock is as good as the file system's `flock`: exclusive between processes on one box; on NFS Linux
  emulates it with a POSIX lock, which needs the NFS lock manager and does not exclude two swaps of one
  process (a learner makes them one at a time). File systems without atomic rename (some object-store
  mounts) break the layout's promise.
- A full disk raises OSError (ENOSPC), which the learner's `fleetrl.train.full_stores` does not wait out.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path

from fleetrl.errors import FailedPrecondition, InvalidArgument, NotFound, WeightsCorrupt
from fleetrl.tasks import bus
from fleetrl.weights.transport import Fetched, Usage, allocate

DIGEST_BYTES = 64
"""A payload file's header: the payload's sha256 in hex."""
WATCH_POLL_S = 0.2
"""How often `watch_pointer` reads the pointer file."""
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""Payload names (the channel's are `v<n>` and `d<n>`): never a path, never a temporary file's dot name."""
_TEMPORARY = ".tmp-"


class FilesystemTransport:
    """A `fleetrl.weights.transport.Transport` in directories under `root`, one per job."""

    root: Path

    def __init__(self, root: Path) -> None:
        self.root = root

    async def put(self, job_id: str, name: str, payload: bytes | memoryview) -> str:
        """Write `<sha256 hex><payload>` under a temporary name, flush it, rename it to `objects/<name>`."""
        path = self._object(job_id, name)
        await asyncio.to_thread(_remove_temporaries, path.parent)
        sha256_hex = await asyncio.to_thread(lambda: hashlib.sha256(payload).hexdigest())
        await asyncio.to_thread(_write_atomically, path, sha256_hex.encode(), payload)
        return sha256_hex

    async def get(self, job_id: str, name: str, size: int | None) -> Fetched:
        return await asyncio.to_thread(_read_payload, self._object(job_id, name), f"{job_id}/{name}", size)

    async def delete(self, job_id: str, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(self._object(job_id, name).unlink)

    async def names(self, job_id: str) -> list[str]:
        objects = self._job(job_id) / "objects"
        try:
            entries = await asyncio.to_thread(os.listdir, objects)
        except FileNotFoundError:
            return []
        return sorted(entry for entry in entries if not entry.startswith("."))

    async def read_pointer(self, job_id: str) -> tuple[bytes | None, int]:
        return await asyncio.to_thread(_read_pointer, self._job(job_id) / "pointer")

    async def swap_pointer(self, job_id: str, value: bytes, revision: int) -> None:
        """Under the job's lock: FailedPrecondition unless the pointer's revision is `revision`, then the
        value written as revision + 1."""
        await asyncio.to_thread(self._swap, self._job(job_id), value, revision)

    async def watch_pointer(self, job_id: str) -> AsyncGenerator[bytes]:
        seen = 0
        while True:
            value, revision = await self.read_pointer(job_id)
            if value is not None and revision != seen:
                seen = revision
                yield value
            await asyncio.sleep(WATCH_POLL_S)

    async def read_resync(self, job_id: str) -> bytes | None:
        try:
            return await asyncio.to_thread((self._job(job_id) / "resync").read_bytes)
        except FileNotFoundError:
            return None

    async def write_resync(self, job_id: str, value: bytes) -> None:
        await asyncio.to_thread(_write_atomically, self._job(job_id) / "resync", value)

    async def usage(self, job_id: str) -> Usage:
        """The files under the job's directory and their bytes."""
        sizes = await asyncio.to_thread(lambda: [p.stat().st_size for p in self._job(job_id).rglob("*") if p.is_file()])
        return Usage("disk", len(sizes), sum(sizes))

    async def purge(self, job_id: str) -> None:
        await asyncio.to_thread(shutil.rmtree, self._job(job_id), True)

    def _job(self, job_id: str) -> Path:
        return self.root / bus.check_job_id(job_id)

    def _object(self, job_id: str, name: str) -> Path:
        if not _NAME_RE.fullmatch(name):
            raise InvalidArgument(f"weights object name {name!r} is not 1-64 of [A-Za-z0-9_-]")
        return self._job(job_id) / "objects" / name

    @staticmethod
    def _swap(job: Path, value: bytes, revision: int) -> None:
        job.mkdir(parents=True, exist_ok=True)
        with open(job / "pointer.lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            _, current = _read_pointer(job / "pointer")
            if current != revision:
                raise FailedPrecondition(f"weights pointer in {job} is at revision {current}, not {revision}")
            _write_atomically(job / "pointer", b"%d\n" % (revision + 1), value)


def _read_pointer(path: Path) -> tuple[bytes | None, int]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, 0
    revision, _, value = raw.partition(b"\n")
    return value, int(revision)


def _read_payload(path: Path, what: str, size: int | None) -> Fetched:
    """The payload file's bytes into a buffer of their own, hashed, with the digest its header records."""
    try:
        with open(path, "rb") as file:
            stored = os.fstat(file.fileno()).st_size - DIGEST_BYTES
            recorded = file.read(DIGEST_BYTES).decode()
            size = stored if size is None else size
            if stored != size:
                raise WeightsCorrupt(f"{what}: object has {stored} bytes, pointer {size}")
            buffer, filled = allocate(size), 0
            while filled < size and (count := file.readinto(buffer[filled:])):
                filled += count
    except FileNotFoundError as error:
        raise NotFound(f"weights object {what} does not exist") from error
    if filled != size:
        raise WeightsCorrupt(f"{what}: {filled} bytes read, {size} stored")
    return Fetched(buffer, hashlib.sha256(buffer).hexdigest(), recorded)


def _write_atomically(path: Path, *parts: bytes | memoryview) -> None:
    """parts, written to a temporary file beside path, flushed, renamed to path, the directory flushed; the
    temporary file removed when that fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{_TEMPORARY}{path.name}-{uuid.uuid4().hex}")
    try:
        with open(temporary, "wb") as file:
            for part in parts:
                file.write(part)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _remove_temporaries(directory: Path) -> None:
    """What puts left whose process was killed before it renamed or removed them."""
    for leftover in directory.glob(f"{_TEMPORARY}*") if directory.exists() else ():
        leftover.unlink(missing_ok=True)
