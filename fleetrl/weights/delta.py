"""Deltas between two published weight payloads: the positions and new values of the words that
changed, compressed with zstd.

A delta object is an 8-byte little-endian header size, a JSON header {encoding, unit, count,
base_sha256, sha256, bytes}, then one zstd frame (content size and checksum recorded) holding `count`
gaps (uint32: each position minus the one before, the first from 0) and then the `count` new words
(`unit` bytes each: 2, a bf16 or fp16 value, when the payload's size is even, else 1). The payload is
taken whole, safetensors header included: two versions of one model have the same header, so it
never changes, and a delta between payloads of different sizes is refused.

Design choice (measured; figures and commands in docs/ARCHITECTURE.md): between two optimizer steps
at the demo's learning rate a few percent of the bf16 values change. zstd shrinks either a dense
XOR of the two payloads or this sparse list to about the same few percent of the payload, but a
reader of the XOR decompresses the whole payload's size, and one of the sparse list only the
entries, then scatters them with numpy: about 3x less work on the reader's side, which is where a
fleet spends it (every actor, every version). A gap above 2**32 - 1 words is bridged by an entry
that rewrites an unchanged word with its own value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import zstandard

from fleetrl.errors import WeightsCorrupt

ENCODING = "sparse+zstd"
ZSTD_LEVEL = 1
"""Level 3 compressed no smaller on SmolLM2 steps and took longer."""
MAX_GAP = 2**32 - 1


@dataclass(frozen=True)
class DeltaHeader:
    base_sha256: str
    """sha256 of the payload the delta applies to."""
    sha256: str
    """sha256 of the payload it produces."""
    size_bytes: int
    """Size of both payloads."""
    unit: int
    """Bytes per word."""
    count: int
    """Entries (changed words, plus any bridging a long gap)."""


def encode(base: bytes | memoryview, new: bytes | memoryview, base_sha256: str, sha256: str) -> bytes:
    """The delta that turns `base` (digest base_sha256) into `new` (digest sha256)."""
    if len(base) != len(new):
        raise ValueError(f"a delta needs payloads of one size, not {len(base)} and {len(new)} bytes")
    unit = 2 if len(new) % 2 == 0 else 1
    old_words, new_words = _words(base, unit), _words(new, unit)
    positions = np.flatnonzero(old_words != new_words)
    if len(new_words) > MAX_GAP:
        positions = np.union1d(positions, np.arange(0, len(new_words), MAX_GAP))
    gaps = np.diff(positions, prepend=0).astype(np.uint32)
    header = json.dumps({"encoding": ENCODING, "unit": unit, "count": len(positions), "base_sha256": base_sha256,
                         "sha256": sha256, "bytes": len(new)}, sort_keys=True).encode()
    body = gaps.tobytes() + new_words[positions].tobytes()
    frame = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True).compress(body)
    return len(header).to_bytes(8, "little") + header + frame


def read_header(delta: bytes | memoryview) -> tuple[DeltaHeader, int]:
    """The delta's header and the offset of its zstd frame; WeightsCorrupt if it is not a delta."""
    try:
        size = int.from_bytes(delta[:8], "little")
        if not 0 < size <= len(delta) - 8:
            raise ValueError(f"header size {size} out of range")
        fields = json.loads(bytes(delta[8 : 8 + size]))
        if fields["encoding"] != ENCODING:
            raise ValueError(f"encoding {fields['encoding']!r} is not {ENCODING!r}")
        header = DeltaHeader(str(fields["base_sha256"]), str(fields["sha256"]), int(fields["bytes"]),
                             int(fields["unit"]), int(fields["count"]))
        if header.unit not in (1, 2) or header.size_bytes % header.unit or header.count < 0:
            raise ValueError(f"unit {header.unit} and count {header.count} do not fit {header.size_bytes} bytes")
    except (ValueError, KeyError, TypeError) as error:  # json's errors are ValueErrors
        raise WeightsCorrupt(f"not a weights delta: {error}") from error
    return header, 8 + size


def apply_inplace(held: memoryview, delta: bytes | memoryview, held_sha256: str) -> DeltaHeader:
    """Write the delta's words into `held` (writable, the payload whose digest is held_sha256); its
    header.

    WeightsCorrupt, before anything is written, when the delta is for another base or size, or its
    frame is damaged (zstd's checksum, its size, a position past the end). The result's digest is the
    caller's to check (it hashes once at the end of a chain, not after each delta)."""
    header, offset = read_header(delta)
    if header.base_sha256 != held_sha256:
        raise WeightsCorrupt(f"delta applies to sha256 {header.base_sha256[:12]}, held is {held_sha256[:12]}")
    if header.size_bytes != len(held):
        raise WeightsCorrupt(f"delta is for {header.size_bytes} bytes, held is {len(held)}")
    expected = header.count * (4 + header.unit)
    try:
        body = zstandard.ZstdDecompressor().decompress(memoryview(delta)[offset:], max_output_size=expected)
    except zstandard.ZstdError as error:
        raise WeightsCorrupt(f"delta frame damaged: {error}") from error
    if len(body) != expected:
        raise WeightsCorrupt(f"delta holds {len(body)} bytes of entries, records {expected}")
    positions = np.cumsum(np.frombuffer(body, dtype=np.uint32, count=header.count), dtype=np.int64)
    words = _words(held, header.unit)
    if header.count and positions[-1] >= len(words):
        raise WeightsCorrupt(f"delta writes word {positions[-1]} of {len(words)}")
    words[positions] = np.frombuffer(body, dtype=words.dtype, offset=4 * header.count)
    return header


def _words(buffer: bytes | memoryview, unit: int) -> np.ndarray:
    return np.frombuffer(buffer, dtype=np.uint16 if unit == 2 else np.uint8)
