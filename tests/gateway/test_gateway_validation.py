"""Bad submissions: every mistake named in one INVALID_ARGUMENT, oversize is RESOURCE_EXHAUSTED,
undecodable bytes never crash the server, and an unreachable reward service is UNAVAILABLE."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.errors import ConfigError, ResourceExhausted, Unavailable
from services.common.grpcutil import field_violations
from services.gateway.client import Client
from services.proto.fleetrl.v1 import gateway_pb2
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
