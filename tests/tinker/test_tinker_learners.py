"""`training = "fleet"`: the official SDK's training runs held by real learner processes over a real NATS.

A Tinker server in fleet-training mode places each training run on one of the learners hosting its base
(`fleetrl.tinker.learners`) and drives it there; the learners are `python -m fleetrl.services.learner`
subprocesses with `tinker_models` set, which the tests SIGKILL between a forward_backward and its optim_step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
import torch
from nats.aio.client import Client as NATS

from fleetrl.errors import Unavailable
from fleetrl.launcher.embedded import EmbeddedNats, EmbeddedValkey
from fleetrl.policy.lora import SharedBases
from fleetrl.tasks import bus
from fleetrl.tinker import learners as learner_link
from fleetrl.tinker.fleet import FleetSampling, SamplerVersions, run_job_id
from fleetrl.tinker.learners import LearnerTraining, RemoteRun, TrainingHost
from fleetrl.tinker.requests import Request, RequestLog
from fleetrl.tinker.sampling import SamplerWeights
from fleetrl.tinker.service import Limits, TinkerService
from fleetrl.tinker.training import lora_spec
from fleetrl.tinker.types import AdamParams, Datum, LoraRequest
from fleetrl.weights import factory
from fleetrl.weights.channel import WeightChannel, decode_safetensors
from tests.tinker.conftest import MODEL, Processes, TinkerServer
from tests.tinker.test_tinker_api import ADAM, SEQUENCE, datum, forward_logprobs, post, train

SAME_CODE_TOL = 1e-6
"""A run on a learner and one in the server compute with the same code on the same CPU, one thread each."""


DATA = [Datum(SEQUENCE[:-1], {"target_tokens": np.asarray(SEQUENCE[1:], dtype=np.int64)})]
"""One datum of next-token prediction, for the tests that drive `TinkerService` in the test's process."""


async def done(request: Request) -> Any:
    return await asyncio.wrap_future(request.future)


async def saved_run(service: TinkerService, session: str, seed: int, name: str) -> tuple[str, list[np.ndarray]]:
    """A run of tenant t trained one step and saved (save_state `name`): its id, and its log-probs at the save
    (after seq_ids 1-4)."""
    created = await done(service.create_model("t", session, 0, MODEL, LoraRequest(rank=4, seed=seed)))
    model_id = created["model_id"]
    await done(service.forward_backward("t", model_id, 1, DATA, "cross_entropy", {}, False))
    await done(service.optim_step("t", model_id, 2, AdamParams(learning_rate=1e-2)))
    await done(service.save_state("t", model_id, 3, name))
    return model_id, (await done(service.forward_backward("t", model_id, 4, DATA, "cross_entropy", {}, True))).logprobs


class Learners(Processes):
    """Learner processes hosting Tinker training runs of MODEL, their logs under log_dir."""

    def __init__(self, nats: EmbeddedNats, valkey: EmbeddedValkey, log_dir: Path) -> None:
        super().__init__(log_dir)
        self.nats, self.valkey = nats, valkey

    def start(self, name: str) -> None:
        self.spawn(name, [sys.executable, "-m", "fleetrl.services.learner", "--nats-url", self.nats.url,
                          "--redis-url", self.valkey.url, "--replay-addr", "127.0.0.1:1",
                          "--run-dir", str(self.log_dir / name), "--set", f"learner_id={name}",
                          "--set", "listen=127.0.0.1:0", "--set", "torch_threads=1",
                          "--set", f'tinker_models=["{MODEL}"]', "--set", "claim_poll_s=5"])

    def holder(self, model_id: str) -> str:
        """The learner a run was last placed on: the latest of the learners' logged placements (logs are kept
        across restarts, so by the time stamp each line starts with)."""
        placed = [(line[:23], name) for name in self.procs for line in self.text(name).splitlines()
                  if f"run {model_id}@" in line and "placed here" in line]
        assert placed, f"no learner logged run {model_id}"
        return max(placed)[1]


