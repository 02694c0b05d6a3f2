"""The GPU check (bench/gpu.py) on the CPU: every part runs and reports numbers, and a budget too small for a
part skips it with the reason, so the check cannot rot before a GPU is at hand. Not marked `gpu`: CI runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from numbers import Real
from pathlib import Path
from typing import Any

from bench.gpu import HEADLINES

ROOT = Path(__file__).resolve().parents[2]


def gpu_check(*args: str, timeout_s: float) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "bench.gpu", "--json", "--device", "cpu", "--smoke", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_every_part_reports_its_figures() -> None:
    result = gpu_check("--budget-s", "280", timeout_s=300)
    assert result["model"] == "tiny-llama" and result["environment"]["device_name"] == "cpu"
    assert isinstance(result["environment"]["torch"], str)
    assert set(result["parts"]) == set(HEADLINES)
    for name, part in result["parts"].items():
        assert part["status"] == "ok", (name, part)
        for figure in HEADLINES[name]:
            assert isinstance(part[figure], Real) and part[figure] > 0, (name, figure, part[figure])


def test_a_part_the_budget_no_longer_allows_is_skipped_with_the_reason() -> None:
    result = gpu_check("--budget-s", "25", timeout_s=120)
    assert {part["status"] for part in result["parts"].values()} == {"skipped"}
    assert "left" in result["parts"]["pipeline"]["reason"]
    assert result["wall_s"] < 25
