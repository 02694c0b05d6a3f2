"""Local input mistakes are ConfigErrors naming the field or file, never raw ValueError, RecursionError,
OSError or TOMLDecodeError: the spec parser's limits, settings and tokens files, job ids, the Python
client's local files (CA file, spec_file, token), and the gateway's --config and TLS files (exit 2,
one line on stderr, no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetrl.errors import ConfigError, InvalidArgument
from fleetrl.sdk.client import Client
from fleetrl.services.gateway.__main__ import main as gateway_main
from fleetrl.services.gateway.config import GatewaySettings
from fleetrl.spec.config import MAX_SPEC_DEPTH, InfraSettings, load_settings, parse_job_spec
from fleetrl.spec.prompts import line_problem
from fleetrl.tasks.bus import check_job_id
from tests.gateway.conftest import ROOT, Infra

BASE = {"prompts": "p.jsonl", "reward": {"builtin": "numeric_match"}}
HUGE_INT = "9" * 5000  # past Python's 4300-digit limit on int(str)


def fields(text: str, fmt: str = "toml") -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_job_spec(text, fmt)  # type: ignore[arg-type]
    return [v.field for v in caught.value.violations]


@pytest.mark.parametrize(("text", "fmt"), [
    (f"seed = {HUGE_INT}", "toml"),
    (f'{{"seed": {HUGE_INT}}}', "json"),
    ("a = " + "[" * 100_000, "toml"),
    ("a = " + "{b = " * 100_000, "toml"),
    ("[" * 100_000, "json"),
    ('{"a": ' * 100_000, "json"),
])
def test_parser_limits_are_config_errors_at_root(text: str, fmt: str) -> None:
    assert fields(text, fmt) == ["<root>"]


def test_values_no_model_can_hold_are_named_with_the_other_mistakes() -> None:
    deep: object = 1
    for _ in range(MAX_SPEC_DEPTH + 5):
        deep = [deep]
    spec = dict(BASE, reward={"builtin": "x", "params": {"deep": deep, "ok": [[1]]}}, seed=-1)
    assert fields(json.dumps(spec), "json") == ["reward.params.deep" + ".0" * (MAX_SPEC_DEPTH - 3), "seed"]
    deep_toml = f'prompts = "p"\nreward.builtin = "x"\nreward.params.a = {"[" * 40}{"]" * 40}\n'
    assert fields(deep_toml) == ["reward.params.a" + ".0" * (MAX_SPEC_DEPTH - 3)]


def test_long_dotted_toml_keys_are_refused_before_parsing() -> None:
    """tomllib takes time quadratic in a dotted key's parts: 30,000 parts would take about a minute."""
    for key in (".".join(["a"] * (MAX_SPEC_DEPTH + 1)), '"a" . ' * 30_000 + "a", "a." * 30_000 + "a"):
        started = time.monotonic()
        assert fields(f'prompts = "p"\n{key} = 1\n') == ["<root>"]
        assert time.monotonic() - started < 1.0
    ok = fields(f'prompts = "p"\nreward.builtin = "x"\n{".".join(["a"] * MAX_SPEC_DEPTH)} = 1\n')
    assert ok == ["a"]  # parsed: only the unknown top-level key is wrong
    surrogate = json.dumps(BASE)[:-1] + ', "optim": {"betas": ["\\ud800", 1]}, "reward": {"builtin": "x", ' \
                                        '"params": {"s": "\\udfff", "\\ud801": 2}}}'
    assert set(fields(surrogate, "json")) == {"optim.betas.0", "reward.params", "reward.params.s"}
    fine = dict(BASE, reward={"builtin": "x", "params": {"n": 10**4000, "nested": [[{"a": [1]}]] * 3}})
    assert parse_job_spec(json.dumps(fine), "json").reward.params["n"] == 10**4000


@pytest.mark.parametrize(("line", "says"), [
    ('{"prompt": ' + HUGE_INT + "}", "not JSON: Exceeds the limit"),
    ('{"prompt": "x", "a": ' + "[" * 100_000, "nested too deeply"),
    ('{"prompt": "\\ud800"}', "prompt: not valid Unicode"),
])
def test_prompt_line_parser_limits(line: str, says: str) -> None:
    problem = line_problem(line)
    assert problem is not None and says in problem


def test_settings_file_missing_or_broken_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as caught:
        load_settings(InfraSettings, env_prefix="X_", toml_path=missing, environ={})
    assert [v.field for v in caught.value.violations] == ["config"] and str(missing) in str(caught.value)
    for broken in ("log_level = ", f"metrics_port = {HUGE_INT}", "a = " + "[" * 100_000, "\xff"):
        path = tmp_path / "broken.toml"
        path.write_bytes(broken.encode("latin-1"))
        with pytest.raises(ConfigError, match="does not parse") as caught:
            load_settings(InfraSettings, env_prefix="X_", toml_path=path, environ={})
        assert str(path) in caught.value.violations[0].description


def test_tokens_file_missing_or_broken_names_the_file(tmp_path: Path) -> None:
    for content, says in ((None, "No such file"), ("tokens = ", "does not parse"), ("tokens = 5", "must be a table")):
        path = tmp_path / "tokens.toml"
        path.unlink(missing_ok=True)
        if content is not None:
            path.write_text(content)
        with pytest.raises(ConfigError, match=says if content else None) as caught:
            GatewaySettings(tokens_file=path).token_table()
        assert caught.value.violations[0].field == "tokens_file" and says in str(caught.value)


@pytest.mark.parametrize("job_id", ["", "a/b", "x" * 65, "ok\n", "j-1 "])
def test_bad_job_id_names_the_field(job_id: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        check_job_id(job_id)
    assert [v.field for v in caught.value.violations] == ["job_id"]


def test_client_local_files_are_config_errors(tmp_path: Path) -> None:
    missing = tmp_path / "ca.pem"
    with pytest.raises(ConfigError) as caught:
        Client("127.0.0.1:1", ca_file=missing)
    assert caught.value.violations[0].field == "ca_file" and str(missing) in str(caught.value)
    with pytest.raises(ConfigError, match="token"):
        Client("127.0.0.1:1", token="t\u00f6k")
    with Client("127.0.0.1:1", timeout_s=1) as client:
        (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
        with pytest.raises(ConfigError) as caught:
            client.create_run("m", tmp_path / "p.jsonl", spec_file=tmp_path / "base.toml")
        assert caught.value.violations[0].field == "spec_file" and "base.toml" in str(caught.value)
        (tmp_path / "base.toml").write_text("name = ")
        with pytest.raises(ConfigError, match="does not parse"):
            client.create_run("m", tmp_path / "p.jsonl", spec_file=tmp_path / "base.toml")


def test_gateway_config_file_mistakes_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "gateway.toml"
    assert gateway_main(["--config", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err
    missing.write_text("listen = ")
    assert gateway_main(["--config", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "does not parse" in err and str(missing) in err


@pytest.mark.parametrize(("tls", "says"), [("missing", "tls_cert: "), ("garbage", "listen: ")])
def test_gateway_tls_file_mistakes_exit_2_without_traceback(infra: Infra, tmp_path: Path, tls: str,
                                                            says: str) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    key.write_text("not a key")
    if tls == "garbage":
        cert.write_text("not a certificate")
    config = infra.gateway(f"tls-{tls}", f'tls_cert = "{cert}"\ntls_key = "{key}"')
    done = subprocess.run([sys.executable, *config.args, "--listen", "127.0.0.1:0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr
    if tls == "missing":
        assert f"{cert}: No such file or directory" in done.stderr
