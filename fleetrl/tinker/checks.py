"""The checks a Tinker request's input passes before its work is queued (`TinkerService`): each failure is an
InvalidArgument that names the field (HTTP 400), so a bad request costs nothing on the work thread."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fleetrl.errors import FieldViolation, InvalidArgument
from fleetrl.tinker.losses import LOSSES
from fleetrl.tinker.types import AdamParams, Datum, SampleParams


def check_sample(params: SampleParams, max_num_samples: int, max_sample_tokens: int) -> None:
    """InvalidArgument naming each field of a sample request out of its range."""
    problems = [FieldViolation(name, why) for name, bad, why in (
        ("num_samples", not 1 <= params.num_samples <= max_num_samples, f"1..{max_num_samples}"),
        ("sampling_params.max_tokens", not 1 <= params.max_tokens <= max_sample_tokens, f"1..{max_sample_tokens}"),
        ("sampling_params.temperature", not params.temperature > 0, "must be > 0 (no greedy decoding yet)"),
        ("sampling_params.top_p", not 0 < params.top_p <= 1, "in (0, 1]"),
        ("prompt", not params.prompt, "empty"),
    ) if bad]
    if problems:
        raise InvalidArgument("bad sample request: " + "; ".join(f"{p.field}: {p.description}" for p in problems),
                              problems)


def check_loss(loss_fn: str, settings: dict[str, float], data: list[Datum]) -> None:
    """InvalidArgument naming the field when the loss, its settings or a datum's inputs do not fit."""
    loss = LOSSES.get(loss_fn)
    if loss is None:
        raise InvalidArgument(f"loss_fn {loss_fn!r} is not supported; supported: {', '.join(LOSSES)}",
                              [FieldViolation("loss_fn", "unsupported")])
    unknown = sorted(set(settings) - set(loss.settings))
    if unknown:
        raise InvalidArgument(f"loss_fn_config {unknown} not accepted by {loss_fn} (accepts {sorted(loss.settings)})",
                              [FieldViolation("loss_fn_config", "unknown keys")])
    if not data:
        raise InvalidArgument("no datums", [FieldViolation("data", "empty")])
    for i, datum in enumerate(data):
        _check_datum(i, datum, loss_fn, ("target_tokens", *loss.required), loss.optional)


def _check_datum(i: int, datum: Datum, loss_fn: str, required: tuple[str, ...], optional: tuple[str, ...]) -> None:
    where = f"data[{i}].loss_fn_inputs"
    missing = [name for name in required if name not in datum.inputs]
    unknown = [name for name in datum.inputs if name not in required and name not in optional]
    if missing or unknown:
        raise InvalidArgument(f"{where}: {loss_fn} needs {list(required)}" + (f", may take {list(optional)}"
                              if optional else "") + f"; missing {missing}, unknown {unknown}",
                              [FieldViolation(where, "inputs do not fit the loss")])
    if not datum.tokens:
        raise InvalidArgument(f"data[{i}].model_input is empty", [FieldViolation(f"data[{i}].model_input", "empty")])
    for name, values in datum.inputs.items():
        if values.shape != (len(datum.tokens),):
            raise InvalidArgument(f"{where}.{name} has shape {list(values.shape)}; model_input has "
                                  f"{len(datum.tokens)} tokens, so it must be [{len(datum.tokens)}]",
                                  [FieldViolation(f"{where}.{name}", "shape does not match model_input")])
        if not np.isfinite(values).all():
            raise InvalidArgument(f"{where}.{name} holds a non-finite value",
                                  [FieldViolation(f"{where}.{name}", "not finite")])


def check_token_ids(data: list[Datum], vocab_size: int) -> None:
    for i, datum in enumerate(data):
        for where, ids in ((f"data[{i}].model_input", np.asarray(datum.tokens)),
                           (f"data[{i}].loss_fn_inputs.target_tokens", datum.inputs["target_tokens"])):
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise InvalidArgument(f"{where} holds token ids outside the model's vocabulary [0, {vocab_size})",
                                      [FieldViolation(where, "token id out of range")])


def check_adam(adam: AdamParams) -> None:
    checks: list[tuple[str, Callable[[float], bool], str]] = [
        ("learning_rate", lambda v: v >= 0, ">= 0"), ("beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
        ("beta2", lambda v: 0 <= v < 1, "in [0, 1)"), ("eps", lambda v: v > 0, "> 0"),
        ("weight_decay", lambda v: v >= 0, ">= 0"), ("grad_clip_norm", lambda v: v >= 0, ">= 0")]
    bad = [FieldViolation(f"adam_params.{name}", why) for name, ok, why in checks
           if not (np.isfinite(getattr(adam, name)) and ok(getattr(adam, name)))]
    if bad:
        raise InvalidArgument("bad adam_params: " + "; ".join(f"{v.field} {v.description}" for v in bad), bad)
