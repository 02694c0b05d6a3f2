"""The configuration reference, generated from the pydantic models: `python -m fleetrl.launcher.configdoc`.

It prints Markdown tables of every field of the JobSpec (by dotted path), of each service's
settings model (with its environment prefix) and of each built-in reward's `params`: type,
default, bounds and the field's docstring. The docstrings are the ones written under each field;
the models set `use_attribute_docstrings`, so pydantic already holds them as descriptions.

Design choice: docs/CONFIG.md keeps this output between two marker lines, and
tests/fleet/test_configdoc.py fails when it is stale, the way the proto stubs are checked, so the
reference cannot drift from the code. `--write FILE` refreshes the block, `--check FILE` exits 1
when it differs. Defaults computed at start-up (an actor's id) are described, never evaluated,
so the output is the same on every machine. Imports only config modules: no torch.
"""

from __future__ import annotations

import argparse
import enum
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from fleetrl.reward import settings as reward_config
from fleetrl.reward import verifiers
from fleetrl.rollout import settings as actor_config
from fleetrl.services.gateway import config as gateway_config
from fleetrl.services.replay import config as replay_config
from fleetrl.services.tinker import config as tinker_config
from fleetrl.spec.config import JobSpec
from fleetrl.train import settings as learner_config

BEGIN = "<!-- BEGIN GENERATED: python -m fleetrl.launcher.configdoc --write docs/CONFIG.md -->"
END = "<!-- END GENERATED -->"
SERVICES: tuple[tuple[str, type[BaseModel], str], ...] = (
    ("gateway", gateway_config.GatewaySettings, gateway_config.ENV_PREFIX),
    ("replay", replay_config.ReplaySettings, replay_config.ENV_PREFIX),
    ("reward", reward_config.RewardSettings, reward_config.ENV_PREFIX),
    ("learner", learner_config.LearnerSettings, learner_config.ENV_PREFIX),
    ("actor", actor_config.ActorSettings, actor_config.ENV_PREFIX),
    ("tinker", tinker_config.TinkerSettings, tinker_config.ENV_PREFIX),
)
REQUIRED, SECTION, COMPUTED, UNSET = "required", "(section defaults)", "computed at start-up", "unset"
_PLAIN_FACTORIES: dict[Any, str] = {dict: "{}", list: "[]", set: "[]", tuple: "[]"}
_BOUNDS: tuple[tuple[type, str, str], ...] = (
    (annotated_types.Gt, "gt", "> {}"), (annotated_types.Ge, "ge", ">= {}"),
    (annotated_types.Lt, "lt", "< {}"), (annotated_types.Le, "le", "<= {}"),
    (annotated_types.MinLen, "min_length", "length >= {}"), (annotated_types.MaxLen, "max_length", "length <= {}"),
)


@dataclass(frozen=True)
class Row:
    """One documented field."""

    path: str
    type: str
    default: str
    bounds: str
    doc: str


# --------------------------------------------------------------------------- one field


def type_name(annotation: Any) -> str:
    """A short, readable name of a field type (`int`, `"fifo" | "uniform"`, `str | None`, `table`)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " | ".join(_toml(arg) for arg in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(arg) for arg in args)}]"
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _toml(value: Any) -> str:
    """A value as a user writes it in TOML (None, which TOML lacks, reads `unset`)."""
    if value is None:
        return UNSET
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return _toml(value.value)
    if isinstance(value, str | Path):
        return f'"{value}"'
    if isinstance(value, list | tuple | set):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {_toml(item)}" for key, item in value.items()) + "}"
    return repr(value)


def default_text(info: FieldInfo) -> str:
    """The default as TOML, `required`, or how it is computed at start-up."""
    if info.default_factory is not None:
        factory = info.default_factory
        if factory in _PLAIN_FACTORIES:
            return _PLAIN_FACTORIES[factory]
        if isinstance(factory, type) and issubclass(factory, BaseModel):
            return SECTION
        return f"{COMPUTED} by `{getattr(factory, '__name__', 'a factory')}()`"
    if info.default is PydanticUndefined:
        return REQUIRED
    return _toml(info.default)


def bounds_text(info: FieldInfo) -> str:
    """`>= 1, <= 64`, length limits and a pattern, from the field's constraints."""
    parts = []
    for item in info.metadata:
        for kind, attr, template in _BOUNDS:
            if isinstance(item, kind):
                parts.append(template.format(getattr(item, attr)))
        pattern = getattr(item, "pattern", None)
        if pattern:
            parts.append(f"pattern `{pattern}`")
    return ", ".join(parts)


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


