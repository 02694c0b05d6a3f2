"""Bad submissions: every mistake named in one INVALID_ARGUMENT, oversize is RESOURCE_EXHAUSTED,
undecodable bytes never crash the server, and an unreachable reward service is UNAVAILABLE. Garbage
spec text and prompt files (random tables led by a key no spec has, prompt files holding a bad line;
huge integers, deep nesting, truncation) always get a clear error (INVALID_ARGUMENT naming fields, or
RESOURCE_EXHAUSTED), never OK, INTERNAL or UNKNOWN, and the gateway keeps serving."""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fleetrl.errors import ConfigError, ResourceExhausted, Unavailable
from fleetrl.jobs.store import JobState, JobStore
from fleetrl.proto.fleetrl.v1 import gateway_pb2, gateway_pb2_grpc
from fleetrl.runtime.grpcutil import field_violations
from fleetrl.sdk.client import Client
from tests.gateway.conftest import TOKENS, Infra, Proc

PROMPTS = b'{"prompt": "1 + 1?", "answer": "2"}\n'
VALID: dict[str, Any] = {"name": "ok", "model": "tiny-test", "prompts": "p.jsonl",
                         "reward": {"builtin": "numeric_match"}}

# Dotted path -> values that are wrong for it (type, range, choice, pattern).
BAD_VALUES: dict[str, list[Any]] = {
    "name": ["", "has space", "x" * 200, 5],
    "model": ["", 3],
    "seed": [-1, 2**40, "zero"],
    "algorithm.name": ["ppo2", 1],
    "algorithm.clip_eps": [0, -0.1, 2, "wide"],
    "algorithm.kl_coef": [-1, 11, [1]],
    "algorithm.kl_estimator": ["k4"],
    "optim.learning_rate": [0, -1e-5, 2, "fast"],
    "optim.warmup_steps": [-1, 1.5],
    "optim.betas": [[0.9], "b"],
    "rollout.samples_per_prompt": [0, 2000, "eight"],
    "rollout.temperature": [0, -1, 11],
    "rollout.top_p": [0, 1.5],
    "rollout.chat_template": ["maybe", 3],
    "train.max_steps": [0, -5, 1.5],
    "train.max_staleness": [-1, 1001],
    "train.weights_dtype": ["int8"],
    "replay.sampler": ["lifo"],
    "replay.capacity_groups": [0],
    "reward.timeout_per_item_s": [0, 601],
    "optim.learnin_rate": [1e-5],  # unknown keys
    "rollout.extra.deep": [1],
    "surprise": [{"a": 1}],
    "train": [5, "fast"],  # a section of the wrong type
}


# Where the violation is reported when it is not the mutated path itself: at the unknown table.
REPORTED_AT = {"rollout.extra.deep": "rollout.extra"}


def set_path(spec: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = spec
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def independent(paths: list[str]) -> bool:
    return not any(a != b and b.startswith(a + ".") for a in paths for b in paths)


mutations = st.lists(st.sampled_from(sorted(BAD_VALUES)), min_size=1, max_size=4, unique=True).filter(
    independent).flatmap(lambda paths: st.tuples(*(st.tuples(st.just(p), st.sampled_from(BAD_VALUES[p]))
                                                   for p in paths)))


@pytest.fixture
def alice(client_for: Callable[..., Client]) -> Client:
    return client_for("alice")


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations)
def test_every_bad_field_is_named(alice: Client, changes: tuple[tuple[str, Any], ...]) -> None:
    spec = json.loads(json.dumps(VALID))
    for path, value in changes:
        set_path(spec, path, value)
    with pytest.raises(ConfigError) as caught:
        alice.submit(json.dumps(spec), PROMPTS, spec_format="json")
    fields = [v.field for v in caught.value.violations]
    for mutated, _ in changes:
        path = REPORTED_AT.get(mutated, mutated)
        assert any(f == path or f.startswith(path + ".") for f in fields), (path, fields)


def test_prompt_lines_reward_pairing_and_spec_errors_come_together(alice: Client) -> None:
    spec = dict(VALID, reward={"file": "reward.py"}, rollout={"top_p": 3})
    prompts = b'{"prompt": "ok"}\nnot json\n[1, 2]\n{"answer": 3}\n'
    with pytest.raises(ConfigError) as caught:
        alice.submit(json.dumps(spec), prompts, spec_format="json")
    fields = {v.field for v in caught.value.violations}
    assert {"rollout.top_p", "prompts[line 2]", "prompts[line 3]", "prompts[line 4]", "reward_file"} <= fields
    with pytest.raises(ConfigError) as caught:
        alice.submit("name = [broken", b"")
    assert {"<root>", "prompts"} <= {v.field for v in caught.value.violations}
    with pytest.raises(ConfigError, match="builtin"):
        alice.submit(json.dumps(VALID), PROMPTS, b"def reward(c, p): return 1", spec_format="json")


