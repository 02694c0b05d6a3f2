"""`fleetrl eval` on a tiny model end to end: a real reward service scores every greedy and sampled
completion, and pass@1 / pass@k follow from its verdicts and the threshold."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetrl.launcher import main as cli
from fleetrl.launcher.embedded import free_port, wait_for_port

ROOT = Path(__file__).resolve().parents[2]
PROBLEMS = [{"prompt": f"What is {a} + {a + 1}?", "answer": str(2 * a + 1)} for a in range(3)]


@pytest.fixture(scope="module")
def reward_addr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("reward") / "reward.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "fleetrl.services.reward", "--listen", f"127.0.0.1:{port}",
                                 "--workers", "1"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_port("127.0.0.1", port, 60, proc)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(15)


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return path


def run_eval(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, object]]:
    code = cli.main(["eval", "tiny-llama", "--json", "--max-new-tokens", "4", *args])
    captured = capsys.readouterr()
    return code, json.loads(captured.out if code == 0 else captured.err)


def test_every_completion_is_scored_by_the_reward_service(reward_addr: str, prompts: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    reward = tmp_path / "half.py"  # scores 0.5 when the model's completion text is non-empty, else 0.25
    reward.write_text("def reward(completion, prompt, **metadata):\n"
                      "    assert metadata['answer'] and prompt.startswith('What is')\n"
                      "    return 0.5 if completion else 0.25\n")
    base = ["--prompts", str(prompts), "--reward-file", str(reward), "--reward-addr", reward_addr, "--samples", "3"]
    code, strict = run_eval(capsys, *base)
    assert code == 0, strict
    assert strict["problems"] == 3 and strict["samples"] == 3 and strict["errors"] == 0
    assert strict["greedy_pass_at_1"] == 0.0 and strict["sampled_pass_at_k"] == 0.0  # nothing reaches 1.0
    assert 0.25 <= strict["greedy_reward_mean"] <= 0.5 and 0.25 <= strict["sampled_reward_mean"] <= 0.5
    code, lenient = run_eval(capsys, *base, "--threshold", "0.25")
    assert code == 0 and lenient["greedy_pass_at_1"] == 1.0
    assert lenient["sampled_pass_at_1"] == 1.0 and lenient["sampled_pass_at_k"] == 1.0


def test_builtin_reward_and_the_table(reward_addr: str, prompts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["eval", "tiny-llama", "--prompts", str(prompts), "--reward-builtin", "numeric_match",
                     "--reward-addr", reward_addr, "--samples", "2", "--max-new-tokens", "4"]) == 0
    text = capsys.readouterr().out
    assert "tiny-llama: 3 problems" in text and "sampled (k=2)" in text and "pass@2" in text
    code, report = run_eval(capsys, "--prompts", str(prompts), "--reward-builtin", "numeric_match",
                            "--reward-addr", reward_addr, "--samples", "0")
    assert code == 0 and report["sampled_pass_at_1"] is None and 0.0 <= report["greedy_pass_at_1"] <= 1.0


def test_bad_input_names_the_field(reward_addr: str, prompts: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_eval(capsys, "--prompts", str(prompts), "--reward-addr", reward_addr)
    assert code == 2 and [v["field"] for v in err["violations"]] == ["reward"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"answer": 3}\n')
    code, err = run_eval(capsys, "--prompts", str(bad), "--reward-builtin", "numeric_match")
    assert code == 2 and [v["field"] for v in err["violations"]] == ["prompts[line 2]"]
    code, err = run_eval(capsys, "--prompts", str(prompts), "--reward-builtin", "numeric_match",
                         "--reward-params", "[1]")
    assert code == 2 and [v["field"] for v in err["violations"]] == ["reward_params"]
