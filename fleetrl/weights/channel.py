"""A job's weight versions over any `Transport`: the learner publishes, actors pull, and the rules live here.

Layout (docs/ARCHITECTURE.md, data flow step 9): a job's payloads `v<version>` hold safetensors bytes (full
snapshots) and `d<version>` deltas (`fleetrl.weights.delta`: the changed words and their positions,
zstd-compressed); its pointer is JSON {version, object, sha256, bytes, dtype, kind[, chain][, base]}, moved
only forward by compare-and-swap. A LoRA job's payloads `v<version>` hold its adapter tensors only (kind
"adapter", `base` the model they apply to; `fleetrl.weights.adapters`): each is whole, never a delta. The
resync note beside the pointer is where a reader reports a chain it cannot apply. Where the bytes go is the
transport's (`fleetrl.weights.transport`; NATS JetStream's object store and KV in `fleetrl.weights.store`).

Design choices:
- A publish whose version is not above the pointer's raises FailedPrecondition before anything
  is written: the object `v<version>` may be the one actors are pulling, so it is never
  overwritten. A learner that resumes asks `latest()` and publishes above it.
- The pointer is fenced by the job-lease epoch: every move reads it, refuses (Fenced) when a newer epoch
  moved it, and swaps it on the revision it read, so nothing moved it in between.
- Chains: a delta version's pointer lists its chain, the full snapshot it builds on and every
  version after it, so a reader holding any of them applies the deltas after it in order and one
  holding none (new, or behind the snapshot) pulls the snapshot first. The pointer's sha256 is
  always that of the full payload, and a reader hashes what it rebuilt, so a delta can never
  silently corrupt weights: a mismatch, a damaged or a missing delta sends the reader to the full
  snapshot; if the snapshot's own chain fails, the reader reports it (`request_full`) and the
  publisher's next publish, or `repair` of the current version, is a full snapshot. The publisher
  starts a new chain every `full_interval` versions and after each restart (it holds no base then).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch
from safetensors.torch import save as st_save

from fleetrl.errors import DeadlineExceeded, FailedPrecondition, Fenced, NotFound, WeightsCorrupt
from fleetrl.weights import delta as weight_delta
from fleetrl.weights.transport import MIN_MB_S, Transport

log = logging.getLogger(__name__)

MIN_PULL_TIMEOUT_S = 30.0
"""Default pull deadline: MIN_PULL_TIMEOUT_S plus the payload at `transport.MIN_MB_S`."""
_OBJECT_RE = re.compile(r"^([vd])(\d+)$")
"""Weight objects: `v<n>` full snapshots, `d<n>` deltas."""
_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
}
"""safetensors dtype names fleetrl may publish."""


@dataclass(frozen=True)
class WeightPointer:
    """The pointer's value, naming one published weight version.

    On the wire it is JSON {version, object, sha256, bytes, dtype, kind, epoch} (the design's pointer
    format plus `kind` and the fencing token), `chain` for a delta and `base` for an adapter: `object_name` travels as
    "object" and `size_bytes` as "bytes"; a pointer without "epoch" reads as epoch 0. `sha256` and
    `size_bytes` are always those of the version's full payload, the weights a reader ends up with,
    whichever object carries them."""

    version: int
    object_name: str
    """Name of the job's payload: `v<version>` (full) or `d<version>` (delta)."""
    sha256: str
    size_bytes: int
    """Size of the full safetensors payload."""
    dtype: str
    chain: tuple[int, ...] = ()
    """For a delta: the versions from the full snapshot it builds on (first) up to this one (last);
    each object `d<n>` turns the version before it in the chain into n. () for a full snapshot."""
    epoch: int = 0
    """Job-lease epoch of the learner that moved the pointer here: a lower epoch may not move it."""
    base: str = ""
    """For an adapter (a LoRA job): the base model the adapter applies to (the job's `model`); the
    payload then holds adapter tensors only. "" for full weights."""

    @property
    def kind(self) -> str:
        """"adapter" (LoRA tensors on `base`), "delta" (a chain's step) or "full" (every weight)."""
        if self.base:
            return "adapter"
        return "delta" if self.chain else "full"

    @property
    def full_version(self) -> int:
        """The version of the full snapshot this version is reconstructed from (itself when full)."""
        return self.chain[0] if self.chain else self.version

    def to_json(self) -> bytes:
        fields: dict[str, object] = {"version": self.version, "object": self.object_name, "sha256": self.sha256,
                                     "bytes": self.size_bytes, "dtype": self.dtype, "kind": self.kind,
                                     "epoch": self.epoch}
        if self.chain:
            fields["chain"] = list(self.chain)
        if self.base:
            fields["base"] = self.base
        return json.dumps(fields, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> WeightPointer:
        fields = json.loads(raw)
        return cls(
            version=int(fields["version"]), object_name=str(fields["object"]), sha256=str(fields["sha256"]),
            size_bytes=int(fields["bytes"]), dtype=str(fields["dtype"]),
            chain=tuple(int(v) for v in fields.get("chain", ())), epoch=int(fields.get("epoch", 0)),
            base=str(fields.get("base", "")),
        )


@dataclass(frozen=True)
class HeldWeights:
    """One version's full payload as a publisher or reader holds it: the base of the next delta."""

    pointer: WeightPointer
    payload: memoryview
    """The payload whose sha256 is pointer.sha256; a reader's is writable (deltas apply in place)."""


@dataclass(frozen=True)
class Pulled:
    """The result of `WeightChannel.update`."""

    payload: memoryview
    """The full payload of the pointer's version, its sha256 checked against the pointer's."""
    pulled_bytes: int
    """Bytes of objects read (snapshot and deltas)."""
    fallback: str | None
    """Why a reader holding an older version pulled the full snapshot instead of deltas only:
    "behind" (it held no version of the pointer's chain), "delta_missing", "delta_corrupt"; None
    when it did not (or held nothing)."""


def encode_safetensors(tensors: dict[str, torch.Tensor]) -> bytes:
    """safetensors bytes of a state dict (tensors must be contiguous and unshared)."""
    return st_save(tensors)


def decode_safetensors(payload: memoryview) -> dict[str, torch.Tensor]:
    """The tensors of a pulled payload, each copied out once into its own storage, as safetensors'
    `load` would (which takes only bytes, and so would need one more copy of the whole payload).

    The format: an 8-byte little-endian header size, a JSON header {name: {dtype, shape,
    data_offsets}} (and an optional __metadata__), then the data, aligned for each dtype."""
    header_size = int.from_bytes(payload[:8], "little")
    header = json.loads(bytes(payload[8 : 8 + header_size]))
    data = torch.frombuffer(payload, dtype=torch.uint8)[8 + header_size :]
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name != "__metadata__":
            start, end = entry["data_offsets"]
            tensors[name] = data[start:end].view(_DTYPES[entry["dtype"]]).reshape(entry["shape"]).clone()
    return tensors


class WeightChannel:
    """Publish, find, pull and watch jobs' weights through one transport."""

    transport: Transport

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    async def publish(self, job_id: str, version: int, payload: bytes, dtype: str, *, keep: int = 3,
                      base: HeldWeights | None = None, full_interval: int = 1, lease_epoch: int = 0,
                      adapter_of: str = "") -> WeightPointer:
        """Write `version` as a full snapshot `v<version>` or as a delta `d<version>` against `base`,
        move the pointer to it, prune (`_prune`). With `adapter_of` (a base model) the payload is a
        LoRA job's adapter tensors, written whole as `v<version>` with a pointer of kind "adapter".

        A delta is written when `base` is the version the pointer names, the pointer's chain holds
        fewer than `full_interval` versions, and no reader has reported that chain broken
        (`request_full`); otherwise a full snapshot. Raises FailedPrecondition if the pointer is
        already at `version` or above, or moves meanwhile, and Fenced (before writing anything) if it
        was moved under a newer job-lease epoch than lease_epoch.
        """
        current, revision = await self._pointer_entry(job_id)
        _check_epoch(job_id, current, lease_epoch)
        _check_forward(current, version)
        chain = () if adapter_of else await self._next_chain(job_id, current, base, version, full_interval,
                                                             len(payload))
        await self._delete_unreferenced(job_id, f"v{version}", f"d{version}")
        if chain:
            assert base is not None
            sha256_hex = await asyncio.to_thread(_sha256, payload)
            delta = await asyncio.to_thread(weight_delta.encode, base.payload, payload, base.pointer.sha256,
                                            sha256_hex)
            name = f"d{version}"
            await self._write_object(job_id, name, delta)
        else:
            name = f"v{version}"
            sha256_hex = await self._write_object(job_id, name, payload)
        pointer = WeightPointer(version=version, object_name=name, sha256=sha256_hex, size_bytes=len(payload),
                                dtype=dtype, chain=chain, epoch=lease_epoch, base=adapter_of)
        await self._move_pointer(job_id, pointer, revision)
        await self._prune(job_id, keep, pointer)
        return pointer

    async def fence(self, job_id: str, lease_epoch: int) -> WeightPointer | None:
        """Stamp the current pointer (same version and object) with lease_epoch, so no learner of an
        older epoch can move it any more; Fenced if a newer epoch stamped it. Returns the pointer."""
        current, revision = await self._pointer_entry(job_id)
        _check_epoch(job_id, current, lease_epoch)
        if current is None or current.epoch == lease_epoch:
            return current
        stamped = dataclasses.replace(current, epoch=lease_epoch)
        await self._move_pointer(job_id, stamped, revision)
        return stamped

    async def latest(self, job_id: str) -> WeightPointer | None:
        """The job's current pointer, or None before its first publish."""
        pointer, _ = await self._pointer_entry(job_id)
        return pointer

    async def pull(self, job_id: str, pointer: WeightPointer, *, timeout_s: float | None = None) -> memoryview:
        """The full payload of the pointer's version (memory the caller owns), verified against the
        pointer (WeightsCorrupt), within a deadline: `update` with nothing held."""
        return (await self.update(job_id, pointer, None, timeout_s=timeout_s)).payload

    async def update(self, job_id: str, pointer: WeightPointer, held: HeldWeights | None, *,
                     timeout_s: float | None = None) -> Pulled:
        """The pointer's version, reached from `held` by deltas when `held` is a version of the
        pointer's chain, else from the chain's full snapshot (then `Pulled.fallback` says why).

        `held.payload` is updated in place: after the call it belongs to the result, or, when the call
        raises, to nobody. A delta missing or failing its checks while applied to `held` makes the
        update start again from the full snapshot. When the full snapshot's own chain is broken the
        reader asks the publisher for a full snapshot (`request_full`) and raises WeightsCorrupt or
        NotFound, as it does for a missing or damaged full object. DeadlineExceeded past `timeout_s`
        (default MIN_PULL_TIMEOUT_S plus the payload, twice for a delta, at `transport.MIN_MB_S`).
        """
        if timeout_s is None:
            timeout_s = MIN_PULL_TIMEOUT_S + pointer.size_bytes * (2 if pointer.chain else 1) / (MIN_MB_S * 1e6)
        try:
            return await asyncio.wait_for(self._update(job_id, pointer, held), timeout_s)
        except TimeoutError as error:
            raise DeadlineExceeded(f"pull of {job_id}/{pointer.object_name} took over {timeout_s:.0f}s") from error

    async def request_full(self, job_id: str, full_version: int) -> None:
        """Report that the chain built on snapshot `full_version` cannot be applied: the publisher's
        next `publish` (or `repair`) writes a full snapshot."""
        await self.transport.write_resync(job_id, str(full_version).encode())

    async def repair(self, job_id: str, held: HeldWeights, lease_epoch: int = 0) -> WeightPointer | None:
        """When a reader reported the current chain broken and `held` is the pointer's version, write
        that version again as a full snapshot and point at it (same version, same sha256: readers
        holding it lose nothing); the new pointer, or None when there is nothing to repair. Fenced
        (before writing anything) when a newer job-lease epoch moved the pointer."""
        current, revision = await self._pointer_entry(job_id)
        _check_epoch(job_id, current, lease_epoch)
        if current is None or not current.chain or current != held.pointer:
            return None
        if await self._full_wanted(job_id) != current.full_version:
            return None
        name = f"v{current.version}"
        await self._delete_unreferenced(job_id, name)
        if await self._write_object(job_id, name, held.payload) != current.sha256:
            raise WeightsCorrupt(f"{job_id}: held payload of v{current.version} differs from its pointer")
        pointer = dataclasses.replace(current, object_name=name, chain=())
        await self._move_pointer(job_id, pointer, revision)
        log.warning("job %s: chain from v%d reported broken; v%d rewritten as a full snapshot", job_id,
                    current.full_version, current.version)
        return pointer

    async def watch(self, job_id: str) -> AsyncIterator[WeightPointer]:
        """Pointers with strictly increasing versions as the key moves, the current one first."""
        newest = -1
        async with contextlib.aclosing(self.transport.watch_pointer(job_id)) as values:
            async for value in values:
                pointer = WeightPointer.from_json(value)
                if pointer.version > newest:
                    newest = pointer.version
                    yield pointer

    # ---------------------------------------------------------------- pointer

    async def _pointer_entry(self, job_id: str) -> tuple[WeightPointer | None, int]:
        """(pointer, revision); (None, 0) when absent, (None, revision) when deleted."""
        value, revision = await self.transport.read_pointer(job_id)
        return (None if value is None else WeightPointer.from_json(value)), revision

    async def _move_pointer(self, job_id: str, pointer: WeightPointer, revision: int) -> None:
        """Compare-and-swap from `revision`; someone else moving it first is a FailedPrecondition."""
        try:
            await self.transport.swap_pointer(job_id, pointer.to_json(), revision)
        except FailedPrecondition as error:
            raise FailedPrecondition(
                f"weights pointer of {job_id} moved during publish of {pointer.object_name}") from error

    async def _next_chain(self, job_id: str, current: WeightPointer | None, base: HeldWeights | None,
                          version: int, full_interval: int, size: int) -> tuple[int, ...]:
        """The chain of `version` if it may be a delta against `base`, else () (full snapshot)."""
        if base is None or current is None or base.pointer != current or size != current.size_bytes:
            return ()
        chain = current.chain or (current.version,)
        if len(chain) >= full_interval or await self._full_wanted(job_id) == chain[0]:
            return ()
        return (*chain, version)

    async def _full_wanted(self, job_id: str) -> int | None:
        """The snapshot version whose chain a reader reported broken, if any."""
        value = await self.transport.read_resync(job_id)
        return int(value) if value else None

    # ---------------------------------------------------------------- chains

    async def _update(self, job_id: str, pointer: WeightPointer, held: HeldWeights | None) -> Pulled:
        if not pointer.chain:
            payload, _ = await self._read_object(job_id, pointer.object_name, pointer.size_bytes, pointer.sha256)
            return Pulled(payload, pointer.size_bytes, None)
        fallback, pulled_bytes = None, 0
        if held is not None and held.pointer.version in pointer.chain[:-1]:
            try:
                return await self._apply_chain(job_id, pointer, held.payload, held.pointer.sha256, held.pointer.version)
            except NotFound as error:
                fallback = "delta_missing"
                log.warning("job %s: %s; pulling the full snapshot v%d", job_id, error, pointer.full_version)
            except WeightsCorrupt as error:
                fallback = "delta_corrupt"
                log.warning("job %s: %s; pulling the full snapshot v%d", job_id, error, pointer.full_version)
        elif held is not None:
            fallback = "behind"
        snapshot, sha256_hex = await self._read_object(job_id, f"v{pointer.full_version}", None, None)
        try:
            pulled = await self._apply_chain(job_id, pointer, snapshot, sha256_hex, pointer.full_version)
        except (NotFound, WeightsCorrupt):
            await self.request_full(job_id, pointer.full_version)
            raise
        pulled_bytes += len(snapshot) + pulled.pulled_bytes
        return Pulled(pulled.payload, pulled_bytes, fallback)

    async def _apply_chain(self, job_id: str, pointer: WeightPointer, payload: memoryview, sha256_hex: str,
                           after: int) -> Pulled:
        """Apply the deltas of pointer.chain past version `after` to payload (whose digest is
        sha256_hex) in place; check the result's digest against the pointer's."""
        pulled_bytes = 0
        for version in pointer.chain[pointer.chain.index(after) + 1 :]:
            delta, _ = await self._read_object(job_id, f"d{version}", None, None)
            pulled_bytes += len(delta)
            header = await asyncio.to_thread(weight_delta.apply_inplace, payload, delta, sha256_hex)
            sha256_hex = header.sha256
        if await asyncio.to_thread(_sha256, payload) != pointer.sha256:
            raise WeightsCorrupt(f"{job_id}: weights rebuilt for v{pointer.version} differ from the pointer's sha256")
        return Pulled(payload, pulled_bytes, None)

    # ---------------------------------------------------------------- objects

    async def _write_object(self, job_id: str, name: str, payload: bytes | memoryview) -> str:
        """The transport's put: the payload's sha256 hex."""
        return await self.transport.put(job_id, name, payload)

    async def _read_object(self, job_id: str, name: str, size: int | None, sha256_hex: str | None
                           ) -> tuple[memoryview, str]:
        """The object's bytes and sha256, checked against `size` and `sha256_hex` (a pointer's), or
        when those are None against what the writer recorded."""
        fetched = await self.transport.get(job_id, name, size)
        if fetched.sha256 != (fetched.recorded_sha256 if sha256_hex is None else sha256_hex):
            raise WeightsCorrupt(f"{job_id}/{name}: sha256 differs from the recorded one")
        return fetched.payload, fetched.sha256

    async def _delete_unreferenced(self, job_id: str, *names: str) -> None:
        """Delete these objects if they exist: objects of a version above the pointer (or a full copy of
        its delta) that a publisher which died before moving the pointer left."""
        for name in names:
            await self.transport.delete(job_id, name)

    async def _prune(self, job_id: str, keep: int, pointer: WeightPointer) -> None:
        """Keep what a reader may still need: the objects of the pointer's chain, the newest `keep`
        full snapshots at or below the pointer, and the deltas above the oldest of those (a reader
        part-way through an older chain finishes it). Objects above the pointer are left alone."""
        named = [(m.group(1), int(m.group(2)), name) for name in await self.transport.names(job_id)
                 if (m := _OBJECT_RE.match(name))]
        fulls = sorted(v for kind, v, _ in named if kind == "v" and v <= pointer.version)
        kept = set(fulls[-max(1, keep):])
        oldest = min(kept | {pointer.full_version})
        needed = {f"v{v}" for v in kept | {pointer.full_version}} | {f"d{v}" for v in pointer.chain[1:]}
        for kind, version, name in named:
            stale = version < oldest if kind == "d" else True
            if name not in needed and version <= pointer.version and stale:
                await self.transport.delete(job_id, name)


def _sha256(payload: bytes | memoryview) -> str:
    return hashlib.sha256(payload).hexdigest()


def _check_epoch(job_id: str, current: WeightPointer | None, lease_epoch: int) -> None:
    if current is not None and current.epoch > lease_epoch:
        raise Fenced(f"job {job_id}: weights under lease epoch {lease_epoch} refused: the pointer was moved "
                     f"under epoch {current.epoch} (another learner holds the job)")


def _check_forward(current: WeightPointer | None, version: int) -> None:
    if current is not None and version <= current.version:
        raise FailedPrecondition(f"weights version {version} is not above the published {current.version}")
