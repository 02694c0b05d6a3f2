"""Tinker checkpoints on disk: `tinker://<model_id>/weights/<name>` (save_state) and
`tinker://<model_id>/sampler_weights/<name>` (save_weights_for_sampler with a name).

A checkpoint is a directory `<root>/<tenant>/<model_id>/<kind>/<name>/` holding `adapter.safetensors`,
`meta.json` (base model, LoRA shape, steps) and, for training state, `optimizer.pt` (AdamW's moments).
It is written into a temporary sibling and renamed into place (`models.write_dir_atomically`), so a
server killed while saving leaves the previous checkpoint or the new one, never half of one; and it
outlives the server process, so a restarted server loads it (load_state, create_training_client_from_state,
create_sampling_client(model_path=...)).

Design choice: the tenant is a directory level, and a path is always resolved under the caller's
own tenant, so another tenant's path reads as not found: no lookup table to keep consistent.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fleetrl.errors import FieldViolation, InvalidArgument, NotFound
from fleetrl.policy.models import write_dir_atomically
from fleetrl.spec.config import LoraSpec

SCHEME = "tinker://"
KINDS = ("weights", "sampler_weights")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,255}$")


@dataclass(frozen=True)
class CheckpointPath:
    """A parsed tinker:// checkpoint path."""

    model_id: str
    kind: str
    name: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.model_id}/{self.kind}/{self.name}"


def parse(path: str, field: str = "path") -> CheckpointPath:
    """The checkpoint a tinker:// path names; InvalidArgument naming `field` when it is not one."""
    parts = path[len(SCHEME):].split("/") if path.startswith(SCHEME) else []
    if len(parts) != 3 or parts[1] not in KINDS or not _MODEL_ID.match(parts[0]) or not _NAME.match(parts[2]):
        raise InvalidArgument(f"{field} {path!r} is not a checkpoint path", [FieldViolation(
            field, f"expected {SCHEME}<model_id>/weights/<name> or {SCHEME}<model_id>/sampler_weights/<name>")])
    return CheckpointPath(*parts)


def check_name(name: str, field: str = "path") -> str:
    """A checkpoint name as given, or InvalidArgument naming `field`."""
    if not _NAME.match(name):
        raise InvalidArgument(f"{field} {name!r} is not a checkpoint name", [FieldViolation(
            field, "1-128 letters, digits, '_', '.' or '-', starting with a letter or digit")])
    return name


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint directory holds, loaded."""

    base_model: str
    lora: LoraSpec
    steps: int
    adapter: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None


@dataclass(frozen=True)
class Listed:
    """A checkpoint as listed: its path, when it was written (seconds since the epoch), its bytes, and the base
    and LoRA rank it was trained on."""

    path: CheckpointPath
    written_at: float
    size_bytes: int
    base_model: str
    lora_rank: int


class CheckpointStore:
    """Checkpoint directories under one root."""

    root: Path

    def __init__(self, root: Path) -> None:
        self.root = root

    def _dir(self, tenant: str, path: CheckpointPath) -> Path:
        return self.root / tenant / path.model_id / path.kind / path.name

    def save(self, tenant: str, path: CheckpointPath, base_model: str, lora: LoraSpec, state: dict[str, Any]) -> None:
        """Write a run's `state()` (adapter, steps, optimizer when present) as checkpoint `path`."""
        meta = {"base_model": base_model, "lora": lora.model_dump(mode="json"),
                "steps": state["steps"]}

        def write(tmp: Path) -> None:
            save_file(state["adapter"], str(tmp / "adapter.safetensors"))
            if "optimizer" in state:
                torch.save(state["optimizer"], tmp / "optimizer.pt")
            (tmp / "meta.json").write_text(json.dumps(meta))

        write_dir_atomically(self._dir(tenant, path), write)

    def exists(self, tenant: str, path: CheckpointPath) -> bool:
        return (self._dir(tenant, path) / "meta.json").is_file()

    def load(self, tenant: str, path: CheckpointPath) -> Checkpoint:
        """The tenant's checkpoint `path`; NotFound when the tenant has none by that path."""
        directory = self._dir(tenant, path)
        if not (directory / "meta.json").is_file():
            raise NotFound(f"checkpoint {path} not found")
        meta = json.loads((directory / "meta.json").read_text())
        optimizer_file = directory / "optimizer.pt"
        optimizer = torch.load(optimizer_file, weights_only=True) if optimizer_file.is_file() else None
        return Checkpoint(meta["base_model"], LoraSpec(**meta["lora"]), int(meta["steps"]),
                          load_file(str(directory / "adapter.safetensors")), optimizer)

    def listed(self, tenant: str, model_id: str) -> list[Listed]:
        """The tenant's checkpoints of training run `model_id` (both kinds), oldest first; [] when it has none."""
        found = []
        for kind in KINDS:
            kind_dir = self.root / tenant / model_id / kind
            names = sorted(os.listdir(kind_dir)) if _MODEL_ID.match(model_id) and kind_dir.is_dir() else []
            for name in names:
                meta_file = kind_dir / name / "meta.json"
                if name.startswith(".") or not meta_file.is_file():  # a write or a delete under way
                    continue
                meta = json.loads(meta_file.read_text())
                size = sum(f.stat().st_size for f in (kind_dir / name).iterdir() if f.is_file())
                found.append(Listed(CheckpointPath(model_id, kind, name), meta_file.stat().st_mtime, size,
                                    meta["base_model"], int(meta["lora"]["rank"])))
        return sorted(found, key=lambda c: (c.written_at, str(c.path)))

    def delete(self, tenant: str, path: CheckpointPath) -> None:
        """Delete the tenant's checkpoint `path` (renamed aside first, so a reader never sees half of one);
        NotFound when the tenant has none by that path."""
        directory = self._dir(tenant, path)
        aside = directory.with_name(f".{directory.name}.deleted-{uuid.uuid4().hex}")
        try:
            os.rename(directory, aside)
        except FileNotFoundError:
            raise NotFound(f"checkpoint {path} not found") from None
        shutil.rmtree(aside, ignore_errors=True)
