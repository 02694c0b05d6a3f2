"""The demo's report: metrics JSONL, a plot, and base-vs-trained held-out evaluation.

Files written into the run directory:

- `metrics.jsonl`: one JSON object per optimizer step, as `WatchJob` streamed it.
- `training.png`: reward (and its components), accuracy and KL against steps.
- `eval.json`: greedy accuracy and number-only rate of the base and the trained model on the
  same held-out problems, with a few example completions each, and sampled pass@1 / pass@k on the
  first SAMPLED_PROBLEMS of them (k completions a problem at the job's temperature and top-p, the
  unbiased estimator).
- `report.json` and `report.md`: the job, the figures above, wall times and file names.
- `sft-metrics.jsonl`, with a warm start (`fleetrl demo --warm-start`): the sft job's steps.

A job with an `[environment]` is evaluated by its episodes instead (`fleetrl.launcher.episode_eval`):
`eval.json` holds the base and the trained model's mean episode reward, success rate (reward above
0), turns per episode and how episodes ended, over `episodes` episodes of each of the first
EPISODE_PROBLEMS held-out problems at the job's sampling settings.

With a warm start, the sft job's model is evaluated too, between the two (`sft` in eval.json and the
tables), on the same problems: base, after sft, after RL.

Design choice: both models are evaluated here, the same way (greedy, the job's prompt encoding,
`EVAL_NEW_TOKENS` new tokens, which is more than training's budget so the base model's
"a + b = c" answers are not cut short and count as correct when they are).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fleetrl.eval.result import EvalResult
from fleetrl.sdk.records import JobInfo, StepInfo
from fleetrl.spec.config import JobSpec

METRICS_JSONL, PLOT_PNG, EVAL_JSON = "metrics.jsonl", "training.png", "eval.json"
SFT_METRICS_JSONL = "sft-metrics.jsonl"
REPORT_JSON, REPORT_MD = "report.json", "report.md"
EVAL_NEW_TOKENS = 16
EVAL_SAMPLES = 8
"""Sampled completions a problem for pass@k (k = EVAL_SAMPLES) in the demo's report."""
SAMPLED_PROBLEMS = 25
"""Sampled evaluation covers the first SAMPLED_PROBLEMS problems: k completions of each cost about k
greedy passes (see the README's demo figures)."""
EPISODE_PROBLEMS = 20
"""A job with an environment plays episodes of the first EPISODE_PROBLEMS held-out problems only: each
is several turns of generation."""
EPISODES_PER_PROBLEM = 4
EPISODE_FIGURES = ("reward_mean", "success_rate", "turns_mean")
STAGES = ("base", "sft", "trained")
"""The models a report evaluates, in this order, those it has: the job's base model, the warm start's
sft model, the trained one."""
COMPONENTS = "reward/"
PLOTTED = (("mean reward of the training samples", ("reward_mean",)),
           ("reward components of the training samples (correct = accuracy)", (COMPONENTS,)),
           ("KL(policy || base model)", ("kl",)))
"""Panels: title and metric keys; COMPONENTS stands for every `reward/<name>` key."""
SMOOTH_STEPS = 5
SMOOTHED = ("reward_mean",)
"""Metrics drawn with a trailing mean over SMOOTH_STEPS steps (so are the reward components): at 4
prompts per step the per-step reward is noisy."""
HELD_OUT = ("held-out pass@k (eval.interval)", ("eval_pass_at_1", "eval_pass_at_k", "eval_greedy_pass_at_1"))
"""A panel drawn only when the job evaluated on its eval set."""
LABELS = {"reward_mean": "reward", "kl": "KL", "eval_pass_at_1": "pass@1", "eval_pass_at_k": "pass@k",
          "eval_greedy_pass_at_1": "greedy pass@1"}


@dataclass(frozen=True)
class Trained:
    """What a job left for the report: the job, its steps, its downloaded model and the wall time."""

    job: JobInfo
    steps: list[StepInfo]
    model_dir: Path | None
    train_wall_s: float


