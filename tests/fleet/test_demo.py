"""`fleetrl demo` end to end on a tiny model: a real fleet, a real job, a well-formed report.

The demo runs as a user would run it (`python -m fleetrl.launcher.main demo ...` in a child process): it
starts embedded NATS + Valkey and every service, trains a few steps, downloads the model, stops
the fleet and writes its report. Bad options fail with exit code 2 before anything starts.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from rich.console import Console

from fleetrl.launcher import demo, report
from fleetrl.launcher.fleet import STATE_FILE
from fleetrl.launcher.report import SAMPLED_PROBLEMS
from fleetrl.sdk.client import load_job_file
from fleetrl.sdk.records import JobInfo, StepInfo
from fleetrl.spec.config import parse_job_spec

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
EVAL_PROBLEMS = 100
SAMPLES, SAMPLED = 4, min(EVAL_PROBLEMS, SAMPLED_PROBLEMS)
QUICK = ["--model", "tiny-llama", "--max-steps", str(STEPS), "--eval-problems", str(EVAL_PROBLEMS),
         "--eval-samples", str(SAMPLES),
         "--set", "rollout.prompts_per_step=2", "--set", "rollout.samples_per_prompt=4",
         "--set", "rollout.max_new_tokens=4", "--set", "train.checkpoint_interval=100"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    done = subprocess.run([sys.executable, "-m", "fleetrl.launcher.main", "demo", "--dir", str(run_dir), *QUICK],
                          cwd=ROOT, capture_output=True, text=True, timeout=840)
    return done, run_dir


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_trains_and_writes_a_well_formed_report(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    done, run_dir = demo_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"step {STEPS}/{STEPS}" in done.stdout and "Held-out evaluation, 100 problems" in done.stdout
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all({"reward_mean", "kl", "reward/correct", "reward/format", "tokens_per_s"} <= m.keys() for m in metrics)
    with Image.open(run_dir / "training.png") as image:
        assert image.format == "PNG" and image.width > 100 and image.height > 100
        image.verify()
    evaluation = json.loads((run_dir / "eval.json").read_text())
    for which in ("base", "trained"):
        figures = evaluation[which]
        assert figures["problems"] == EVAL_PROBLEMS
        assert 0 <= figures["accuracy"] <= 1 and 0 <= figures["number_only_rate"] <= figures["accuracy"]
        sampled = figures["sampled"]
        assert (sampled["problems"], sampled["samples"]) == (SAMPLED, SAMPLES)
        assert len(sampled["correct_per_problem"]) == SAMPLED
        assert 0 <= sampled["pass_at_1"] <= sampled["pass_at_k"] <= 1
    assert evaluation["trained"]["model"] == str(run_dir / "model")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_report_summarises_the_job_and_the_fleet_is_gone(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    done, run_dir = demo_run
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["state"] == "succeeded" and report["steps"] == STEPS and report["model"] == "tiny-llama"
    assert set(report["eval"]) == {"problems", "samples", "sampled_problems", "base", "trained"}
    assert report["wall_s"] > report["train_wall_s"] > 0
    assert all((run_dir / name).is_file() for name in report["files"])
    markdown = (run_dir / "report.md").read_text()
    assert "| base |" in markdown and "| trained |" in markdown and "training.png" in markdown
    assert f"| pass@1 | pass@{SAMPLES} |" in markdown
    assert (run_dir / "model" / "config.json").is_file() and list((run_dir / "model").glob("*.safetensors"))
    assert not (run_dir / STATE_FILE).exists()  # the fleet the demo started is stopped


@pytest.mark.parametrize("argv", [
    ["--set", "rollout.max_new_tokens=0"],
    ["--set", "no_such_field=1"],
    ["--max-steps", "0"],
    ["--eval-problems", "100000"],
    ["--eval-samples", "-1"],
    ["--job", "does/not/exist.toml"],
])
def test_bad_input_exits_2_before_starting_anything(argv: list[str], tmp_path: Path) -> None:
    assert demo.main(["--dir", str(tmp_path / "run"), *argv]) == 2
    assert not (tmp_path / "run").exists()


def test_the_report_of_a_job_with_an_environment_plays_held_out_episodes(tmp_path: Path) -> None:
    """`fleetrl demo --job examples/retry_feedback/job.toml` evaluates by episodes: base and trained
    (here both tiny-llama) play the job's environment in a real reward service, the same episodes."""
    job_file = ROOT / "examples" / "retry_feedback" / "job.toml"
    payload = load_job_file(job_file, ["model=tiny-llama", "rollout.max_new_tokens=4"])
    spec = parse_job_spec(payload.spec, "json")
    assert demo.eval_file_of(job_file) == demo.DEFAULT_EVAL  # retry_feedback has no eval.jsonl of its own
    problems = demo.eval_problems(demo.DEFAULT_EVAL, 3)
    job = JobInfo("j-env", "t", "retry", "succeeded", "", json.loads(payload.spec), 0, 0, None, "")
    steps = [StepInfo(1, 1, {"reward_mean": 0.1, "kl": 0.0})]
    summary = report.write(tmp_path, spec, job, steps, Path("tiny-llama"), problems, train_wall_s=1.0,
                           out=Console(file=io.StringIO()), samples=2, environment_file=payload.environment_file)
    evaluation = json.loads((tmp_path / "eval.json").read_text())
    assert (evaluation["kind"], evaluation["problems"], evaluation["episodes"]) == ("episodes", 3, 2)
    base, trained = evaluation["base"], evaluation["trained"]
    assert base["episodes"] == trained["episodes"] == 6 and 1 <= base["turns_mean"] <= 3
    assert {k: base[k] for k in report.EPISODE_FIGURES} == {k: trained[k] for k in report.EPISODE_FIGURES}
    assert summary["eval"]["base"] == {k: base[k] for k in report.EPISODE_FIGURES}
    assert "| model | mean episode reward | success rate | turns per episode |" in (tmp_path / "report.md").read_text()


def test_the_plot_smooths_the_reward_with_a_trailing_mean() -> None:
    smooth = report.trailing_mean([0.0, 1.0, 0.0, 1.0, 1.0, 1.0], 3)
    assert smooth == pytest.approx([0.0, 0.5, 1 / 3, 2 / 3, 2 / 3, 1.0])
    assert report.trailing_mean([], 5) == []
