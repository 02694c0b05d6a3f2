"""Deltas between two published weight payloads: the XOR of their bytes, compressed with zstd.

A delta object is an 8-byte little-endian header size, a JSON header {encoding, base_sha256,
sha256, bytes}, then one zstd frame (content size and checksum recorded) of `base XOR new`.

Design choice (measured, `python -m bench.weights --json --deltas`; figures in docs/ARCHITECTURE.md):
between two optimizer steps at the demo's learning rate a few percent of the bf16 values change, and
the XOR of two payloads is zero everywhere else, so zstd level 1 shrinks it to a few percent of the
payload, as small as sparse (index, value) lists compressed the same way and simpler. The XOR runs
over the whole safetensors payload, header included: two versions of one model have the same header,
so it XORs to zeros, and a delta between payloads of different sizes is refused. Both directions
work in slices of SLICE_BYTES, so neither side holds a second full-size buffer; applying XORs into
the reader's copy of the base in place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import zstandard

from services.common.errors import WeightsCorrupt

ENCODING = "xor+zstd"
ZSTD_LEVEL = 1
"""Level 3 compressed no smaller on SmolLM2 steps and took longer."""
SLICE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class DeltaHeader:
    base_sha256: str
    """sha256 of the payload the delta applies to."""
    sha256: str
    """sha256 of the payload it produces."""
    size_bytes: int
    """Size of both payloads."""


def encode(base: bytes | memoryview, new: bytes | memoryview, base_sha256: str, sha256: str) -> bytes:
    """The delta that turns `base` (digest base_sha256) into `new` (digest sha256)."""
    if len(base) != len(new):
        raise ValueError(f"a delta needs payloads of one size, not {len(base)} and {len(new)} bytes")
    header = json.dumps({"encoding": ENCODING, "base_sha256": base_sha256, "sha256": sha256,
                         "bytes": len(new)}, sort_keys=True).encode()
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True).compressobj(size=len(new))
    base_u8, new_u8 = _u8(base), _u8(new)
    parts = [len(header).to_bytes(8, "little"), header]
    for start in range(0, len(new), SLICE_BYTES):
        end = min(start + SLICE_BYTES, len(new))
        parts.append(compressor.compress(np.bitwise_xor(base_u8[start:end], new_u8[start:end])))
    parts.append(compressor.flush())
    return b"".join(parts)


def read_header(delta: bytes | memoryview) -> tuple[DeltaHeader, int]:
    """The delta's header and the offset of its zstd frame; WeightsCorrupt if it is not a delta."""
    try:
        size = int.from_bytes(delta[:8], "little")
        if not 0 < size <= len(delta) - 8:
            raise ValueError(f"header size {size} out of range")
        fields = json.loads(bytes(delta[8 : 8 + size]))
        if fields["encoding"] != ENCODING:
            raise ValueError(f"encoding {fields['encoding']!r} is not {ENCODING!r}")
        header = DeltaHeader(str(fields["base_sha256"]), str(fields["sha256"]), int(fields["bytes"]))
    except (ValueError, KeyError, TypeError) as error:  # json's errors are ValueErrors
        raise WeightsCorrupt(f"not a weights delta: {error}") from error
    return header, 8 + size


def apply_inplace(held: memoryview, delta: bytes | memoryview, held_sha256: str) -> DeltaHeader:
    """XOR the delta into `held` (writable, the payload whose digest is held_sha256); its header.

    WeightsCorrupt, before anything is written, when the delta is for another base or size; WeightsCorrupt
    after a partial write when its frame is damaged (zstd's checksum or content size), so the caller
    must treat `held` as lost then. The result's digest is the caller's to check (it hashes once at the
    end of a chain, not after each delta)."""
    header, offset = read_header(delta)
    if header.base_sha256 != held_sha256:
        raise WeightsCorrupt(f"delta applies to sha256 {header.base_sha256[:12]}, held is {held_sha256[:12]}")
    if header.size_bytes != len(held):
        raise WeightsCorrupt(f"delta is for {header.size_bytes} bytes, held is {len(held)}")
    target, filled = _u8(held), 0
    scratch = np.empty(SLICE_BYTES, dtype=np.uint8)
    try:
        with zstandard.ZstdDecompressor().stream_reader(memoryview(delta)[offset:]) as reader:
            while (got := reader.readinto(scratch)) > 0:
                if filled + got > len(held):
                    raise WeightsCorrupt(f"delta holds more than the {len(held)} bytes it records")
                np.bitwise_xor(target[filled : filled + got], scratch[:got], out=target[filled : filled + got])
                filled += got
    except zstandard.ZstdError as error:
        raise WeightsCorrupt(f"delta frame damaged: {error}") from error
    if filled != len(held):
        raise WeightsCorrupt(f"delta holds {filled} bytes, records {len(held)}")
    return header


def _u8(buffer: bytes | memoryview) -> np.ndarray:
    return np.frombuffer(buffer, dtype=np.uint8)