def test_eval_prompts_pair_with_the_spec_and_their_bad_lines_are_named(alice: Client, infra: Infra) -> None:
    with_eval = dict(VALID, eval={"prompts": "eval.jsonl", "interval": 2})
    with pytest.raises(ConfigError) as caught:
        alice.submit(json.dumps(with_eval), PROMPTS, spec_format="json")
    assert [v.field for v in caught.value.violations] == ["eval_prompts"]
    with pytest.raises(ConfigError) as caught:
        alice.submit(json.dumps(VALID), PROMPTS, spec_format="json", eval_prompts=PROMPTS)
    assert [v.field for v in caught.value.violations] == ["eval_prompts"]
    with pytest.raises(ConfigError) as caught:
        alice.submit(json.dumps(with_eval), PROMPTS, spec_format="json", eval_prompts=b'{"prompt": 1}\n')
    assert [v.field for v in caught.value.violations] == ["eval.prompts[line 1]"]
    with pytest.raises(ConfigError) as caught:
        alice.submit(json.dumps(dict(VALID, eval={"interval": 2})), PROMPTS, spec_format="json")
    assert [v.field for v in caught.value.violations] == ["eval"]
    job = alice.submit(json.dumps(with_eval), PROMPTS, spec_format="json", eval_prompts=PROMPTS + PROMPTS)
    assert job.spec["eval"]["interval"] == 2 and job.spec["eval"]["samples"] == 4

    async def stored() -> bytes | None:
        store = JobStore.from_url(infra.redis_url)
        try:
            return await store.eval_prompts(job.job_id)
        finally:
            await store.close()

    assert asyncio.run(stored()) == PROMPTS + PROMPTS
    alice.cancel_job(job.job_id)


def test_reward_service_checks_files_and_builtins(alice: Client) -> None:
    spec = json.dumps(dict(VALID, reward={"file": "reward.py"}))
    assert alice.submit(spec, PROMPTS, b"def reward(completion, prompt, **kw):\n    return 1.0\n",
                        spec_format="json").state == "queued"
    for source in (b"def reward(:\n", b"x = 1\n", b"import no_such_module_here\n"):
        with pytest.raises(ConfigError) as caught:
            alice.submit(spec, PROMPTS, source, spec_format="json")
        assert [v.field for v in caught.value.violations] == ["reward.file"]
    with pytest.raises(ConfigError) as caught:
        alice.submit(json.dumps(dict(VALID, reward={"builtin": "no_such_reward"}, seed=-1)), PROMPTS,
                     spec_format="json")
    assert {v.field for v in caught.value.violations} == {"reward.builtin", "seed"}


ENV_FILE = b"class Env:\n    def __init__(self, task): pass\n    def reset(self): return 'hi'\n" \
           b"    def step(self, action): return None, 1.0, True\n"