@pytest.fixture(scope="module")
def learners(infra: tuple[EmbeddedNats, EmbeddedValkey, Path]) -> Iterator[Learners]:
    running = Learners(*infra)
    for name in ("l1", "l2"):
        running.start(name)
    for name in ("l1", "l2"):
        running.wait_for(name, "hosting tinker training runs of", 90)
    yield running
    running.stop_all()


@pytest.fixture(scope="module")
def fleet_server(infra: tuple[EmbeddedNats, EmbeddedValkey, Path], learners: Learners) -> Iterator[TinkerServer]:
    nats_server, _, root = infra
    server = TinkerServer(root / "run", training="fleet", nats_url=nats_server.url, train_timeout_s=60.0,
                          max_training_runs_per_tenant=100).start()
    yield server
    server.stop()


def test_a_run_on_a_learner_trains_as_a_run_in_the_server(fleet_server: TinkerServer, learners: Learners,
                                                          tmp_path: Path) -> None:
    """The same seed and steps give the same adapter on a learner as in a local-training server, and its
    sampler version samples the same; another tenant's key reaches neither the learner-held run nor its state."""
    local = TinkerServer(tmp_path / "local").start()
    try:
        ours = fleet_server.client().create_lora_training_client(base_model=MODEL, rank=8, seed=3).result()
        theirs = local.client().create_lora_training_client(base_model=MODEL, rank=8, seed=3).result()
        assert learners.holder(ours.model_id) in ("l1", "l2")
        np.testing.assert_allclose(train(ours, 2), train(theirs, 2), atol=SAME_CODE_TOL)
        np.testing.assert_allclose(forward_logprobs(ours, SEQUENCE), forward_logprobs(theirs, SEQUENCE),
                                   atol=SAME_CODE_TOL)
        info = ours.get_info()
        assert (info.model_data.arch, info.lora_rank) == ("LlamaForCausalLM", 8)
        saved = ours.save_state("ours").result().path  # another tenant reaches neither the run nor its state
        assert post(fleet_server, "optim_step", {"model_id": ours.model_id, "seq_id": 90, "adam_params": {}},
                    tenant="bob").status_code == 404
        with pytest.raises(tinker.RequestFailedError, match=f"checkpoint {saved} not found"):  # read under bob's
            fleet_server.client("bob").create_training_client_from_state(saved).result()
        sampler = ours.save_weights_and_get_sampling_client().result()  # the adapter comes from the learner
        prompt = tinker.types.ModelInput.from_ints(SEQUENCE[:8])
        params = tinker.types.SamplingParams(max_tokens=4, seed=1, temperature=1.0)
        got = sampler.sample(prompt, 1, params).result().sequences[0].tokens
        theirs_sampler = theirs.save_weights_and_get_sampling_client().result()
        want = theirs_sampler.sample(prompt, 1, params).result().sequences[0].tokens
        assert got == want
    finally:
        local.stop()


def test_a_learner_killed_between_forward_backward_and_optim_step(fleet_server: TinkerServer,
                                                                  learners: Learners) -> None:
    """SIGKILL of the run's learner after a forward_backward: the optim_step fails saying the run was restored
    from its last save_state on the other learner; the run then has exactly the saved weights and step count,
    and trains on."""
    tc = fleet_server.client().create_lora_training_client(base_model=MODEL, rank=8, seed=5).result()
    train(tc, 2)
    saved = tc.save_state("two-steps").result().path
    at_save = forward_logprobs(tc, SEQUENCE)
    train(tc, 1)  # a step after the save: lost with the learner
    tc.forward_backward([datum(SEQUENCE)], "cross_entropy").result()
    holder = learners.holder(tc.model_id)
    other = next(n for n in ("l1", "l2") if n != holder)
    learners.kill(holder)
    try:
        with pytest.raises(tinker.RequestFailedError) as lost:
            tc.optim_step(ADAM).result()
        message = str(lost.value)
        assert f"restored on learner {other}" in message and saved in message and "(step 2)" in message, message
        assert learners.holder(tc.model_id) == other
        np.testing.assert_allclose(forward_logprobs(tc, SEQUENCE), at_save, atol=SAME_CODE_TOL)
        fb = tc.forward_backward([datum(SEQUENCE)], "cross_entropy")
        metrics = tc.optim_step(ADAM).result().metrics
        fb.result()
        assert metrics["step:max"] == 3.0  # the saved 2, and this one
    finally:
        learners.start(holder)
        learners.wait_for(holder, "hosting tinker training runs of", 90)


