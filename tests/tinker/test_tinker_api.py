"""The official tinker SDK (0.38.0) against a real fleetrl Tinker API server, unchanged: training changes
the adapter, samplers see saved weights, log-probs agree, replays apply nothing twice, tenants are
isolated, bad input gets the SDK's error types, and a restarted server loads saved state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from prometheus_client import REGISTRY
from tinker import types

from tests.tinker.conftest import KEYS, MODEL, TinkerServer

SEQUENCE = list(range(1000, 1024))
LOGPROB_TOL = 1e-3
"""Documented bound (docs/tinker.md) on |sampler log-prob - forward log-prob|: the sampler merges the
adapter into the base weights, the trainer runs PEFT's layers; the same function rounded differently."""
ADAM = types.AdamParams(learning_rate=3e-3)


def datum(tokens: list[int], **inputs: Any) -> types.Datum:
    """Next-token prediction over `tokens`."""
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], **inputs})


def forward_logprobs(tc: tinker.TrainingClient, tokens: list[int]) -> np.ndarray:
    out = tc.forward([datum(tokens)], "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist())


def train(tc: tinker.TrainingClient, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward([datum(SEQUENCE)], "cross_entropy")
        step = tc.optim_step(ADAM)
        losses.append(fb.result().metrics["loss:sum"])
        step.result()
    return losses


def post(server: TinkerServer, path: str, body: dict[str, Any], tenant: str = "alice") -> httpx.Response:
    return httpx.post(f"{server.url}/api/v1/{path}", json=body, headers={"X-API-Key": KEYS[tenant]}, timeout=30)


def result(server: TinkerServer, request_id: str) -> dict[str, Any]:
    while True:
        answer = post(server, "retrieve_future", {"request_id": request_id})
        answer.raise_for_status()
        if answer.json().get("type") != "try_again":
            return dict(answer.json())


def test_forward_backward_and_optim_step_train_the_adapter(alice: tinker.ServiceClient) -> None:
    tc = alice.create_lora_training_client(base_model=MODEL, rank=8, seed=0).result()
    before = forward_logprobs(tc, SEQUENCE)
    losses = train(tc, 6)
    after = forward_logprobs(tc, SEQUENCE)
    assert losses[-1] < losses[0] - 1.0, losses
    assert -after.sum() == pytest.approx(train(tc, 1)[0], rel=1e-4)  # the loss is the sum of the forward's
    assert np.abs(after - before).max() > 1e-2


def test_sampler_sees_saved_weights_and_agrees_with_forward(alice: tinker.ServiceClient) -> None:
    tc = alice.create_lora_training_client(base_model=MODEL, rank=8, seed=1).result()
    untrained = tc.save_weights_and_get_sampling_client().result()
    train(tc, 4)
    trained = tc.save_weights_and_get_sampling_client().result()
    expected = forward_logprobs(tc, SEQUENCE)
    prompt = types.ModelInput.from_ints(SEQUENCE)
    new = np.asarray(trained.compute_logprobs(prompt).result()[1:], dtype=float)
    old = np.asarray(untrained.compute_logprobs(prompt).result()[1:], dtype=float)
    assert np.abs(new - expected).max() <= LOGPROB_TOL
    assert np.abs(old - expected).max() > 10 * LOGPROB_TOL  # the earlier snapshot keeps the earlier weights

    sampled = trained.sample(types.ModelInput.from_ints(SEQUENCE[:8]), 2,
                             types.SamplingParams(max_tokens=8, seed=3)).result()
    assert len(sampled.sequences) == 2
    for seq in sampled.sequences:
        assert seq.logprobs is not None and len(seq.tokens) == len(seq.logprobs) > 0
        full = forward_logprobs(tc, SEQUENCE[:8] + seq.tokens)[-len(seq.tokens):]
        assert np.abs(np.asarray(seq.logprobs) - full).max() <= LOGPROB_TOL


def test_a_replayed_request_id_applies_no_second_step(server: TinkerServer, alice: tinker.ServiceClient) -> None:
    tc = alice.create_lora_training_client(base_model=MODEL, rank=8, seed=2).result()
    tc.forward_backward([datum(SEQUENCE)], "cross_entropy").result()
    body = {"model_id": tc.model_id, "seq_id": 10_000, "adam_params": ADAM.model_dump()}
    first = post(server, "optim_step", body).json()["request_id"]
    stepped = forward_logprobs(tc, SEQUENCE)
    replayed = post(server, "optim_step", body).json()["request_id"]
    assert replayed == first
    assert result(server, replayed) == result(server, first)
    assert result(server, first)["metrics"]["step:max"] == 1.0
    np.testing.assert_array_equal(forward_logprobs(tc, SEQUENCE), stepped)  # the replay moved nothing
    assert tc.optim_step(ADAM).result().metrics["step:max"] == 2.0  # the next step is the second


def test_another_tenants_key_is_refused(server: TinkerServer, alice: tinker.ServiceClient) -> None:
    tc = alice.create_lora_training_client(base_model=MODEL, rank=8, seed=3).result()
    path = tc.save_weights_for_sampler("shared").result().path
    bob = server.client("bob")
    with pytest.raises(tinker.NotFoundError, match="not found"):
        bob.create_sampling_client(model_path=path).result()
    assert post(server, "get_info", {"model_id": tc.model_id}, tenant="bob").status_code == 404
    assert post(server, "optim_step", {"model_id": tc.model_id, "seq_id": 1, "adam_params": {}},
                tenant="bob").status_code == 404
    future = post(server, "optim_step", {"model_id": tc.model_id, "seq_id": 50, "adam_params": {}}).json()
    assert post(server, "retrieve_future", {"request_id": future["request_id"]}, tenant="bob").status_code == 404
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=server.url, api_key="tml-nobody").create_lora_training_client(MODEL).result()


def test_checkpoints_are_read_listed_and_deleted_through_the_rest_client(server: TinkerServer,
                                                                        alice: tinker.ServiceClient) -> None:
    """What tinker-cookbook's checkpoint_utils calls: a run read by a checkpoint's path, its checkpoints
    listed, one deleted; another tenant reads and deletes none of them."""
    tc = alice.create_lora_training_client(base_model=MODEL, rank=8, seed=4).result()
    state = tc.save_state("first").result().path
    sampler = tc.save_weights_for_sampler("snapshot").result().path
    rest = tinker.RestClient(base_url=server.url, api_key=KEYS["alice"])
    run = rest.get_training_run_by_tinker_path(state).result()
    assert (run.training_run_id, run.base_model, run.lora_rank, run.model_owner) == (tc.model_id, MODEL, 8, "alice")
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state
    assert run.last_sampler_checkpoint is not None and run.last_sampler_checkpoint.tinker_path == sampler
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type, c.tinker_path) for c in listed] == [
        ("weights/first", "training", state), ("sampler_weights/snapshot", "sampler", sampler)]
    assert all(c.size_bytes is not None and c.size_bytes > 0 for c in listed)

    bob = tinker.RestClient(base_url=server.url, api_key=KEYS["bob"])
    with pytest.raises(tinker.NotFoundError, match="not found"):
        bob.list_checkpoints(tc.model_id).result()
    with pytest.raises(tinker.NotFoundError, match="not found"):
        bob.delete_checkpoint_from_tinker_path(sampler).result()

    by_path = alice.create_sampling_client(model_path=sampler).result()
    prompt, params = types.ModelInput.from_ints(SEQUENCE[:8]), types.SamplingParams(max_tokens=4, seed=1)
    assert len(by_path.sample(prompt, 1, params).result().sequences) == 1
    rest.delete_checkpoint_from_tinker_path(sampler).result()
    with pytest.raises(tinker.RequestFailedError, match=f"checkpoint {sampler} was deleted"):
        by_path.sample(prompt, 1, params).result()  # as on the fleet, where its versions go with it
    assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [state]
    with pytest.raises(tinker.NotFoundError, match="not found"):
        alice.create_sampling_client(model_path=sampler).result()
    with pytest.raises(tinker.NotFoundError, match="not found"):
        rest.delete_checkpoint_from_tinker_path(sampler).result()
    with pytest.raises(tinker.BadRequestError, match="checkpoint_id"):
        rest.delete_checkpoint(tc.model_id, "weights/-x").result()
    assert alice.create_training_client_from_state(state).result().model_id  # the other one is untouched


