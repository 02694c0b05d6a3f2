"""What a job's weights travel through: one `Transport` Protocol, one file per implementation.

A transport stores a job's named payloads (`put`, `get`, `delete`, `names`) and one small record per job,
the pointer (`read_pointer`, `swap_pointer`, `watch_pointer`), with beside it the note a reader leaves when
it cannot apply a delta chain (`read_resync`, `write_resync`); it says what all that holds (`usage`) and
deletes all of it when the job's data goes (`purge`: `fleetrl.jobs.retention`, for `fleetrl delete` and
the gateway's retention). It knows nothing of versions, chains, deltas
or adapters, and the pointer is opaque bytes to it (`WeightPointer.to_json`): `fleetrl.weights.channel`
holds those rules once, above every transport (never backwards, the lease-epoch fence, the digest check,
retention). Implementations:
- `fleetrl.weights.jetstream.NatsTransport`: JetStream's object store and the KV pointer; the default.
- `fleetrl.weights.filesystem.FilesystemTransport`: a directory per job, on one box or a shared volume.
`fleetrl.weights.factory` picks one from the services' `weights_dir` setting.

Design choices:
- The pointer is compare-and-swapped on a revision that each read hands out, and the channel checks the lease
  epoch of the pointer it read before it swaps: read, check, swap fences a stale learner atomically without
  the transport parsing the pointer.
- `put` returns the payload's sha256 and records it beside the payload; `get` returns the sha256 of what it
  read and the recorded one, and the channel compares them with the pointer's. Each implementation hashes
  while it moves the bytes (the NATS one in a worker thread as chunks arrive), and the check is written once.
- `get` returns a writable buffer the caller owns: deltas are applied to it in place.

Errors keep their types across transports, because callers handle them by type:
- `NotFound` (a KeyError): `get` of a name that does not exist, or was deleted while it was read.
- `WeightsCorrupt`: the stored payload is not the `size` asked for, or its stored parts do not add up.
- `FailedPrecondition`: `swap_pointer` from a revision that is no longer the current one.
- Outages and full stores raise the transport's own types, which callers wait out by name: NATS raises
  `bus.NatsUnreachable` and `bus.JetStreamFull` from `put` (the learner's `fleetrl.train.full_stores` pauses
  the job on them), one of `bus.NATS_UNREACHABLE` from a pointer read while the server restarts (the
  actor's `fleetrl.rollout.job_policy` keeps what it holds), `Unavailable` from a `get` whose connection was
  lost. They are not mapped to transport-neutral types, which would have to be threaded through both. A
  transport wired into the learner next must name its own outage and full-store errors in
  `full_stores.WAITED_OUT`; the filesystem transport raises OSError (ENOSPC among them), which is not
  waited out: a learner whose weights directory is full fails its job.

Deadlines: `put` returns or raises within a deadline of its own that grows with the payload (at least
MIN_MB_S). `get` has none of its own: the channel bounds a whole pull, deltas and all, and cancels it, so a
cancelled `get` must release what it holds. Each pointer operation is one request with its deadline.
"""

from __future__ import annotations

import mmap
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Literal, Protocol

MIN_MB_S = 20.0
"""The slowest rate deadlines allow for a payload's bytes: a write's (`Transport.put`) and a pull's
(`WeightChannel.update`) grow by the payload at this rate."""


@dataclass(frozen=True)
class Fetched:
    """A payload as `Transport.get` read it."""

    payload: memoryview
    """Writable, owned by the caller."""
    sha256: str
    """Of `payload`, as read."""
    recorded_sha256: str
    """What `put` recorded for it."""


@dataclass(frozen=True)
class Usage:
    """What a job's weights hold in their transport's store (`Transport.usage`), as retention counts it."""

    store: Literal["nats", "disk"]
    """Where they are: NATS JetStream or a file system."""
    items: int
    """NATS messages (payload chunks and metadata, the pointer's and the note's entries) or files."""
    size_bytes: int
    """Bytes of the payloads (NATS: of the job's object store bucket; a file system: of every file)."""


class Transport(Protocol):
    """A job's named payloads and its pointer; see the module docstring for errors and deadlines."""

    async def put(self, job_id: str, name: str, payload: bytes | memoryview) -> str:
        """Store payload under name; its sha256 hex, recorded with it. A put that fails leaves nothing `get`
        or `names` finds, and what it did write is reclaimed by the job's next put at the latest (a job's
        payloads have one writer, the learner that fenced its pointer)."""
        ...

    async def get(self, job_id: str, name: str, size: int | None) -> Fetched:
        """The payload stored under name: WeightsCorrupt unless it is `size` bytes (any size when None),
        NotFound when there is none."""
        ...

    async def delete(self, job_id: str, name: str) -> None:
        """Remove the payload under name, if there is one; a reader of it meanwhile ends in NotFound."""
        ...

    async def names(self, job_id: str) -> list[str]:
        """The names of the job's stored payloads ([] before its first put)."""
        ...

    async def read_pointer(self, job_id: str) -> tuple[bytes | None, int]:
        """The job's pointer and its revision: (None, 0) when never written, and a revision above 0 for a
        pointer that was written and removed."""
        ...

    async def swap_pointer(self, job_id: str, value: bytes, revision: int) -> None:
        """Write the pointer if its revision is still `revision` (0: create it); else FailedPrecondition."""
        ...

    def watch_pointer(self, job_id: str) -> AsyncGenerator[bytes]:
        """The pointer's values as it is written, the current one first; runs until the caller closes it."""
        ...

    async def read_resync(self, job_id: str) -> bytes | None:
        """The job's resync note, or None when there is none."""
        ...

    async def write_resync(self, job_id: str, value: bytes) -> None:
        """Set the job's resync note (last writer wins)."""
        ...

    async def usage(self, job_id: str) -> Usage:
        """What the job's payloads, pointer and note hold now (nothing: 0 items)."""
        ...

    async def purge(self, job_id: str) -> None:
        """Delete the job's payloads, pointer and note, whatever of them there is. For a job that has ended:
        a learner still publishing would write again."""
        ...


def allocate(size: int) -> memoryview:
    """`size` zeroed writable bytes for a `get` to read into: anonymous memory with its pages mapped up front
    (MAP_POPULATE), which costs less than faulting them in one by one, as `bytearray(size)` does."""
    if not size:
        return memoryview(bytearray())
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)  # Linux only
    return memoryview(mmap.mmap(-1, size, flags=flags))