def test_a_run_lost_with_no_save_state_fails_every_later_call(fleet_server: TinkerServer,
                                                              learners: Learners) -> None:
    tc = fleet_server.client().create_lora_training_client(base_model=MODEL, rank=8, seed=6).result()
    train(tc, 1)
    holder = learners.holder(tc.model_id)
    learners.kill(holder)
    try:
        for _ in range(2):
            with pytest.raises(tinker.RequestFailedError, match="has no save_state checkpoint to resume from"):
                tc.forward([datum(SEQUENCE)], "cross_entropy").result()
    finally:
        learners.start(holder)
        learners.wait_for(holder, "hosting tinker training runs of", 90)


class Rig:
    """A `TinkerService` training on `TrainingHost`s, all in the test's process on a real NATS: the hosts are
    learners without their jobs; closing one takes its subscriptions away, as a SIGKILLed learner's go."""

    def __init__(self, nc: NATS, tmp_path: Path, *, fleet: bool) -> None:
        self.nc, self.transport = nc, factory.transport(None, nc, bus.jetstream(nc))
        self.store = WeightChannel(self.transport)
        self.hosts: dict[str, TrainingHost] = {}
        self.executor = concurrent.futures.ThreadPoolExecutor(1)
        loop = asyncio.get_running_loop()
        self.link = LearnerTraining(nc, self.transport, loop, f"test-{uuid.uuid4().hex[:8]}", timeout_s=30)
        self.log = RequestLog(self.executor)
        requester: Any = None  # FleetSampling only publishes here: no sample is asked of an actor
        sampling = FleetSampling(self.store, requester, loop, keep=4, timeout_s=30) if fleet else None
        self.service = TinkerService(Limits((MODEL,), (), tmp_path, 64, 64, 8, 8, 8), self.log, sampling,
                                     learners=self.link)

    async def host(self, name: str, *, max_runs: int = 2,
                   compute: concurrent.futures.Executor | None = None) -> TrainingHost:
        host = TrainingHost(self.nc, self.transport, name, [MODEL], max_runs=max_runs, idle_s=60, compute=compute,
                            bases=SharedBases(), versions=SamplerVersions(self.store))
        await host.start()
        self.hosts[name] = host
        return host

    async def lose(self, name: str) -> None:
        await self.hosts.pop(name).close()

    async def close(self) -> None:
        for host in self.hosts.values():
            await host.close()
        await self.link.purge()
        await self.nc.close()
        self.executor.shutdown()


def in_process(tmp_path: Path, test: Callable[[Rig], Coroutine[Any, Any, None]], *, fleet: bool = False) -> None:
    """Run `test` on a `Rig` over a NATS of its own (no other learner takes its placements)."""

    async def main(url: str) -> None:
        rig = Rig(await bus.connect(url, "test"), tmp_path, fleet=fleet)
        try:
            await test(rig)
        finally:
            await rig.close()

    with EmbeddedNats(data_dir=tmp_path / "nats") as nats_server:
        asyncio.run(main(nats_server.url))