def test_bad_inputs_get_the_sdks_errors_naming_the_field(alice: tinker.ServiceClient) -> None:
    with pytest.raises(tinker.BadRequestError, match="base_model 'no-such-model'"):
        alice.create_lora_training_client(base_model="no-such-model", rank=8).result()
    tc = alice.create_lora_training_client(base_model=MODEL, rank=8, seed=4).result()
    with pytest.raises(tinker.BadRequestError, match="loss_fn 'cispo' is not supported"):
        tc.forward([datum(SEQUENCE)], "cispo").result()
    with pytest.raises(tinker.BadRequestError, match=r"data\[0\].loss_fn_inputs.weights has shape \[3\]"):
        tc.forward_backward([datum(SEQUENCE, weights=[1.0, 1.0, 1.0])], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match=r"missing \['logprobs', 'advantages'\]"):
        tc.forward_backward([datum(SEQUENCE)], "importance_sampling").result()
    with pytest.raises(tinker.BadRequestError, match=r"target_tokens holds token ids outside"):
        tc.forward([datum([*SEQUENCE, 10**9])], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match=r"adam_params\.learning_rate"):
        tc.optim_step(types.AdamParams(learning_rate=-1.0)).result()
    sampler = alice.create_sampling_client(base_model=MODEL).result()
    with pytest.raises(tinker.BadRequestError, match=r"sampling_params\.top_k"):
        sampler.sample(types.ModelInput.from_ints(SEQUENCE), 1, types.SamplingParams(max_tokens=4, top_k=5)).result()
    assert train(tc, 1)  # refused requests leave the client usable


