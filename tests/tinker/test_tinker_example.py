"""examples/tinker_rl_loop/rl_loop.py runs unchanged against the server: a two-step loop on tiny-llama, as written
and with OFF_POLICY (the next step's samples asked for before this step trains)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tinker.conftest import KEYS, TinkerServer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tinker_rl_loop" / "rl_loop.py"


@pytest.mark.parametrize("off_policy", ["0", "1"])
def test_the_example_loop_trains_and_reports(server: TinkerServer, off_policy: str) -> None:
    env = {**os.environ, "TINKER_BASE_URL": server.url, "TINKER_API_KEY": KEYS["alice"], "MODEL": "tiny-llama",
           "STEPS": "2", "EVAL": "3", "OFF_POLICY": off_policy}
    done = subprocess.run([sys.executable, str(EXAMPLE)], env=env, capture_output=True, text=True, timeout=240,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [line["step"] for line in lines[:-1]] == [0, 1]
    assert lines[-1]["steps"] == 2 and 0.0 <= lines[-1]["accuracy_after"] <= 1.0
