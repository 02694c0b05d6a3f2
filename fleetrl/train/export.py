"""What a job leaves behind: the metrics JSONL (one object per step) and the final HF model.

Design choice: `metrics.jsonl` is rewritten on resume to the steps of the checkpoint the learner
resumed from, so after any number of crashes it holds each step exactly once, as trained by
the state that survived.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fleetrl.jobs.store import ADAPTER_DIR, job_dir
from fleetrl.policy import models
from fleetrl.train.files import NoSpace, write_file


def _strict(value: Any) -> Any:
    """value with every float that is not finite replaced by None, in dicts and lists at any depth."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(item) for item in value]
    return value


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
        """Append one step's record as strict JSON: a value that is not a finite number (the loss of a
        skipped non-finite step) is written as null, never as the `NaN` / `Infinity` that JSON parsers
        other than Python's refuse. On a full disk (`files.NoSpace`) the part of the line that fitted is
        cut off again, so the file never holds half a line and the append can be repeated."""
        line = json.dumps(_strict(record), sort_keys=True, allow_nan=False) + "\n"
        size = self.path.stat().st_size if self.path.exists() else 0

        def append(path: Path) -> None:
            with path.open("a") as handle:
                handle.write(line)
                handle.flush()
                os.fsync(handle.fileno())

        try:
            write_file(self.path, append)
        except NoSpace:
            os.truncate(self.path, size)
            raise

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def export_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, run_dir: Path, job_id: str) -> Path:
    """`{run_dir}/jobs/{job}/model`: loadable by AutoModelForCausalLM/AutoTokenizer.from_pretrained.
    Written into a temporary directory that replaces it whole; on a full disk, NoSpace naming the
    directory, and nothing left (safe to try again)."""
    target = job_dir(run_dir, job_id) / "model"
    write_file(target, lambda out: models.export(model, tokenizer, out))
    return target


def export_adapter(model: PeftModel, run_dir: Path, job_id: str) -> Path:
    """`{run_dir}/jobs/{job}/adapter`: a LoRA job's adapters, loadable by `PeftModel.from_pretrained`
    on the base model (the merged model is `export_model`'s); written as `export_model` is."""
    target = job_dir(run_dir, job_id) / ADAPTER_DIR
    write_file(target, lambda out: models.write_dir_atomically(out, lambda tmp: model.save_pretrained(str(tmp))))
    return target
