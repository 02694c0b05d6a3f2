"""heap.set_mmap_threshold: freed blocks of the threshold's size go back to the kernel (glibc only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleetrl.runtime import heap

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import ctypes, ctypes.util, json, os, sys
from fleetrl.runtime import heap
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
block = 2 << 20
libc.free(libc.malloc(block))  # glibc's dynamic threshold now rises above 2 MiB
threshold = int(sys.argv[1])
assert heap.set_mmap_threshold(threshold)
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
blocks = [libc.malloc(block) for _ in range(200)]
for b in blocks:
    ctypes.memset(b, 1, block)  # resident
before = rss_mb()
for b in blocks[::2]:  # holes between live blocks: a heap cannot give them back by trimming its top
    libc.free(b)
print(json.dumps({"freed_mb": before - rss_mb(), "env": os.environ.get(heap.ENV)}))
"""


def probe(threshold: int) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(threshold)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    return dict(json.loads(out.stdout))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_fixed_threshold_returns_freed_blocks_to_the_kernel() -> None:
    default, fixed = probe(0), probe(1 << 20)
    assert float(str(default["freed_mb"])) < 20  # 200 MB freed into the heap's holes: kept resident
    assert float(str(fixed["freed_mb"])) > 180  # each block had its own pages: unmapped on free
    assert default["env"] is None and fixed["env"] == str(1 << 20)  # children (torchrun ranks) inherit it


def test_zero_leaves_the_default_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(heap.ENV, raising=False)
    assert heap.set_mmap_threshold(0)
    assert heap.ENV not in os.environ