def test_a_call_sent_twice_runs_once(tmp_path: Path) -> None:
    """The service sends a call again when its answer is lost: the learner answers from what it remembers,
    and an optim_step is applied once. A placement with the learner full (it leaves the queue group until a run
    leaves), or with no learner hosting the base, is refused naming the settings."""

    async def test(rig: Rig) -> None:
        await rig.host("in-test", max_runs=1)
        link = rig.link
        body = {"model_id": "session-x:train:0", "tenant": "t", "base_model": MODEL, "seed": 1, "state": None,
                "lora": lora_spec(LoraRequest(rank=4)).model_dump(mode="json"), "with_optimizer": True}
        pid = (await link.place(body))["placement"]
        fb = {"op": "forward_backward", "placement": pid, "call": f"{pid}/1", "loss_fn": "cross_entropy",
              "settings": {}, "backward": True, "data": [_wire(SEQUENCE)]}
        assert (await link.call("in-test", fb))["pending_chunks"] == 1
        step = {"op": "optim_step", "placement": pid, "call": f"{pid}/2", "adam": {"learning_rate": 1e-2}}
        first, again = await link.call("in-test", step), await link.call("in-test", step)
        assert first == again and (first["steps"], first["result"]["step:max"]) == (1, 1.0)
        with pytest.raises(Unavailable, match="tinker_max_runs"):  # the full learner left the queue group
            await link.place({**body, "model_id": "session-x:train:1"})
        with pytest.raises(Unavailable, match="tinker_models"):
            await link.place({**body, "base_model": "a-base-no-learner-hosts"})
        await link.call("in-test", {"op": "close", "placement": pid, "call": f"{pid}/3"})  # a run leaves: room
        assert (await link.place({**body, "model_id": "session-x:train:2"}))["learner"] == "in-test"

    in_process(tmp_path, test)


def test_calls_queued_before_a_loss_fail_as_the_call_that_found_it(tmp_path: Path) -> None:
    """Calls of a run that reached the service before its learner's loss was known (queued behind a held work
    thread here) fail with the restore's message, as the call that found the loss does; a call after runs on
    the restored weights."""

    async def test(rig: Rig) -> None:
        for name in ("a", "b"):
            await rig.host(name)
        service = rig.service
        model_id, at_save = await saved_run(service, service.create_session("t"), 1, "one")
        await done(service.forward_backward("t", model_id, 5, DATA, "cross_entropy", {}, False))
        gate = threading.Event()
        held = rig.log.submit("t", ("hold", 0), "Hold", gate.wait)  # the service's work thread, held
        try:
            step = service.optim_step("t", model_id, 6, AdamParams(learning_rate=1e-2))
            queued = service.forward_backward("t", model_id, 7, DATA, "cross_entropy", {}, True)
            run = service.run("t", model_id)
            lost_on = run.learner_id
            assert lost_on in rig.hosts
            await rig.lose(lost_on)
        finally:
            gate.set()
        await done(held)
        with pytest.raises(Unavailable, match="restored on learner") as first:
            await done(step)
        with pytest.raises(Unavailable) as second:
            await done(queued)
        assert str(first.value) == str(second.value) and "tinker://" in str(first.value)
        after = await done(service.forward_backward("t", model_id, 8, DATA, "cross_entropy", {}, True))
        np.testing.assert_allclose(after.logprobs[0], at_save[0], atol=0)
        assert run.steps == 1 and run.learner_id != lost_on

    in_process(tmp_path, test)