def write(run_dir: Path, spec: JobSpec, job: JobInfo, steps: list[StepInfo], model_dir: Path | None,
          problems: list[dict[str, Any]], *, train_wall_s: float, out: Console,
          samples: int = EVAL_SAMPLES, environment_file: bytes = b"",
          warm_start: Trained | None = None) -> dict[str, Any]:
    """Write every report file (the evaluation only when there is a trained model); the summary.

    `samples` completions a problem give pass@1 and pass@`samples`; 0 leaves sampled evaluation out.
    A job with an environment (its file's contents in environment_file) plays `samples` episodes
    (EPISODES_PER_PROBLEM when 0) of each of the first EPISODE_PROBLEMS problems instead. `warm_start`,
    the sft job the trained one started from, adds its model to the evaluation, and `spec.model` is then
    the base model both started from.
    """
    write_metrics(run_dir / METRICS_JSONL, steps)
    if warm_start is not None:
        write_metrics(run_dir / SFT_METRICS_JSONL, warm_start.steps)
    plot(run_dir / PLOT_PNG, steps)
    evaluation = None
    if model_dir is not None:
        models = {"base": spec.model, **({"sft": str(warm_start.model_dir)} if warm_start else {}),
                  "trained": str(model_dir)}
        evaluation = evaluate(spec, models, problems, samples, environment_file, out)
    if evaluation is not None:
        (run_dir / EVAL_JSON).write_text(json.dumps(evaluation, indent=2) + "\n")
    summary = summarise(job, steps, model_dir, evaluation, train_wall_s, warm_start)
    (run_dir / REPORT_MD).write_text(markdown(summary))
    return summary


def write_metrics(path: Path, steps: list[StepInfo]) -> None:
    lines = [json.dumps({"step": s.step, "policy_version": s.policy_version, "unix_ms": s.unix_ms, **s.values},
                        sort_keys=True) for s in steps]
    path.write_text("".join(line + "\n" for line in lines))