def test_environment_jobs_are_checked_by_the_reward_service(alice: Client) -> None:
    spec = dict(VALID, environment={"file": "env.py", "max_turns": 2})
    del spec["reward"]
    assert alice.submit(json.dumps(spec), PROMPTS, spec_format="json", environment_file=ENV_FILE).state == "queued"
    for source in (b"x = 1\n", b"import no_such_module_here\n", b"class Env:\n    def reset(self): pass\n"):
        with pytest.raises(ConfigError) as caught:
            alice.submit(json.dumps(spec), PROMPTS, spec_format="json", environment_file=source)
        assert [v.field for v in caught.value.violations] == ["environment.file"]
        assert "environment cannot load" in caught.value.violations[0].description
    with pytest.raises(ConfigError) as caught:
        alice.submit(json.dumps(spec), PROMPTS, spec_format="json")
    assert [v.field for v in caught.value.violations] == ["environment_file"]
    verified = dict(spec, reward={"builtin": "numeric_match"})  # a built-in verifier scores the last action
    assert alice.submit(json.dumps(verified), PROMPTS, spec_format="json", environment_file=ENV_FILE).state == "queued"
    with pytest.raises(ConfigError) as caught:  # the verifier's params are checked as a single-turn job's
        alice.submit(json.dumps(dict(spec, reward={"builtin": "numeric_match", "params": {"rel_tol": -1}})), PROMPTS,
                     spec_format="json", environment_file=ENV_FILE)
    assert [v.field for v in caught.value.violations] == ["reward.builtin"]
    with pytest.raises(ConfigError) as caught:  # a reward file beside an environment, or neither table
        alice.submit(json.dumps(dict(spec, reward={"file": "reward.py"})), PROMPTS, b"def reward(c, p): return 1.0\n",
                     spec_format="json", environment_file=ENV_FILE)
    assert "a built-in verifier only" in str(caught.value)
    del spec["environment"]
    with pytest.raises(ConfigError) as caught:
        alice.submit(json.dumps(spec), PROMPTS, spec_format="json")
    assert "set one of the tables [reward]" in str(caught.value)
    spec["environment"] = {"file": "env.py", "max_turns": 2}
    with pytest.raises(ConfigError) as caught:
        alice.submit(json.dumps(VALID), PROMPTS, spec_format="json", environment_file=ENV_FILE)
    assert [v.field for v in caught.value.violations] == ["environment_file"]
    bad = dict(spec, environment={"file": "env.py", "max_turns": 0, "step_timeout_s": 5, "episode_timeout_s": 1})
    with pytest.raises(ConfigError) as caught:
        alice.submit(json.dumps(bad), PROMPTS, spec_format="json", environment_file=ENV_FILE)
    assert {v.field for v in caught.value.violations} >= {"environment.max_turns"}


