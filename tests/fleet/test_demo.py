"""`fleetrl demo` end to end on a tiny model: a real fleet, a real job, a well-formed report.

The demo runs as a user would run it (`python -m fleetrl.launcher.main demo ...` in a child process): it
starts embedded NATS + Valkey and every service, trains a few steps, downloads the model, stops
the fleet and writes its report. With `--warm-start` it trains an sft job first and the RL job from its
model. Bad options fail with exit code 2 before anything starts. A SIGTERM mid-training stops it as Ctrl-C
does, with nothing it started left running.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image
from rich.console import Console

from fleetrl.launcher import demo, report
from fleetrl.launcher.fleet import STATE_FILE
from fleetrl.launcher.report import SAMPLED_PROBLEMS
from fleetrl.policy import models
from fleetrl.sdk.client import load_job_file
from fleetrl.sdk.records import JobInfo, StepInfo
from fleetrl.spec.config import parse_job_spec
from tests.reward.conftest import descendants

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
EVAL_PROBLEMS = 8
"""Few problems: sampled evaluation (a generate call a problem, for base and trained) is most of the demo's
time on tiny-llama. That it covers only the first SAMPLED_PROBLEMS of more is tested in-process below."""
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
    assert f"step {STEPS}/{STEPS}" in done.stdout and f"Held-out evaluation, {EVAL_PROBLEMS} problems" in done.stdout
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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_warm_start_trains_the_sft_job_then_the_rl_job_from_its_model(tmp_path: Path) -> None:
    """`--warm-start examples/calculator_agent/sft.toml` on tiny-llama: the sft job trains on the example's
    demonstrations, the RL job is submitted as `job:<sft job>` and trains from that job's export (its
    trained model is the sft model plus its own LoRA, which a step of zero reward leaves where it was,
    not the base model), and the report evaluates base, sft and trained on the same held-out episodes."""
    run_dir = tmp_path / "run"
    example = ROOT / "examples" / "calculator_agent"
    done = subprocess.run([sys.executable, "-m", "fleetrl.launcher.main", "demo", "--dir", str(run_dir),
                           "--job", str(example / "job.toml"), "--warm-start", str(example / "sft.toml"),
                           "--model", "tiny-llama", "--max-steps", "1", "--eval-problems", "2", "--eval-samples", "1",
                           "--set", "rollout.prompts_per_step=2", "--set", "rollout.samples_per_prompt=2",
                           "--set", "rollout.max_new_tokens=8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((run_dir / "report.json").read_text())
    sft = summary["warm_start"]
    assert (sft["state"], sft["steps"], sft["model"]) == ("succeeded", 12, "tiny-llama")
    assert summary["model"] == str(run_dir / "jobs" / sft["job_id"] / "model")  # job:<id>, resolved
    assert set(summary["eval"]) == {"kind", "problems", "episodes", "base", "sft", "trained"}
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert [evaluation[s]["model"] for s in ("base", "sft", "trained")] == [
        "tiny-llama", str(run_dir / "sft-model"), str(run_dir / "model")]
    assert "| sft |" in (run_dir / "report.md").read_text() and f"Warm start: sft job {sft['job_id']}" in done.stdout
    assert (run_dir / "sft-metrics.jsonl").read_text().count("\n") == 12
    base, warm, trained = (_weights(m) for m in ("tiny-llama", run_dir / "sft-model", run_dir / "model"))
    assert _distance(trained, warm) < _distance(warm, base) / 10, "the RL job did not start from the sft model"


def _weights(model: str | Path) -> dict[str, torch.Tensor]:
    return dict(models.load(str(model))[0].state_dict())


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize("argv", [
    ["--set", "rollout.max_new_tokens=0"],
    ["--set", "no_such_field=1"],
    ["--max-steps", "0"],
    ["--eval-problems", "100000"],
    ["--eval-samples", "-1"],
    ["--job", "does/not/exist.toml"],
    ["--warm-start", str(ROOT / "examples/calculator_agent/job.toml")],  # not an sft job
    ["--warm-start", str(ROOT / "examples/calculator_agent/sft.toml"), "--set", 'model="tiny-llama"'],  # its model
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


def test_sampled_evaluation_covers_only_the_first_sampled_problems(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy evaluation covers every held-out problem, sampled evaluation only the first SAMPLED_PROBLEMS
    (2 here, of 3), and the report says so (the demo run above evaluates fewer problems than that)."""
    monkeypatch.setattr(report, "SAMPLED_PROBLEMS", 2)
    spec = parse_job_spec(load_job_file(demo.DEFAULT_JOB, ["model=tiny-llama"]).spec, "json")
    problems = demo.eval_problems(demo.DEFAULT_EVAL, 3)
    figures = report.evaluate_model("tiny-llama", spec, problems, 2)
    assert figures["problems"] == 3 and len(figures["examples"]) == 3
    sampled = figures["sampled"]
    assert (sampled["problems"], sampled["samples"], len(sampled["correct_per_problem"])) == (2, 2, 2)
    evaluation = {"problems": 3, "max_new_tokens": report.EVAL_NEW_TOKENS, "samples": 2,
                  "base": figures, "trained": figures}
    summary = report.summarise(JobInfo("j", "t", "n", "succeeded", "", {}, 0, 0, None, ""), [], Path("m"),
                               evaluation, train_wall_s=1.0)
    assert summary["eval"]["sampled_problems"] == 2
    assert "3 problems" in report.markdown(summary) and "of each of the first 2" in report.markdown(summary)


def test_the_plot_smooths_the_reward_with_a_trailing_mean() -> None:
    smooth = report.trailing_mean([0.0, 1.0, 0.0, 1.0, 1.0, 1.0], 3)
    assert smooth == pytest.approx([0.0, 0.5, 1 / 3, 2 / 3, 2 / 3, 1.0])
    assert report.trailing_mean([], 5) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_stops_the_demo_and_every_process_it_started(tmp_path: Path) -> None:
    """`kill <demo>` (SIGTERM) mid-training ends the demo as Ctrl-C does: the job is cancelled, and every
    process it started (the embedded NATS and Valkey, every service, the sandboxed workers) is gone."""
    run_dir = tmp_path / "run"
    demo_proc = subprocess.Popen([sys.executable, "-m", "fleetrl.launcher.main", "demo", "--dir", str(run_dir),
                                  "--model", "tiny-llama", "--max-steps", "500", "--eval-problems", "4"],
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    try:
        assert demo_proc.stdout is not None
        for line in demo_proc.stdout:
            seen.append(line)
            if line.startswith("job ") and ": running" in line:
                break
        started = descendants(demo_proc.pid)
        assert len(started) >= 7, "".join(seen)  # NATS, Valkey, gateway, replay, reward, learner, actor
        demo_proc.send_signal(signal.SIGTERM)
        output, _ = demo_proc.communicate(timeout=120)
    finally:
        if demo_proc.poll() is None:
            demo_proc.kill()
    try:
        assert demo_proc.returncode != 0 and "interrupted" in output, "".join(seen) + output
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and alive(started):
            time.sleep(0.5)
        assert alive(started) == [], "processes the demo started outlived it"
        assert not (run_dir / STATE_FILE).exists()
    finally:
        for pid in alive(started):  # a failed run must not leave its servers behind for the next tests
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def alive(pids: list[int]) -> list[int]:
    """The pids that are still live processes (not zombies)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out