def plot(path: Path, steps: list[StepInfo]) -> None:
    """One panel per entry of PLOTTED, a line per metric the steps carry."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = PLOTTED + ((HELD_OUT,) if any(k in s.values for s in steps for k in HELD_OUT[1]) else ())
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.7 * len(panels)), sharex=True)
    for ax, (title, keys) in zip(axes, panels, strict=True):
        for key in _expand(keys, steps):
            points = [(s.step, s.values[key]) for s in steps if key in s.values]
            if not points:
                continue
            label = LABELS.get(key, key.removeprefix(COMPONENTS))
            smoothed = key in SMOOTHED or key.startswith(COMPONENTS)
            line, = ax.plot(*zip(*points, strict=True), marker=".", alpha=0.45 if smoothed else 1.0, label=label)
            if smoothed:
                smooth = trailing_mean([v for _, v in points], SMOOTH_STEPS)
                ax.plot([x for x, _ in points], smooth, color=line.get_color(), linewidth=2.2,
                        label=f"{label}, mean of {SMOOTH_STEPS} steps")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Each value's mean with the (up to) window - 1 values before it."""
    return [sum(values[max(0, i + 1 - window): i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(values))]


def _expand(keys: tuple[str, ...], steps: list[StepInfo]) -> list[str]:
    components = sorted({k for s in steps for k in s.values if k.startswith(COMPONENTS)})
    return [k for key in keys for k in (components if key == COMPONENTS else [key])]


# ----------------------------------------------------------------------------- evaluation


def evaluate(spec: JobSpec, models: dict[str, str], problems: list[dict[str, Any]], samples: int,
             environment_file: bytes, out: Console) -> dict[str, Any]:
    """What eval.json holds: each of `models` ({stage: model name}) on the same held-out problems, by
    episodes for a job with an environment (evaluate_episodes), else by completions (evaluate_models)."""
    stages = [f"the {stage}" for stage in models]
    named = (", ".join(stages[:-1]) + " and " if len(stages) > 1 else "") + stages[-1] + " model"
    if spec.environment is not None:
        problems = problems[:EPISODE_PROBLEMS]
        episodes = samples or EPISODES_PER_PROBLEM
        out.print(f"playing {episodes} episodes of {len(problems)} held-out problems with {named} ...")
        return evaluate_episodes(spec, environment_file, models, problems, episodes)
    out.print(f"evaluating {named} on {len(problems)} held-out problems ...")
    return evaluate_models(spec, models, problems, samples)


def evaluate_models(spec: JobSpec, models: dict[str, str], problems: list[dict[str, Any]],
                    samples: int) -> dict[str, Any]:
    """{"problems", "max_new_tokens", "samples", and a stage's figures under its name} (see evaluate_model)."""
    return {"problems": len(problems), "max_new_tokens": EVAL_NEW_TOKENS, "samples": samples,
            **{stage: evaluate_model(name, spec, problems, samples) for stage, name in models.items()}}


def evaluate_episodes(spec: JobSpec, environment_file: bytes, models: dict[str, str], problems: list[dict[str, Any]],
                      episodes: int) -> dict[str, Any]:
    """{"kind": "episodes", "problems", "episodes", and a stage's figures under its name} (see episode_eval)."""
    from fleetrl.launcher import episode_eval

    return {"kind": "episodes", "problems": len(problems), "episodes": episodes,
            **{stage: episode_eval.figures(episode_eval.evaluate(spec, environment_file, name, problems, episodes))
               for stage, name in models.items()}}


def evaluate_model(model_name: str, spec: JobSpec, problems: list[dict[str, str]], samples: int) -> dict[str, Any]:
    """A stage's figures in eval.json (see stage_figures)."""
    from fleetrl.eval import addition as evaluate
    from fleetrl.policy import models
    from fleetrl.policy.backends import HFBackend, prompt_tokens

    started = time.monotonic()
    model, tokenizer = models.load(model_name)
    prompt_ids = [prompt_tokens(tokenizer, p["prompt"], spec.rollout) for p in problems]
    greedy = evaluate.evaluate(model, tokenizer, problems, prompt_ids, EVAL_NEW_TOKENS)
    sampled = None
    if samples > 0:
        first = slice(0, SAMPLED_PROBLEMS)
        sampled = evaluate.sampled(
            HFBackend(model, tokenizer), problems[first], prompt_ids[first], samples, max_new_tokens=EVAL_NEW_TOKENS,
            temperature=spec.rollout.temperature, top_p=spec.rollout.top_p, seed=spec.seed)
    return stage_figures(model_name, greedy, sampled, round(time.monotonic() - started, 1))


def stage_figures(model_name: str, greedy: EvalResult, sampled: EvalResult | None, wall_s: float) -> dict[str, Any]:
    """{"model", "problems", "accuracy", "number_only_rate", "examples", "sampled", "wall_s"}: the greedy
    addition check, and `sampled` ({"problems", "samples", "temperature", "pass_at_1", "pass_at_k",
    "correct_per_problem"}, or None without samples)."""
    return {"model": model_name, "problems": greedy.problems, "accuracy": greedy.greedy_pass_at_1,
            "number_only_rate": greedy.extras["number_only_rate"], "examples": greedy.extras["examples"],
            "sampled": None if sampled is None else {
                "problems": sampled.problems, "samples": sampled.samples, "temperature": sampled.extras["temperature"],
                "pass_at_1": sampled.sampled_pass_at_1, "pass_at_k": sampled.sampled_pass_at_k,
                "correct_per_problem": sampled.extras["correct_per_problem"]},
            "wall_s": wall_s}


# ----------------------------------------------------------------------------- summary


def summarise(job: JobInfo, steps: list[StepInfo], model_dir: Path | None, evaluation: dict[str, Any] | None,
              train_wall_s: float, warm_start: Trained | None = None) -> dict[str, Any]:
    """What report.json holds; `warm_start` (the sft job's own summary, less its evaluation and files) only
    with one."""
    files = ([METRICS_JSONL] + ([SFT_METRICS_JSONL] if warm_start else []) + [PLOT_PNG]
             + ([EVAL_JSON] if evaluation else []) + [REPORT_JSON, REPORT_MD])
    summary = {
        "job_id": job.job_id, "state": job.state, "reason": job.reason, "model": job.spec.get("model"),
        "steps": len(steps), "max_steps": job.max_steps, "train_wall_s": round(train_wall_s, 1),
        "first_step": steps[0].values if steps else {}, "last_step": steps[-1].values if steps else {},
        "model_dir": str(model_dir) if model_dir else None, "eval": _figures(evaluation), "files": files,
        "spec": job.spec,
    }
    if warm_start is not None:
        sft = summarise(warm_start.job, warm_start.steps, warm_start.model_dir, None, warm_start.train_wall_s)
        summary["warm_start"] = {k: v for k, v in sft.items() if k not in ("eval", "files")}
    return summary


def _figures(evaluation: dict[str, Any] | None) -> dict[str, Any] | None:
    if evaluation is None:
        return None
    stages = [stage for stage in STAGES if stage in evaluation]
    if evaluation.get("kind") == "episodes":
        return {"kind": "episodes", "problems": evaluation["problems"], "episodes": evaluation["episodes"],
                **{which: {k: evaluation[which][k] for k in EPISODE_FIGURES} for which in stages}}
    keys = ("accuracy", "number_only_rate")
    figures: dict[str, Any] = {"problems": evaluation["problems"], "samples": evaluation["samples"],
                               "sampled_problems": min(evaluation["problems"], SAMPLED_PROBLEMS)}
    for which in stages:
        sampled = evaluation[which]["sampled"] or {}
        figures[which] = {**{k: evaluation[which][k] for k in keys},
                          "pass_at_1": sampled.get("pass_at_1"), "pass_at_k": sampled.get("pass_at_k")}
    return figures


def _table(figures: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    """(what was measured, columns, a row per model) of the held-out evaluation, for report.md and the terminal."""
    stages = [stage for stage in STAGES if stage in figures]
    if figures.get("kind") == "episodes":
        what = (f"Held-out episodes: {figures['episodes']} episodes of each of {figures['problems']} problems at "
                "the job's sampling settings; success = an episode reward above 0.")
        columns = ["model", "mean episode reward", "success rate", "turns per episode"]
        rows = [[which, f"{figures[which]['reward_mean']:.3f}", f"{figures[which]['success_rate']:.1%}",
                 f"{figures[which]['turns_mean']:.2f}"] for which in stages]
        return what, columns, rows
    k = figures["samples"]
    what = f"Held-out evaluation, {figures['problems']} problems: greedy accuracy and number-only rate"
    what += (f"; pass@1 and pass@{k} from {k} sampled completions of each of the first "
             f"{figures['sampled_problems']} (unbiased estimator)." if k else " (no sampled evaluation).")
    columns = ["model", "accuracy", "number-only"] + (["pass@1", f"pass@{k}"] if k else [])
    rows = [[which, f"{figures[which]['accuracy']:.1%}", f"{figures[which]['number_only_rate']:.1%}"]
            + ([f"{figures[which][key]:.1%}" for key in ("pass_at_1", "pass_at_k")] if k else [])
            for which in stages]
    return what, columns, rows


def markdown(summary: dict[str, Any]) -> str:
    lines = [f"# fleetrl demo: job {summary['job_id']} ({summary['state']})", "",
             f"Model `{summary['model']}`, {summary['steps']}/{summary['max_steps']} steps, "
             f"training wall time {summary['train_wall_s']:.0f} s.", ""]
    if "warm_start" in summary:
        lines += [warm_start_line(summary["warm_start"]), ""]
    figures = summary["eval"]
    if figures:
        what, columns, rows = _table(figures)
        lines += [what, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    else:
        lines.append(f"No evaluation: the job ended {summary['state']} {summary['reason']}".rstrip())
    lines += ["", f"![training curves]({PLOT_PNG})", "", "Per-step metrics: `metrics.jsonl`; details: `eval.json`."]
    return "\n".join(lines) + "\n"


def warm_start_line(sft: dict[str, Any]) -> str:
    """`Warm start: sft job j-... (succeeded), 12/12 steps, loss 1.234 -> 0.056, 95 s.`"""
    losses = [sft[key].get("loss") for key in ("first_step", "last_step")]
    loss = f", loss {losses[0]:.3f} -> {losses[1]:.3f}" if None not in losses else ""
    return (f"Warm start: sft job {sft['job_id']} ({sft['state']}), {sft['steps']}/{sft['max_steps']} steps{loss}, "
            f"{sft['train_wall_s']:.0f} s.")


def print_summary(summary: dict[str, Any], out: Console) -> None:
    figures = summary["eval"]
    if figures:
        what, columns, rows = _table(figures)
        table = Table(title=what)
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*row)
        out.print(table)
    if "warm_start" in summary:
        out.print(warm_start_line(summary["warm_start"]), markup=False)
    out.print(f"job {summary['job_id']} {summary['state']}: {summary['steps']} steps, "
              f"training {summary['train_wall_s']:.0f} s, total {summary.get('wall_s', 0):.0f} s")
