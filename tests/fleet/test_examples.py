"""Every example job under examples/ validates, and its reward loads in the reward service's sandbox.

Each `examples/**/*.toml` is read the way `fleetrl submit` reads it (files relative to the TOML),
must be a valid JobSpec, and its prompts must pass the gateway's line checks. Its reward goes
through the reward service's own submission check (`parse_spec`, then a sandboxed worker pool
that loads the file) and scores a prompt's gold answer: a reward file must expose `reward`.
Prompt generators must reproduce their committed files byte for byte.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from services.common.config import JobSpec, parse_job_spec
from services.gateway.checks import prompt_violations
from services.gateway.client import load_job_file
from services.reward.config import RewardSettings
from services.reward.scorer import Item, Scorer, Status, parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
JOB_FILES = sorted(EXAMPLES.rglob("*.toml"))
GENERATORS = [p for p in sorted(EXAMPLES.rglob("make_prompts.py")) if p.parent.name != "addition"]
UID_BASE = 400_000  # sandbox uids of this module, apart from the reward tests' and the default range
GOLD_FIELD = {"addition": "answer", "gsm8k": "solution", "custom_reward": "answer"}
BEST_REWARD = {"addition": 1.5, "gsm8k": 1.1, "custom_reward": 1.5}


def _load(path: Path) -> tuple[JobSpec, bytes, bytes]:
    spec_json, prompts, reward_file, _ = load_job_file(path)
    return parse_job_spec(spec_json, "json"), prompts, reward_file


def _module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{path.parent.name}_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_there_are_the_three_examples() -> None:
    assert {p.parent.name for p in JOB_FILES} >= {"addition", "gsm8k", "custom_reward"}
    assert all((p.parent / "README.md").is_file() for p in JOB_FILES)


@pytest.mark.parametrize("path", JOB_FILES, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_job_file_is_a_valid_spec_with_good_prompts(path: Path) -> None:
    spec, prompts, reward_file = _load(path)
    assert prompt_violations(prompts) == []
    assert (spec.reward.file is not None) == bool(reward_file)


@pytest.mark.parametrize("path", JOB_FILES, ids=lambda p: str(p.relative_to(EXAMPLES)))
async def test_reward_loads_in_the_sandbox_and_scores_the_gold_answer(path: Path, tmp_path: Path) -> None:
    spec, prompts, reward_file = _load(path)
    checked = parse_spec(spec.reward.model_dump_json(), reward_file)
    first = json.loads(prompts.decode().splitlines()[0])
    prompt = first.pop("prompt")
    gold = str(first[GOLD_FIELD[path.parent.name]])
    scorer = Scorer(RewardSettings(workers_per_pool=1, sandbox_uid_base=UID_BASE, sandbox_dir=tmp_path))
    try:
        await scorer.validate(checked)
        good, bad = await scorer.score("examples", checked, [Item(gold, prompt, first), Item("no idea", prompt, first)])
    finally:
        await scorer.close()
    assert good.status == Status.OK and bad.status == Status.OK, (good.reason, bad.reason)
    assert good.reward == pytest.approx(BEST_REWARD[path.parent.name])
    assert bad.reward < good.reward


@pytest.mark.parametrize("path", JOB_FILES, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_reward_file_imports_and_exposes_reward(path: Path) -> None:
    spec, _, _ = _load(path)
    if spec.reward.file is None:
        return  # a built-in: checked by the sandbox test above
    assert callable(_module(path.parent / spec.reward.file).reward)


@pytest.mark.parametrize("path", GENERATORS, ids=lambda p: p.parent.name)
def test_prompt_generator_reproduces_its_files(path: Path) -> None:
    files = _module(path).files()
    assert files and all((path.parent / name).read_text() == text for name, text in files.items())
    train, held_out = ({json.loads(line)["prompt"] for line in files[n].splitlines()} for n in ("train.jsonl",
                                                                                               "eval.jsonl"))
    assert not train & held_out
