"""docs/CONFIG.md holds what the config models generate, and the generator stays import-light."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fleetrl.launcher import configdoc
from fleetrl.spec.config import JobSpec

ROOT = Path(__file__).resolve().parents[2]
CONFIG_MD = ROOT / "docs" / "CONFIG.md"


def test_config_reference_is_fresh() -> None:
    assert not configdoc.is_stale(CONFIG_MD), (
        "docs/CONFIG.md is stale: run `python -m fleetrl.launcher.configdoc --write docs/CONFIG.md` and commit it")


def test_every_field_is_documented() -> None:
    models = [JobSpec, *(model for _, model, _ in configdoc.SERVICES)]
    undocumented = [row.path for model in models for row in configdoc.rows(model) if not row.doc]
    assert undocumented == [], f"fields without a docstring under them: {undocumented}"


def test_nested_fields_have_dotted_paths_and_bounds() -> None:
    rows = {row.path: row for row in configdoc.rows(JobSpec)}
    assert rows["train.max_staleness"].bounds == ">= 0, <= 1000"
    assert rows["algorithm.name"].type == '"grpo" | "dr_grpo" | "dapo" | "ppo" | "ppo_rloo" | "gspo" | "cispo" | "sft"'
    assert rows["prompts"].default == "required"
    assert rows["rollout.system_prompt"].default == "unset"


def test_splice_replaces_only_the_generated_block() -> None:
    doc = f"intro\n{configdoc.BEGIN}\nold\n{configdoc.END}\noutro\n"
    assert configdoc.splice(doc, "new\n") == f"intro\n{configdoc.BEGIN}\nnew\n{configdoc.END}\noutro\n"


def test_generator_imports_no_torch() -> None:
    code = "import sys, fleetrl.launcher.configdoc; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