def test_a_learner_restarted_under_its_id_is_a_lost_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A learner that restarts under the same id between two calls answers that it holds no such run: the run is
    restored from its last save_state as for a learner gone, and the call fails saying so. Every body goes by
    reference here (a tiny inline limit), and each is deleted by its reader."""
    monkeypatch.setattr(learner_link, "INLINE_BYTES", 256)

    async def test(rig: Rig) -> None:
        await rig.host("same")
        service = rig.service
        model_id, at_save = await saved_run(service, service.create_session("t"), 3, "saved")
        await rig.lose("same")
        await rig.host("same")
        with pytest.raises(Unavailable, match=r"holds no training run .* restored on learner same"):
            await done(service.forward_backward("t", model_id, 5, DATA, "cross_entropy", {}, True))
        again = await done(service.forward_backward("t", model_id, 6, DATA, "cross_entropy", {}, True))
        np.testing.assert_allclose(again.logprobs[0], at_save[0], atol=0)
        assert await rig.transport.names(rig.link.namespace) == []

    in_process(tmp_path, test)


def test_a_learner_publishes_its_runs_sampler_versions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With samples on the fleet, `save_weights_and_get_sampling_client` of a learner-held run has the learner
    publish the adapter to the weight store (the service never holds the tensors): the version is the run's
    adapter, versions move forward (the same weights again are the same version), and after a restore on another
    learner the pointer is fenced with the run's higher generation, so the learner it was lost on can no longer
    move it."""

    def never(self: RemoteRun) -> None:
        raise AssertionError("the adapter came to the service")

    async def saved_for_sampler(rig: Rig, model_id: str, seq_id: int) -> SamplerWeights:
        answer = await done(rig.service.save_for_sampler("t", model_id, seq_id, None))
        return rig.service.sampler("t", answer["sampling_session_id"]).weights

    async def test(rig: Rig) -> None:
        await rig.host("p1")
        service = rig.service
        model_id, _ = await saved_run(service, service.create_session("t"), 3, "saved")
        job_id = run_job_id(model_id)
        want = await asyncio.to_thread(service.run("t", model_id).sampler_tensors)  # blocking: not on the loop
        monkeypatch.setattr(RemoteRun, "sampler_tensors", never)
        weights = await saved_for_sampler(rig, model_id, 5)
        assert weights.tensors is None and weights.job_id == job_id and weights.pointer is not None
        assert (weights.pointer.version, weights.pointer.kind, weights.pointer.epoch) == (0, "adapter", 0)
        got = decode_safetensors(await rig.store.pull(job_id, weights.pointer))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k].float()) for k in want)

        await rig.lose("p1")  # restored on p2 from "saved"
        await rig.host("p2")
        with pytest.raises(Unavailable, match="restored on learner p2"):
            await done(service.forward_backward("t", model_id, 6, DATA, "cross_entropy", {}, True))
        pointer = (await saved_for_sampler(rig, model_id, 7)).pointer  # the saved weights: v0's, now fenced
        assert pointer is not None and (pointer.version, pointer.epoch) == (0, 1)
        await done(service.forward_backward("t", model_id, 8, DATA, "cross_entropy", {}, False))
        await done(service.optim_step("t", model_id, 9, AdamParams(learning_rate=1e-2)))
        pointer = (await saved_for_sampler(rig, model_id, 10)).pointer
        assert pointer is not None and (pointer.version, pointer.epoch) == (1, 1)

    in_process(tmp_path, test, fleet=True)


def test_a_run_whose_learner_is_busy_holds_no_other_run(tmp_path: Path) -> None:
    """Each training run's calls run on a lane of their own in the service: with one learner's compute held, a
    call of the run on the other learner is answered meanwhile, and the held one after. (Two hosts of one run
    each: a full learner takes no placement, so the second run goes to the second host.)"""
    busy = concurrent.futures.ThreadPoolExecutor(1)
    gate = threading.Event()

    async def test(rig: Rig) -> None:
        await rig.host("h0", max_runs=1, compute=busy)
        await rig.host("h1", max_runs=1)
        service = rig.service
        session = service.create_session("t")
        models = [(await done(service.create_model("t", session, seq, MODEL, LoraRequest(rank=4, seed=seq))))[
            "model_id"] for seq in range(2)]
        runs = [service.run("t", model_id) for model_id in models]
        assert {run.learner_id for run in runs} == {"h0", "h1"}
        held = next(i for i, run in enumerate(runs) if run.learner_id == "h0")
        busy.submit(gate.wait)  # h0's compute thread is busy (a long step of its job, say)
        waiting = service.forward_backward("t", models[held], 1, DATA, "cross_entropy", {}, True)
        free = service.forward_backward("t", models[1 - held], 1, DATA, "cross_entropy", {}, True)
        await asyncio.wait_for(done(free), 30)
        assert not waiting.future.done()
        gate.set()
        await asyncio.wait_for(done(waiting), 30)
        assert rig.log.lanes() == 2
        service.finish_session("t", session)
        assert rig.log.lanes() == 0

    try:
        in_process(tmp_path, test)
    finally:
        gate.set()
        busy.shutdown()


def _wire(tokens: list[int]) -> dict[str, Any]:
    return {"tokens": torch.tensor(tokens[:-1]), "inputs": {"target_tokens": torch.tensor(tokens[1:])}}
