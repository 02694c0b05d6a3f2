"""`sampling = "fleet"`: the official SDK's samples served by real actor processes over a real NATS.

A Tinker server in fleet mode publishes each sampler version's adapter to the weight store and sends each
sample request to the actors serving its base (`fleetrl.tinker.fleet`); a second server in local mode, on
the same checkpoint directory, samples in-process. Actors are `python -m fleetrl.services.actor`
subprocesses with `tinker_models` set, which the tests SIGKILL.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from prometheus_client import REGISTRY
from tinker import types

from fleetrl.launcher.embedded import EmbeddedNats, EmbeddedValkey
from fleetrl.tasks import bus
from fleetrl.tinker.fleet import path_job_id, run_job_id
from fleetrl.weights.channel import WeightPointer
from fleetrl.weights.store import WeightStore
from tests.tinker.conftest import KEYS, MODEL, Processes, TinkerServer
from tests.tinker.test_tinker_api import LOGPROB_TOL, SEQUENCE, forward_logprobs, train

ROOT = Path(__file__).resolve().parents[2]
ACK_WAIT_S = 3.0
SAME_CODE_TOL = 1e-5
"""Fleet and local samples come from the same code on the same float32 adapter: equal up to thread order."""


class Actors(Processes):
    """Actor processes serving tinker samples of MODEL, their logs under log_dir."""

    def __init__(self, nats: EmbeddedNats, valkey: EmbeddedValkey, log_dir: Path) -> None:
        super().__init__(log_dir)
        self.nats, self.valkey = nats, valkey

    def start(self, name: str) -> None:
        self.spawn(name, [sys.executable, "-m", "fleetrl.services.actor", "--actor-id", name, "--nats-url",
                          self.nats.url, "--redis-url", self.valkey.url, "--replay-addr", "127.0.0.1:1",
                          "--reward-addr", "127.0.0.1:1", "--set", "torch_threads=1",
                          "--set", f'tinker_models=["{MODEL}"]', "--set", f"tinker_sample_ack_wait_s={ACK_WAIT_S}"])
        self.wait_for(name, f"serving tinker samples of {MODEL}", 60)


@pytest.fixture(scope="module")
def fleet_server(infra: tuple[EmbeddedNats, EmbeddedValkey, Path]) -> Iterator[TinkerServer]:
    nats_server, _, root = infra
    server = TinkerServer(root / "run", sampling="fleet", nats_url=nats_server.url, sample_timeout_s=60.0,
                          max_training_runs_per_tenant=100).start()
    yield server
    server.stop()


@pytest.fixture
def actors(infra: tuple[EmbeddedNats, EmbeddedValkey, Path]) -> Iterator[Actors]:
    running = Actors(*infra)
    yield running
    running.stop_all()


async def _pointer(url: str, job_id: str) -> WeightPointer | None:
    nc = await bus.connect(url, "test")
    try:
        return await WeightStore(nc, bus.jetstream(nc)).latest(job_id)
    finally:
        await nc.close()


async def _stored_results(url: str) -> int:
    nc = await bus.connect(url, "test")
    try:
        return int((await bus.jetstream(nc).stream_info(bus.SAMPLE_RESULTS_STREAM)).state.messages)
    finally:
        await nc.close()


def _same(fleet: types.SampleResponse, local: types.SampleResponse) -> None:
    assert [s.tokens for s in fleet.sequences] == [s.tokens for s in local.sequences]
    for ours, theirs in zip(fleet.sequences, local.sequences, strict=True):
        np.testing.assert_allclose(ours.logprobs, theirs.logprobs, atol=SAME_CODE_TOL)


def test_actors_sample_what_the_local_path_samples(fleet_server: TinkerServer, actors: Actors,
                                                   infra: tuple[EmbeddedNats, EmbeddedValkey, Path]) -> None:
    """The run's saved versions go to the weight store as adapters, moving forward; actors sample from them
    (a save's own sampling client, and a named checkpoint by path) exactly what a local server samples."""
    actors.start("a1")
    local = TinkerServer(fleet_server.run_dir).start()
    try:
        sc = fleet_server.client()
        tc = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=11).result()
        train(tc, 3)
        path = tc.save_weights_for_sampler("agree").result().path
        on_fleet = tc.save_weights_and_get_sampling_client().result()
        pointer = asyncio.run(_pointer(infra[0].url, run_job_id(tc.model_id)))
        assert pointer is not None and (pointer.version, pointer.kind, pointer.base) == (0, "adapter", MODEL)
        by_path = sc.create_sampling_client(model_path=path).result()
        in_process = local.client().create_sampling_client(model_path=path).result()

        prompt, params = types.ModelInput.from_ints(SEQUENCE[:8]), types.SamplingParams(max_tokens=8, seed=5)
        expected = in_process.sample(prompt, 2, params).result()
        first = on_fleet.sample(prompt, 2, params).result()
        _same(first, expected)
        _same(by_path.sample(prompt, 2, params).result(), expected)
        for seq in first.sequences:  # and the sampler's log-probs are the trainer's, within the documented bound
            full = forward_logprobs(tc, SEQUENCE[:8] + seq.tokens)[-len(seq.tokens):]
            assert np.abs(np.asarray(seq.logprobs) - full).max() <= LOGPROB_TOL
        whole = types.ModelInput.from_ints(SEQUENCE)
        np.testing.assert_allclose(on_fleet.compute_logprobs(whole).result()[1:],
                                   in_process.compute_logprobs(whole).result()[1:], atol=SAME_CODE_TOL)

        train(tc, 1)
        newer = tc.save_weights_and_get_sampling_client().result()
        pointer = asyncio.run(_pointer(infra[0].url, run_job_id(tc.model_id)))
        assert pointer is not None and pointer.version == 1  # the next version, above the last
        assert newer.sample(prompt, 2, params).result().sequences != first.sequences
        _same(on_fleet.sample(prompt, 2, params).result(), expected)  # the older client keeps its version
        assert "served" in actors.text("a1")

        # deleting the named checkpoint deletes its versions from the weight store too
        checkpoint_job = path_job_id("alice", path)
        assert asyncio.run(_pointer(infra[0].url, checkpoint_job)) is not None
        tinker.RestClient(base_url=fleet_server.url, api_key=KEYS["alice"]).delete_checkpoint_from_tinker_path(
            path).result()
        deadline = time.monotonic() + 10
        while asyncio.run(_pointer(infra[0].url, checkpoint_job)) is not None:
            assert time.monotonic() < deadline, "the deleted checkpoint's sampler versions are still in the store"
            time.sleep(0.2)
        with pytest.raises(tinker.RequestFailedError, match=f"checkpoint {path} was deleted"):
            by_path.sample(prompt, 2, params).result()  # though the actor still holds the version
        sc.close("success").result()  # the session's end deletes its runs' sampler versions from the store
        deadline = time.monotonic() + 10
        while asyncio.run(_pointer(infra[0].url, run_job_id(tc.model_id))) is not None:
            assert time.monotonic() < deadline, "the closed session's sampler versions are still in the store"
            time.sleep(0.2)
    finally:
        local.stop()


