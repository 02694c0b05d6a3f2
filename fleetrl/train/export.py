"""What a job leaves behind: the metrics JSONL (one object per step) and the final HF model.

Design choice: `metrics.jsonl` is rewritten on resume to the steps of the checkpoint the learner
resumed from, so after any number of crashes it holds each step exactly once, as trained by
the state that survived.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fleetrl.jobs.store import ADAPTER_DIR, job_dir
from fleetrl.policy import models


class MetricsLog:
    """Append-only per-step JSONL, truncated to a checkpoint's step on resume."""

    path: Path

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> None:
        """Keep only the lines of steps <= step."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and int(json.loads(line)["step"]) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def append(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def export_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, run_dir: Path, job_id: str) -> Path:
    """`{run_dir}/jobs/{job}/model`: loadable by AutoModelForCausalLM/AutoTokenizer.from_pretrained."""
    return models.export(model, tokenizer, job_dir(run_dir, job_id) / "model")


def export_adapter(model: PeftModel, run_dir: Path, job_id: str) -> Path:
    """`{run_dir}/jobs/{job}/adapter`: a LoRA job's adapters, loadable by `PeftModel.from_pretrained`
    on the base model (the merged model is `export_model`'s)."""
    target = job_dir(run_dir, job_id) / ADAPTER_DIR
    return models.write_dir_atomically(target, lambda tmp: model.save_pretrained(str(tmp)))
