"""The delta codec alone: exact round trips, and every way a delta can fail to apply."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from fleetrl.errors import WeightsCorrupt
from fleetrl.weights import delta as weight_delta


def _pair(size: int, changed: int, seed: int = 0) -> tuple[bytes, bytes, str, str]:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size, dtype=np.uint8)
    new = base.copy()
    new[rng.choice(size, changed, replace=False)] ^= np.uint8(1 + seed % 255)
    return base.tobytes(), new.tobytes(), hashlib.sha256(base).hexdigest(), hashlib.sha256(new).hexdigest()


@pytest.mark.parametrize(("size", "changed"), [(1_000_000, 20_000), (999_999, 5), (64, 0), (2, 2)])
def test_round_trip_is_exact(size: int, changed: int) -> None:
    base, new, base_sha, new_sha = _pair(size, changed)
    delta = weight_delta.encode(base, new, base_sha, new_sha)
    held = memoryview(bytearray(base))
    header = weight_delta.apply_inplace(held, delta, base_sha)
    assert bytes(held) == new and header.sha256 == new_sha and header.unit == (2 if size % 2 == 0 else 1)


def test_long_gaps_are_bridged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weight_delta, "MAX_GAP", 1000)
    base, new, base_sha, new_sha = _pair(100_000, 3)
    delta = weight_delta.encode(base, new, base_sha, new_sha)
    assert weight_delta.read_header(delta)[0].count >= 50  # 50_000 words: a bridge every 1000
    held = memoryview(bytearray(base))
    weight_delta.apply_inplace(held, delta, base_sha)
    assert bytes(held) == new


def test_a_delta_for_other_weights_is_refused_untouched() -> None:
    base, new, base_sha, new_sha = _pair(10_000, 100)
    delta = weight_delta.encode(base, new, base_sha, new_sha)
    held = memoryview(bytearray(base))
    with pytest.raises(WeightsCorrupt, match="applies to sha256"):
        weight_delta.apply_inplace(held, delta, new_sha)
    with pytest.raises(WeightsCorrupt, match="is for 10000 bytes"):
        weight_delta.apply_inplace(memoryview(bytearray(base + b"xx")), delta, base_sha)
    assert bytes(held) == base
    with pytest.raises(ValueError, match="one size"):
        weight_delta.encode(base, new[:-2], base_sha, new_sha)


@pytest.mark.parametrize("damage", ["frame", "header", "truncated"])
def test_a_damaged_delta_is_refused_untouched(damage: str) -> None:
    base, new, base_sha, new_sha = _pair(10_000, 100)
    delta = bytearray(weight_delta.encode(base, new, base_sha, new_sha))
    if damage == "frame":
        delta[-6] ^= 0x40
    elif damage == "header":
        delta[10] = ord("!")
    else:
        del delta[-20:]
    held = memoryview(bytearray(base))
    with pytest.raises(WeightsCorrupt):
        weight_delta.apply_inplace(held, bytes(delta), base_sha)
    assert bytes(held) == base