def test_requests_waiting_together_are_decoded_in_one_batch_each_from_its_own_adapter(
        fleet_server: TinkerServer, actors: Actors) -> None:
    """Six requests of three samplers (a trained run's, a fresh run's, the base's) waiting when an actor starts:
    it decodes them in one batch, each with its own adapter; every sampled token's log-prob is its own
    trainer's within the documented tolerance."""
    sc = fleet_server.client()
    trained = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=21).result()
    train(trained, 3)
    fresh = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=22).result()
    samplers = {"trained": (trained, trained.save_weights_and_get_sampling_client().result()),
                "fresh": (fresh, fresh.save_weights_and_get_sampling_client().result()),
                "base": (fresh, sc.create_sampling_client(base_model=MODEL).result())}
    prompt = types.ModelInput.from_ints(SEQUENCE[:8])
    futures = {(name, i): sampler.sample(prompt, 2, types.SamplingParams(max_tokens=6, seed=30 + i))
               for name, (_, sampler) in samplers.items() for i in range(2)}
    time.sleep(1.0)  # every request in the stream before the actor's first fetch
    actors.start("b1")
    for (name, _), future in futures.items():
        trainer = samplers[name][0]
        for sequence in future.result(timeout=60).sequences:
            want = forward_logprobs(trainer, SEQUENCE[:8] + sequence.tokens + [0])[7:7 + len(sequence.tokens)]
            np.testing.assert_allclose(sequence.logprobs, want, atol=LOGPROB_TOL)
    assert f"6 tinker samples of {MODEL} decoded in one batch" in actors.text("b1")
    continuation = [*SEQUENCE[:12], 0]
    assert np.abs(forward_logprobs(trained, continuation) - forward_logprobs(fresh, continuation)).max() > 0.1


def test_an_actor_killed_holding_a_sample_another_serves_it_once(
        fleet_server: TinkerServer, actors: Actors, infra: tuple[EmbeddedNats, EmbeddedValkey, Path]) -> None:
    actors.start("k1")
    tc = fleet_server.client().create_lora_training_client(base_model=MODEL, rank=8, seed=12).result()
    train(tc, 1)
    sampler = tc.save_weights_and_get_sampling_client().result()
    stored, dropped = asyncio.run(_stored_results(infra[0].url)), _dropped()
    params = types.SamplingParams(max_tokens=256, seed=9, stop=[])  # no stop token: 4 x 256 tokens take seconds
    future = sampler.sample(types.ModelInput.from_ints(SEQUENCE[:8]), 4, params)
    actors.wait_for("k1", "delivery 1 received", 30)
    actors.kill("k1")
    assert "served" not in actors.text("k1")
    actors.start("k2")
    result = future.result(timeout=60)
    assert [len(s.tokens) for s in result.sequences] == [256] * 4
    actors.wait_for("k2", "delivery 2 served", 10)  # logged after the result is published: a moment after it
    assert "delivery 2 received" in actors.text("k2")
    assert asyncio.run(_stored_results(infra[0].url)) == stored + 1  # one result stored
    assert _dropped() == dropped  # and none dropped as a second one


def _dropped() -> float:
    return REGISTRY.get_sample_value("fleetrl_tinker_sample_results_dropped_total") or 0.0


def test_a_sample_no_actor_serves_fails_at_its_deadline(infra: tuple[EmbeddedNats, EmbeddedValkey, Path],
                                                         tmp_path: Path) -> None:
    server = TinkerServer(tmp_path, sampling="fleet", nats_url=infra[0].url, sample_timeout_s=2.0).start()
    try:
        sampler = server.client().create_sampling_client(base_model="tiny-llama").result()
        started = time.monotonic()
        with pytest.raises(tinker.RequestFailedError, match="not answered within 2s"):
            sampler.sample(types.ModelInput.from_ints(SEQUENCE[:4]), 1, types.SamplingParams(max_tokens=4)).result()
        assert time.monotonic() - started < 15
    finally:
        server.stop()