def test_oversize_is_resource_exhausted(alice: Client) -> None:
    with pytest.raises(ResourceExhausted, match="prompt file"):
        alice.submit(json.dumps(VALID), PROMPTS * (2 * 1024 * 1024 // len(PROMPTS)), spec_format="json")
    with pytest.raises(ResourceExhausted, match="reward file"):
        alice.submit(json.dumps(VALID), PROMPTS, b"#" * 20_000, spec_format="json")
    with pytest.raises(ResourceExhausted):  # past the 4 MiB gRPC limit of this gateway
        alice.submit(json.dumps(VALID), PROMPTS, b"#" * (5 << 20), spec_format="json")


def test_random_bytes_and_5mib_garbage_do_not_crash(gateway: Proc) -> None:
    rng = random.Random(7)
    metadata = (("authorization", f"Bearer {TOKENS['alice']}"),)
    with grpc.insecure_channel(gateway.address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        raw = ch.unary_unary("/fleetrl.v1.JobService/SubmitJob", request_serializer=lambda b: b,
                             response_deserializer=lambda b: b)
        codes = []
        for size in [1, 7, 100, 4096, 3 << 20, 5 << 20, *(rng.randrange(1, 5000) for _ in range(20))]:
            with pytest.raises(grpc.RpcError) as caught:
                raw(rng.randbytes(size) if size != 5 << 20 else os.urandom(size), timeout=10, metadata=metadata)
            codes.append(caught.value.code())
        assert set(codes) <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        assert codes[5] == grpc.StatusCode.RESOURCE_EXHAUSTED
        get = ch.unary_unary("/fleetrl.v1.JobService/GetJob", request_serializer=lambda b: b,
                             response_deserializer=gateway_pb2.Job.FromString)
        with pytest.raises(grpc.RpcError) as caught:
            get(b"\xff\xff\xff", timeout=10, metadata=metadata)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stub_submit = ch.unary_unary("/fleetrl.v1.JobService/SubmitJob",
                                     request_serializer=gateway_pb2.SubmitJobRequest.SerializeToString,
                                     response_deserializer=gateway_pb2.Job.FromString)
        with pytest.raises(grpc.RpcError) as caught:  # still serving, and still naming fields
            stub_submit(gateway_pb2.SubmitJobRequest(spec="[train]\nmax_steps = 0\n"), timeout=10, metadata=metadata)
        assert "train.max_steps" in [f for f, _ in field_violations(caught.value)]
    assert gateway.proc is not None and gateway.proc.poll() is None


def test_default_limit_answers_5mib_garbage_invalid_argument(infra: Infra) -> None:
    proc = infra.gateway("default-limits").start()
    try:
        with grpc.insecure_channel(proc.address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            raw = ch.unary_unary("/fleetrl.v1.JobService/SubmitJob", request_serializer=lambda b: b,
                                 response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as caught:
                raw(b"\x0a\xff\xff\xff\x7f" + os.urandom(5 << 20), timeout=10,
                    metadata=(("authorization", f"Bearer {TOKENS['alice']}"),))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        proc.stop()


def test_unreachable_reward_service_is_unavailable(infra: Infra, tmp_path: Path) -> None:
    proc = infra.gateway("no-reward", reward_addr="127.0.0.1:1").start()
    try:
        with Client(proc.address, token=TOKENS["alice"]) as client, pytest.raises(Unavailable, match="reward"):
            client.submit(json.dumps(VALID), PROMPTS, spec_format="json")
    finally:
        proc.stop()


# ----------------------------------------------------------------------------- parser limits, ids, sizes

HUGE_INT = "9" * 5000  # past Python's 4300-digit limit on int(str)


@pytest.fixture(scope="module")
def raw(gateway: Proc) -> Iterator[Callable[..., Any]]:
    """raw("SubmitJob", request) -> the reply, or the RpcError; as alice, 30 s deadline."""
    metadata = (("authorization", f"Bearer {TOKENS['alice']}"),)
    with grpc.insecure_channel(gateway.address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = gateway_pb2_grpc.JobServiceStub(ch)

        def call(method: str, request: Any) -> Any:
            try:
                reply = getattr(stub, method)(request, timeout=30, metadata=metadata)
                return list(reply) if method in ("WatchJob", "DownloadModel") else reply
            except grpc.RpcError as error:
                return error

        yield call


def submit(raw: Callable[..., Any], spec: str, prompts: bytes = PROMPTS, fmt: str = "toml",
           reward_file: bytes = b"") -> Any:
    return raw("SubmitJob", gateway_pb2.SubmitJobRequest(spec=spec, spec_format=fmt, prompts=prompts,
                                                         reward_file=reward_file))


def violated(reply: Any) -> list[str]:
    assert isinstance(reply, grpc.RpcError) and reply.code() == grpc.StatusCode.INVALID_ARGUMENT, reply
    return [f for f, _ in field_violations(reply)]


def test_parser_limits_are_invalid_argument_naming_the_field(raw: Callable[..., Any]) -> None:
    base = json.dumps(VALID)[:-1]
    for spec, fmt in [(f"seed = {HUGE_INT}", "toml"), (f'{base}, "seed": {HUGE_INT}}}', "json"),
                      ("a = " + "[" * 60_000, "toml"), ("[" * 60_000, "json"), ('{"a":' * 12_000, "json")]:
        assert violated(submit(raw, spec, fmt=fmt)) == ["<root>"], spec[:40]
    deep = f'{base[:-1]}, "params": {{"a": {"[" * 40}{"]" * 40}}}}}}}'
    assert violated(submit(raw, deep, fmt="json")) == ["reward.params.a" + ".0" * 29]
    surrogate = f'{base[:-1]}, "params": {{"s": "\\ud800"}}}}}}'
    assert violated(submit(raw, surrogate, fmt="json")) == ["reward.params.s"]
    prompts = b'{"prompt": ' + HUGE_INT.encode() + b'}\n{"prompt": "x", "a": ' + b"[" * 100_000 + b"\n"
    assert violated(submit(raw, json.dumps(VALID), prompts, "json")) == ["prompts[line 1]", "prompts[line 2]"]


def test_a_flood_of_violations_is_clipped_not_lost(raw: Callable[..., Any]) -> None:
    many = "\n".join(f"key{i} = 1" for i in range(5000))
    fields = violated(submit(raw, many))
    assert fields[0] == "prompts" and fields[-1] == "<more>" and len(fields) < 100
    long_key = violated(submit(raw, json.dumps(dict(VALID, **{"k" * 60_000: 1})), fmt="json"))
    assert len(long_key) == 1 and long_key[0].startswith("kkk") and len(long_key[0]) < 200


def test_spec_over_64kib_is_resource_exhausted(raw: Callable[..., Any]) -> None:
    reply = submit(raw, "# padding\n" * 7000)
    assert isinstance(reply, grpc.RpcError) and reply.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "spec is" in (reply.details() or "")


def test_job_id_and_reason_are_named(raw: Callable[..., Any], alice: Client) -> None:
    for bad in ("not/an id", "x" * 65, "ok\n", "x" * 1_000_000):
        for method, request in [("GetJob", gateway_pb2.GetJobRequest(job_id=bad)),
                                ("CancelJob", gateway_pb2.CancelJobRequest(job_id=bad)),
                                ("WatchJob", gateway_pb2.WatchJobRequest(job_id=bad)),
                                ("DownloadModel", gateway_pb2.DownloadModelRequest(job_id=bad))]:
            assert violated(raw(method, request)) == ["job_id"], (method, bad[:10])
    job = alice.submit(json.dumps(VALID), PROMPTS, spec_format="json")
    too_long = raw("CancelJob", gateway_pb2.CancelJobRequest(job_id=job.job_id, reason="r" * 1001))
    assert violated(too_long) == ["reason"]
    assert alice.get_job(job.job_id).state == "queued"
    assert alice.cancel_job(job.job_id, "r" * 1000).reason == "r" * 1000


def test_watch_from_any_uint64_step(infra: Infra, alice: Client) -> None:
    job = alice.submit(json.dumps(dict(VALID, train={"max_steps": 3})), PROMPTS, spec_format="json")

    async def learn(store: JobStore) -> None:
        await store.set_state(job.job_id, JobState.RUNNING, allowed_from=(JobState.QUEUED,))
        for step in (1, 2, 3):
            await store.append_step(job.job_id, {"step": step, "reward_mean": step / 10}, lease_epoch=0)
        await store.set_state(job.job_id, JobState.SUCCEEDED)

    infra.store(learn)
    for from_step, steps in [(2**64 - 1, []), (2**63, []), (2**63 - 1, []), (4, []), (3, [3]), (0, [1, 2, 3])]:
        events = list(alice.watch_job(job.job_id, from_step=from_step, timeout_s=10))
        assert [e.step.step for e in events if e.step] == steps, from_step
        assert events[0].state == "succeeded"


# ----------------------------------------------------------------------------- arbitrary text

SPEC_KEYS = ["name", "model", "prompts", "reward", "builtin", "file", "params", "seed", "algorithm", "optim",
             "rollout", "train", "replay", "clip_eps", "learning_rate", "betas", "max_steps", "temperature",
             "system_prompt", "samples_per_prompt", "sampler", "prompt", "answer"]


class Huge(int):
    """An integer literal of more digits than Python's int(str) accepts (written out by the encoders)."""


SURROGATES = st.sampled_from(["\ud800", "a\udfffb"])  # JSON can carry them as escapes; UTF-8 cannot
keys = st.one_of(st.sampled_from(SPEC_KEYS), st.text(max_size=12), SURROGATES)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-2**70, 2**70), st.floats(),
                    st.text(max_size=30), SURROGATES, st.integers(4301, 6000).map(Huge))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(keys, inner, max_size=4)), max_leaves=16)
tables = st.one_of(st.just(VALID),  # VALID, random tables, and VALID with random parts
                   st.dictionaries(keys, values, max_size=6),
                   st.dictionaries(st.sampled_from(["seed", "optim", "rollout", "train", "reward", "name", "x"]),
                                   values, max_size=3).map(lambda extra: {**VALID, **extra}),
                   st.dictionaries(keys, values, max_size=3).map(
                       lambda params: {**VALID, "reward": {"builtin": "numeric_match", "params": params}}))


def to_json(value: Any) -> str:
    if isinstance(value, Huge):
        return "9" * int(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {to_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(to_json(v) for v in value) + "]"
    return json.dumps(value)


def quote(text: str) -> str:
    """A JSON string, which is also a TOML basic string unless it needs escapes TOML lacks (surrogates)."""
    return json.dumps(text, ensure_ascii=any("\ud800" <= c <= "\udfff" for c in text))


def to_toml(value: Any) -> str:
    """Inline TOML (None has no TOML form and is written `null`, which does not parse: fine here)."""
    if isinstance(value, Huge):
        return "9" * int(value)
    if isinstance(value, bool | int) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(repr(value), repr(value))
    if isinstance(value, dict):
        return "{" + ", ".join(f"{quote(k)} = {to_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(to_toml(v) for v in value) + "]"
    return quote(value)


def toml_document(table: dict[str, Any]) -> str:
    return "\n".join(f"{quote(k)} = {to_toml(v)}" for k, v in table.items())


GARBAGE_KEY = "not_a_spec_field"
"""The first key of every generated spec: no spec has it, so whatever the rest holds the spec is garbage
(mutations only cut or insert text: they can break the key, never turn it into a spec field)."""


@st.composite
def spec_texts(draw: st.DrawFn) -> tuple[str, str]:
    """(text, format): garbage: a random table led by GARBAGE_KEY as TOML or JSON, maybe then truncated,
    spliced or deeply nested."""
    fmt = draw(st.sampled_from(["toml", "json", "", "yaml"]))
    table = {GARBAGE_KEY: draw(st.one_of(st.integers(), values)), **draw(tables)}
    text = to_json(table) if fmt == "json" else toml_document(table)
    cut = draw(st.integers(0, len(text)))
    mutation = draw(st.sampled_from(["none", "none", "truncate", "splice", "deep", "deep_value"]))
    if mutation == "truncate":
        text = text[:cut]
    elif mutation == "splice":
        text = text[:cut] + draw(st.text(max_size=20)) + text[cut:]
    elif mutation == "deep":
        opener = draw(st.sampled_from(["[", "{", '{"a": ', "a = [", "{a = ", "[[", "a.a."]))
        text = text[:cut] + opener * draw(st.integers(30, 9000)) + text[cut:]
    elif mutation == "deep_value":
        depth = draw(st.integers(30, 3000))
        nested = "[" * depth + "1" + "]" * depth
        garbage = {GARBAGE_KEY: 1, **VALID}
        deep = {**garbage, "reward": {"builtin": "numeric_match", "params": {"a": "$"}}}
        text = (to_json(deep).replace('"$"', nested)
                if fmt == "json" else f"{toml_document(garbage)}\nreward.params.a = {nested}")
    return text, fmt


prompt_lines = st.one_of(
    values.map(to_json),
    st.dictionaries(keys, values, max_size=4).map(lambda d: to_json({"prompt": "2 + 2?", **d})),
    st.text(max_size=40),
    st.integers(30, 100_000).map(lambda n: '{"prompt": "x", "a": ' + "[" * n),
    st.integers(4301, 6000).map(lambda n: '{"prompt": ' + "9" * n + "}"),
)
prompt_files = st.one_of(st.lists(prompt_lines, max_size=8).map(lambda lines: "\n".join(lines).encode()),
                         st.binary(max_size=64))
BAD_LINES = [b"[1]", b'"2 + 2?"', b'{"answer": "4"}', b'{"prompt": ""}', b'{"prompt": 5}', b"2 + 2?", b"{"]
"""Prompt lines no prompt file may hold (not JSON, not an object, no non-empty string "prompt")."""


def with_line(data: bytes, line: bytes, at: int) -> bytes:
    lines = data.split(b"\n") if data else []
    lines.insert(min(at, len(lines)), line)
    return b"\n".join(lines)


good_prompt_files = st.lists(st.sampled_from([PROMPTS.strip(), b'{"prompt": "2 + 2?", "answer": "4"}']),
                             max_size=4).map(b"\n".join)
garbage_prompt_files = st.builds(with_line, st.one_of(good_prompt_files, prompt_files), st.sampled_from(BAD_LINES),
                                 st.integers(0, 8))
"""Good or random prompt files with at least one bad line somewhere: garbage, whatever the other lines are."""

ANSWERED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


def check_answer(reply: Any, gateway: Proc) -> None:
    """Garbage gets a clear error: INVALID_ARGUMENT naming fields, or RESOURCE_EXHAUSTED; never OK."""
    assert gateway.proc is not None and gateway.proc.poll() is None
    assert isinstance(reply, grpc.RpcError), f"garbage accepted as job {reply.job_id}"
    event(reply.code().name)
    assert reply.code() in ANSWERED, (reply.code(), reply.details())
    if reply.code() == grpc.StatusCode.INVALID_ARGUMENT:
        assert field_violations(reply), reply.details()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(spec=spec_texts(), prompts=st.one_of(st.just(PROMPTS), prompt_files))
def test_arbitrary_spec_text_is_never_internal(raw: Callable[..., Any], gateway: Proc, spec: tuple[str, str],
                                               prompts: bytes) -> None:
    check_answer(submit(raw, spec[0], prompts, spec[1]), gateway)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(prompts=garbage_prompt_files,
       reward_file=st.sampled_from([b"", b"def reward(c, p, **k):\n    return 1.0\n"]))
def test_arbitrary_prompt_lines_are_never_internal(raw: Callable[..., Any], gateway: Proc, prompts: bytes,
                                                   reward_file: bytes) -> None:
    reply = submit(raw, json.dumps(VALID), prompts, "json", reward_file)
    check_answer(reply, gateway)
    if reply.code() == grpc.StatusCode.INVALID_ARGUMENT:
        assert any(f.startswith("prompts") for f in violated(reply)), violated(reply)
        assert all(f.startswith(("prompts", "reward_file", "<more>")) for f in violated(reply)), violated(reply)


def test_still_serving_after_the_property_tests(alice: Client) -> None:
    assert alice.submit(json.dumps(VALID), PROMPTS, spec_format="json").state == "queued"