# --------------------------------------------------------------------------- a model


def _nested_model(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """(model, path suffix) when a field holds a model (`""`) or a list of models (`"[]"`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    if get_origin(annotation) is list:
        (item,) = get_args(annotation) or (None,)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item, "[]"
    args = [arg for arg in get_args(annotation) if arg is not type(None)]
    if get_origin(annotation) in (Union, types.UnionType) and len(args) == 1:
        return _nested_model(args[0])
    return None


def rows(model: type[BaseModel], prefix: str = "") -> Iterator[Row]:
    """Every field of model, depth first, nested models' fields under dotted paths."""
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        nested = _nested_model(info.annotation)
        doc = _one_line(info.description)
        if nested is not None and not doc:
            doc = _one_line(nested[0].__doc__)
        yield Row(path, type_name(info.annotation), default_text(info), bounds_text(info), doc)
        if nested is not None:
            yield from rows(nested[0], f"{path}{nested[1]}.")


def _cell(text: str, code: bool = False) -> str:
    text = text.replace("|", "\\|")
    return f"`{text}`" if code and text else text


def _is_value(default: str) -> bool:
    return default not in (REQUIRED, SECTION, UNSET) and not default.startswith(COMPUTED)


def table(model: type[BaseModel], prefix: str = "") -> str:
    """A Markdown table of every field of model."""
    lines = ["| Field | Type | Default | Bounds | Description |", "|---|---|---|---|---|"]
    for row in rows(model, prefix):
        lines.append(f"| {_cell(row.path, True)} | {_cell(row.type, True)} | "
                     f"{_cell(row.default, _is_value(row.default))} | "
                     f"{_cell(row.bounds)} | {_cell(row.doc)} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the document


def render() -> str:
    """The whole generated reference (the text between the markers of docs/CONFIG.md)."""
    parts = [
        "## Job spec (`JobSpec`)",
        _one_line(JobSpec.__doc__) + " Unknown keys are errors; a bad value is reported by its dotted path.",
        table(JobSpec),
        "## Service settings",
        "Each service loads its settings in the order defaults < `--config` TOML file < environment "
        "< `--set key=value`. An environment variable is the service's prefix plus the field name in "
        "upper case (nested keys joined by `__`); a service reads only the fields its model declares.",
    ]
    for service, model, prefix in SERVICES:
        parts += [f"### {service} (`{model.__name__}`)",
                  f"{_one_line(model.__doc__)} Environment prefix `{prefix}`, e.g. `{prefix}"
                  f"{next(iter(model.model_fields)).upper()}`.",
                  table(model)]
    parts += ["## Built-in reward params",
              "`reward.params` of a job whose `reward.builtin` names one of these; unknown keys are errors."]
    for name, entry in verifiers.REGISTRY.items():
        parts += [f"### `{name}`", table(entry.params, "reward.params.")]
    return "\n\n".join(parts) + "\n"


def splice(document: str, block: str) -> str:
    """document with the text between BEGIN and END replaced by block."""
    head, begin, rest = document.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"markers {BEGIN!r} ... {END!r} not found")
    return f"{head}{BEGIN}\n{block}{END}{tail}"


def is_stale(path: Path) -> bool:
    """True when the generated block of the document at path differs from render()."""
    text = path.read_text()
    return splice(text, render()) != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", type=Path, metavar="FILE", help="refresh the generated block of FILE")
    group.add_argument("--check", type=Path, metavar="FILE", help="exit 1 if FILE's generated block is stale")
    args = parser.parse_args(argv)
    if args.check is not None:
        stale = is_stale(args.check)
        if stale:
            print(f"stale: {args.check} (run python -m fleetrl.launcher.configdoc --write {args.check})",
                  file=sys.stderr)
        return 1 if stale else 0
    if args.write is not None:
        args.write.write_text(splice(args.write.read_text(), render()))
        return 0
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