def test_a_restarted_server_loads_saved_state(tmp_path: Path) -> None:
    first = TinkerServer(tmp_path).start()
    try:
        tc = first.client().create_lora_training_client(base_model=MODEL, rank=8, seed=5).result()
        train(tc, 2)
        state = tc.save_state("ckpt").result().path
        sampler = tc.save_weights_for_sampler("ckpt").result().path
        expected = forward_logprobs(tc, SEQUENCE)
    finally:
        first.stop()
    second = TinkerServer(tmp_path).start()
    try:
        sc = second.client()
        resumed = sc.create_training_client_from_state_with_optimizer(state).result()
        np.testing.assert_allclose(forward_logprobs(resumed, SEQUENCE), expected, atol=1e-6)
        sampling = sc.create_sampling_client(model_path=sampler).result()
        prompt_logprobs = sampling.compute_logprobs(types.ModelInput.from_ints(SEQUENCE)).result()[1:]
        assert np.abs(np.asarray(prompt_logprobs, dtype=float) - expected).max() <= LOGPROB_TOL
        resumed.forward_backward([datum(SEQUENCE)], "cross_entropy").result()
        assert resumed.optim_step(ADAM).result().metrics["step:max"] == 3.0  # the step count came back too
    finally:
        second.stop()


def test_a_tenant_past_its_quota_is_refused_at_once_and_another_tenant_is_not(tmp_path: Path) -> None:
    """max_training_runs_per_tenant and max_sessions_per_tenant: one more is RateLimitError naming the
    setting, answered once (the SDK does not retry it), and another tenant's runs are unaffected; closing a
    session frees its runs and its place."""
    server = TinkerServer(tmp_path, max_training_runs_per_tenant=2, max_sessions_per_tenant=2).start()

    def refusals(route: str) -> float:
        return REGISTRY.get_sample_value("fleetrl_tinker_http_seconds_count",
                                         {"route": f"/api/v1/{route}", "status": "429"}) or 0.0

    try:
        first, second = server.client("alice"), server.client("alice")
        second.create_sampling_client(base_model=MODEL)  # its session (the SDK starts one at its first client)
        first.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
        first.create_lora_training_client(base_model=MODEL, rank=4, seed=2).result()
        before = refusals("create_model")
        with pytest.raises(tinker.RateLimitError, match=r"holds 2 training runs.*max_training_runs_per_tenant = 2"):
            second.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()  # over both sessions
        assert refusals("create_model") == before + 1  # refused once: no retries
        bob = server.client("bob")
        assert train(bob.create_lora_training_client(base_model=MODEL, rank=4, seed=4).result(), 1)
        with pytest.raises(tinker.RateLimitError, match=r"holds 2 sessions.*max_sessions_per_tenant = 2"):
            server.client("alice").create_sampling_client(base_model=MODEL)  # the SDK's session starts here
        first.close("success").result()  # frees its two runs and its session
        assert train(second.create_lora_training_client(base_model=MODEL, rank=4, seed=5).result(), 1)
        server.client("alice").close("success").result()
    finally:
        server.stop()


def test_closing_the_session_frees_its_training_runs(server: TinkerServer) -> None:
    sc = server.client()
    tc = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=6).result()
    assert post(server, "get_info", {"model_id": tc.model_id}).status_code == 200
    sc.close("success").result()
    assert post(server, "get_info", {"model_id": tc.model_id}).status_code == 404


def test_a_chunk_of_several_micro_batches_is_one_sum(alice: tinker.ServiceClient) -> None:
    tc = alice.create_lora_training_client(base_model=MODEL, rank=8, seed=7).result()
    sequences = [SEQUENCE[: 6 + i] for i in range(11)]  # 11 datums of different lengths: two micro-batches
    out = tc.forward_backward([datum(s) for s in sequences], "cross_entropy").result()
    singles = [forward_logprobs(tc, s) for s in sequences]
    for got, alone in zip(out.loss_fn_outputs, singles, strict=True):
        np.testing.assert_allclose(np.asarray(got["logprobs"].tolist()), alone, atol=1e-5)
    assert out.metrics["loss:sum"] == pytest.approx(-sum(a.sum() for a in singles), rel=1e-5)


def test_each_call_and_its_work_are_measured(alice: tinker.ServiceClient) -> None:
    def count(name: str, labels: dict[str, str]) -> float:
        return REGISTRY.get_sample_value(f"{name}_count", labels) or 0.0

    work = ("fleetrl_tinker_work_seconds", {"kind": "OptimStep", "outcome": "ok"})
    calls = ("fleetrl_tinker_http_seconds", {"route": "/api/v1/optim_step", "status": "200"})
    before = count(*work), count(*calls)
    tc = alice.create_lora_training_client(base_model=MODEL, rank=8, seed=8).result()
    train(tc, 1)
    assert count(*work) == before[0] + 1 and count(*calls) == before[1] + 1
