"""The learner service end to end in one process: real NATS, Valkey and replay service, tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import nats.errors
import torch
from learner_fleet import create_job, insert_groups, make_group, replay_service, spec_for
from nats.js import JetStreamContext
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from fleetrl.jobs.store import JobRecord, JobState, JobStore
from fleetrl.policy import models
from fleetrl.proto.fleetrl.v1 import common_pb2, learner_pb2, learner_pb2_grpc
from fleetrl.replay.client import ReplayClient
from fleetrl.services.learner.service import serve
from fleetrl.spec.config import LoraSpec
from fleetrl.tasks import bus
from fleetrl.tasks.feeder import in_flight_limit, task_ids_in_order
from fleetrl.train import checkpoint as ckpt
from fleetrl.train.settings import LearnerSettings
from fleetrl.weights import adapters as lora_weights
from fleetrl.weights.store import WeightStore, decode_safetensors, encode_safetensors


def settings(nats_url: str, redis_url: str, replay_addr: str, run_dir: Path) -> LearnerSettings:
    return LearnerSettings(nats_url=nats_url, redis_url=redis_url, replay_addr=replay_addr, run_dir=run_dir,
                           listen="127.0.0.1:0", lease_s=3, sample_wait_s=0.5, learner_id="L1")


async def test_job_runs_to_export(nats_url: str, redis_url: str, tmp_path: Path) -> None:
    """4 steps, no actors (the groups are inserted up front); weights every 3 steps and at the end."""
    jobs = JobStore.from_url(redis_url)
    spec = spec_for(max_steps=4, checkpoint_interval=2, keep_checkpoints=1, publish_interval=3, keep_weight_versions=10)
    record = await create_job(jobs, spec)
    async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
        ids = await insert_groups(replay, record, 10)
        await asyncio.wait_for(serve(settings(nats_url, redis_url, addr, tmp_path), asyncio.Event(), once=True), 120)
        stats = await replay.stats(record.job_id)
    done = await jobs.get(record.job_id)
    assert done.state == JobState.SUCCEEDED, done.reason
    lines = [json.loads(x) for x in (tmp_path / "jobs" / record.job_id / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert [t for x in lines for t in x["task_ids"]] == ids[:8]  # fifo order, each group once
    for key in ("loss", "reward_mean", "reward_std", "kl", "entropy", "clip_frac", "staleness_mean", "staleness_max",
                "tokens_per_s", "stale_dropped", "mismatch_logprob_abs_diff", "mismatch_k3_kl", "offpolicy_masked_frac",
                "offpolicy_masked_seq_frac"):
        assert key in lines[0], key
    assert stats.committed == 8 and stats.size_groups == 2 and stats.leased_groups == 0
    assert len(await jobs.steps(record.job_id)) == 4
    assert ckpt.complete_steps(ckpt.checkpoint_root(tmp_path, record.job_id)) == [4]
    model = AutoModelForCausalLM.from_pretrained(done.model_uri)
    AutoTokenizer.from_pretrained(done.model_uri)
    assert model.config.hidden_size == 64
    nc = await bus.connect(nats_url, "test")
    js = bus.jetstream(nc)
    pointer = await WeightStore(nc, js).latest(record.job_id)
    objects = await (await js.object_store(bus.weights_bucket(record.job_id))).list(ignore_deletes=True)
    info = await js.stream_info(bus.TASKS_STREAM)
    await nc.close()
    await jobs.close()
    assert pointer is not None and pointer.version == 4
    assert sorted(o.name for o in objects) == ["v0", "v3", "v4"]  # set-up, publish_interval 3, the last step
    # No actor takes a task, so the stream holds every task the feeder published. The 8 trained groups
    # settled 8 of them; the others are in flight at the end: exactly the bound, not one more.
    assert info.state.messages - 8 == in_flight_limit(2, spec.train.max_staleness) == 102


async def test_delta_job_publishes_chains_that_rebuild_the_exported_weights(
        nats_url: str, redis_url: str, tmp_path: Path) -> None:
    """full_publish_interval 3: v0 full, d1, d2, v3 full, d4; a reader starting from nothing rebuilds
    v4 bit for bit as the exported model's bf16 payload, the learner's own full publish."""
    jobs = JobStore.from_url(redis_url)
    spec = spec_for(max_steps=4, checkpoint_interval=4, weights_dtype="bfloat16", full_publish_interval=3,
                    keep_weight_versions=2)
    record = await create_job(jobs, spec)
    async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
        await insert_groups(replay, record, 8)
        await asyncio.wait_for(serve(settings(nats_url, redis_url, addr, tmp_path), asyncio.Event(), once=True), 120)
    done = await jobs.get(record.job_id)
    await jobs.close()
    assert done.state == JobState.SUCCEEDED, done.reason
    nc = await bus.connect(nats_url, "test")
    js = bus.jetstream(nc)
    store = WeightStore(nc, js)
    pointer = await store.latest(record.job_id)
    assert pointer is not None and pointer.version == 4 and pointer.chain == (3, 4)
    objects = await (await js.object_store(bus.weights_bucket(record.job_id))).list(ignore_deletes=True)
    assert sorted(o.name for o in objects) == ["d1", "d2", "d4", "v0", "v3"]
    rebuilt = await store.pull(record.job_id, pointer)
    await nc.close()
    exported = AutoModelForCausalLM.from_pretrained(done.model_uri)
    assert bytes(rebuilt) == encode_safetensors(models.state_dict_for_publish(exported, "bfloat16"))


async def test_lora_job_trains_and_publishes_adapters_only(nats_url: str, redis_url: str, tmp_path: Path) -> None:
    """train.lora: AdamW state and checkpoints hold the adapters only; the KL reference is the frozen
    base (KL exactly 0 at step 1, where B = 0); every published version is the adapter tensors only
    (pointer kind "adapter" on the job's model), equal to the exported adapter directory's
    (weights_dtype float32 here); the base with them applied is the exported merged model, and layers
    without adapters keep the base's weights."""
    jobs = JobStore.from_url(redis_url)
    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    spec = spec_for(max_steps=3, checkpoint_interval=3, lora=lora, algorithm={"kl_coef": 0.1})
    record = await create_job(jobs, spec)
    async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
        await insert_groups(replay, record, 6)
        await asyncio.wait_for(serve(settings(nats_url, redis_url, addr, tmp_path), asyncio.Event(), once=True), 120)
    done = await jobs.get(record.job_id)
    await jobs.close()
    assert done.state == JobState.SUCCEEDED, done.reason
    lines = [json.loads(x) for x in (tmp_path / "jobs" / record.job_id / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["kl"] == 0.0 and lines[-1]["kl"] > 0.0
    saved = ckpt.load(ckpt.checkpoint_root(tmp_path, record.job_id), 3)
    assert saved.model and all(".lora_A." in k or ".lora_B." in k for k in saved.model)
    assert len(saved.model) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    assert len(saved.optimizer["state"]) == len(saved.model)  # AdamW moments for the adapters only
    nc = await bus.connect(nats_url, "test")
    store = WeightStore(nc, bus.jetstream(nc))
    pointer = await store.latest(record.job_id)
    assert pointer is not None and pointer.version == 3
    assert (pointer.kind, pointer.base, pointer.object_name) == ("adapter", "tiny-llama", "v3")
    published = decode_safetensors(await store.pull(record.job_id, pointer))
    await nc.close()
    adapter_dir = tmp_path / "jobs" / record.job_id / "adapter"
    exported_adapter = load_file(adapter_dir / "adapter_model.safetensors")
    assert published.keys() == exported_adapter.keys() and len(published) == 8
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in published)
    for name, tensor in published.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, exported_adapter[name])
    assert pointer.size_bytes == len(encode_safetensors(published))  # nothing else travels
    base, _ = models.load("tiny-llama")
    base_state = models.state_dict_for_publish(base, "float32")
    lora_weights.MergedAdapter(base, LoraSpec.model_validate(lora)).apply(published)  # as an actor does
    applied = models.state_dict_for_publish(base, "float32")
    exported = models.state_dict_for_publish(AutoModelForCausalLM.from_pretrained(done.model_uri), "float32")
    assert applied.keys() == exported.keys() == base_state.keys()
    for name, tensor in applied.items():
        assert torch.allclose(tensor, exported[name], atol=1e-6), name
        adapted = name.endswith(("q_proj.weight", "v_proj.weight"))
        assert torch.equal(exported[name], base_state[name]) != adapted, name
    # the adapter directory: PEFT loads it on the base
    peft_model = PeftModel.from_pretrained(models.load("tiny-llama")[0], str(adapter_dir))
    merged = models.state_dict_for_publish(peft_model.merge_and_unload(), "float32")
    assert all(torch.allclose(exported[name], merged[name], atol=1e-6) for name in exported)


async def test_step_metrics_count_the_time_the_learner_waited_for_groups(nats_url: str, redis_url: str,
                                                                          tmp_path: Path) -> None:
    """`wait_for_data_s` (what bench.pipeline's learner idle fraction sums): step 1's groups are there from the
    start, step 2's are inserted 2 s after step 1 is reported, so step 2 waited at least about that long."""
    jobs = JobStore.from_url(redis_url)
    record = await create_job(jobs, spec_for(max_steps=2, max_staleness=1, checkpoint_interval=2))
    async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
        await insert_groups(replay, record, 2)
        learner = asyncio.create_task(serve(settings(nats_url, redis_url, addr, tmp_path), asyncio.Event(), once=True))
        deadline = asyncio.get_running_loop().time() + 120
        while not await jobs.steps(record.job_id):
            assert asyncio.get_running_loop().time() < deadline and not learner.done(), "step 1 never reported"
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.0)
        await insert_groups(replay, record, 4, skip=2)
        await asyncio.wait_for(learner, 120)
    await jobs.close()
    lines = [json.loads(x) for x in (tmp_path / "jobs" / record.job_id / "metrics.jsonl").read_text().splitlines()]
    first, second = (line["wait_for_data_s"] for line in lines)
    assert second >= 1.5 and first < second, (first, second)


async def test_staleness_drops_old_groups(nats_url: str, redis_url: str, tmp_path: Path) -> None:
    """max_staleness 0: a group of version 0 cannot be trained at step 2 (learner at version 1)."""
    jobs = JobStore.from_url(redis_url)
    record = await create_job(jobs, spec_for(max_steps=2, max_staleness=0, timeout_per_step_s=3, checkpoint_interval=1))
    async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
        await insert_groups(replay, record, 4)
        await asyncio.wait_for(serve(settings(nats_url, redis_url, addr, tmp_path), asyncio.Event(), once=True), 120)
        stats = await replay.stats(record.job_id)
    done = await jobs.get(record.job_id)
    await jobs.close()
    assert done.state == JobState.FAILED and "timeout_per_step_s" in done.reason
    assert stats.committed == 2 and stats.stale_dropped == 2  # step 1 trained 2, step 2 dropped the rest


async def test_leases_outlive_their_timeout_until_the_checkpoint_commits_them(
        nats_url: str, redis_url: str, tmp_path: Path) -> None:
    """lease_timeout_s 1 s, and a checkpoint that takes 2 s before it commits: the learner renews its
    leases, so none expires and every group is committed by the step that trained it."""
    jobs = JobStore.from_url(redis_url)
    record = await create_job(jobs, spec_for(max_steps=4, checkpoint_interval=2, replay={"lease_timeout_s": 1.0}))
    slow = settings(nats_url, redis_url, "", tmp_path).model_copy(update={"checkpoint_delay_s": 2.0})
    async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
        ids = await insert_groups(replay, record, 8)
        slow.replay_addr = addr
        await asyncio.wait_for(serve(slow, asyncio.Event(), once=True), 120)
        stats = await replay.stats(record.job_id)
    done = await jobs.get(record.job_id)
    await jobs.close()
    assert done.state == JobState.SUCCEEDED, done.reason
    lines = [json.loads(x) for x in (tmp_path / "jobs" / record.job_id / "metrics.jsonl").read_text().splitlines()]
    assert [t for x in lines for t in x["task_ids"]] == ids
    assert (stats.committed, stats.expired_leases, stats.size_groups, stats.leased_groups) == (8, 0, 0, 0)


async def test_cancel_ends_a_step_that_waits_for_data(nats_url: str, redis_url: str, tmp_path: Path) -> None:
    """No actors: step 2 waits for groups that never come. A cancel ends the wait within a few
    sample waits (not after timeout_per_step_s), purges the job's queued tasks, and the job stays
    CANCELLED."""
    jobs = JobStore.from_url(redis_url)
    record = await create_job(jobs, spec_for(max_steps=4, timeout_per_step_s=600))
    async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
        await insert_groups(replay, record, 2)
        learner = asyncio.create_task(serve(settings(nats_url, redis_url, addr, tmp_path), asyncio.Event(), once=True))
        while not (await jobs.steps(record.job_id)):
            assert not learner.done(), (await jobs.get(record.job_id)).reason
            await asyncio.sleep(0.2)
        await jobs.set_state(record.job_id, JobState.CANCELLED, "test")
        cancelled_at = asyncio.get_running_loop().time()
        await asyncio.wait_for(learner, 30)
        waited = asyncio.get_running_loop().time() - cancelled_at
    done = await jobs.get(record.job_id)
    await jobs.close()
    nc = await bus.connect(nats_url, "test")
    queued = await bus.task_queue(bus.jetstream(nc), record.job_id)
    await nc.close()
    assert done.state == JobState.CANCELLED and done.reason == "test"
    assert waited < 10, f"the learner took {waited:.1f}s to notice the cancel"
    assert queued.pending == 0


TaskHandler = Callable[[common_pb2.Task, bytes, JetStreamContext, ReplayClient], Awaitable[None]]


async def fake_actor(nats_url: str, replay_addr: str, record: JobRecord, stop: asyncio.Event,
                     handle: TaskHandler) -> None:
    """An actor stand-in: pulls the job's tasks until `stop`, hands each to `handle` (the task, its raw
    message data, JetStream and a replay client), then acks it."""
    nc = await bus.connect(nats_url, "fake-actor")
    js = bus.jetstream(nc)
    await bus.ensure_streams(js)
    await bus.ensure_job_consumer(js, record.job_id, record.spec)
    sub = await js.pull_subscribe_bind(durable=bus.task_consumer(record.job_id), stream=bus.TASKS_STREAM)
    async with ReplayClient(replay_addr) as replay:
        while not stop.is_set():
            try:
                msgs = await sub.fetch(1, timeout=0.3)
            except nats.errors.TimeoutError:
                continue
            await handle(common_pb2.Task.FromString(msgs[0].data), msgs[0].data, js, replay)
            await msgs[0].ack()
    await nc.close()


async def take_tasks(nats_url: str, replay_addr: str, record: JobRecord, poison: str, stop: asyncio.Event) -> None:
    """A synthetic group for each task, except `poison`, which goes to the dead-letter subject (as an actor
    does after max_retries_per_episode failed deliveries)."""
    async def handle(task: common_pb2.Task, raw: bytes, js: JetStreamContext, replay: ReplayClient) -> None:
        if task.task_id == poison:
            await js.publish(bus.dlq_subject(record.job_id), raw,
                             headers={"Nats-Msg-Id": f"dlq/{record.job_id}/{poison}"})
        else:
            await replay.insert([make_group(record.job_id, task.task_id, int(task.min_policy_version),
                                            record.spec.rollout.samples_per_prompt)])
    await fake_actor(nats_url, replay_addr, record, stop, handle)


async def test_a_dead_lettered_task_is_replaced(nats_url: str, redis_url: str, tmp_path: Path) -> None:
    """max_staleness 0: two tasks in flight for a step of two groups. One is dead-lettered; the feeder must
    count it settled and publish a replacement, or the step waits for a group that never comes."""
    jobs = JobStore.from_url(redis_url)
    record = await create_job(jobs, spec_for(max_steps=2, max_staleness=0, timeout_per_step_s=20))
    poison = task_ids_in_order(16, record.spec.seed, 1)[0]
    stop = asyncio.Event()
    async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
        actor = asyncio.create_task(take_tasks(nats_url, addr, record, poison, stop))
        await asyncio.wait_for(serve(settings(nats_url, redis_url, addr, tmp_path), asyncio.Event(), once=True), 120)
        stop.set()
        await actor
        stats = await replay.stats(record.job_id)
    done = await jobs.get(record.job_id)
    await jobs.close()
    assert done.state == JobState.SUCCEEDED, done.reason
    lines = [json.loads(x) for x in (tmp_path / "jobs" / record.job_id / "metrics.jsonl").read_text().splitlines()]
    trained = [t for x in lines for t in x["task_ids"]]
    assert len(trained) == len(set(trained)) == 4 and poison not in trained
    assert stats.committed == 4


async def hand_in(nats_url: str, replay_addr: str, record: JobRecord, honest: asyncio.Event,
                  stop: asyncio.Event) -> None:
    """A group of version 0 for every task until `honest` is set (an actor stuck on old weights: past
    step 1 its groups are dropped as stale), then of the task's version."""
    async def handle(task: common_pb2.Task, raw: bytes, js: JetStreamContext, replay: ReplayClient) -> None:
        version = int(task.min_policy_version) if honest.is_set() else 0
        await replay.insert([make_group(record.job_id, task.task_id, version, record.spec.rollout.samples_per_prompt)])
    await fake_actor(nats_url, replay_addr, record, stop, handle)


async def test_a_resumed_learner_settles_the_stale_drops_it_never_saw(
        nats_url: str, redis_url: str, tmp_path: Path) -> None:
    """max_staleness 0, no checkpoint before the end. The first learner trains step 1; then every group is
    handed in stale and dropped, and the learner dies (its task cancelled). The second resumes from
    nothing: the tasks the first published after step 1 are deduplicated when it publishes them again and
    their groups are gone, so only replay's stale count can settle them. Before, they filled the in-flight
    bound and the resumed job's step 2 waited for them until timeout_per_step_s."""
    jobs = JobStore.from_url(redis_url)
    record = await create_job(jobs, spec_for(max_steps=3, max_staleness=0, checkpoint_interval=100,
                                             timeout_per_step_s=20))
    honest, stop = asyncio.Event(), asyncio.Event()
    async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
        await replay.configure(record.job_id, record.spec.replay)
        actor = asyncio.create_task(hand_in(nats_url, addr, record, honest, stop))
        first = asyncio.create_task(serve(settings(nats_url, redis_url, addr, tmp_path), asyncio.Event(), once=True))
        while (await replay.stats(record.job_id)).stale_dropped < 4:
            assert not first.done(), (await jobs.get(record.job_id)).reason
            await asyncio.sleep(0.2)
        first.cancel()  # a learner process killed: no checkpoint, its lease and replay leases lapse
        with contextlib.suppress(asyncio.CancelledError):
            await first
        dropped_by_first = (await replay.stats(record.job_id)).stale_dropped
        honest.set()
        second = settings(nats_url, redis_url, addr, tmp_path).model_copy(update={"learner_id": "L2"})
        await asyncio.wait_for(serve(second, asyncio.Event(), once=True), 120)
        stop.set()
        await actor
    done = await jobs.get(record.job_id)
    await jobs.close()
    assert done.state == JobState.SUCCEEDED, done.reason
    lines = [json.loads(x) for x in (tmp_path / "jobs" / record.job_id / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3] and dropped_by_first >= 4


async def test_get_status(redis_url: str, tmp_path: Path) -> None:
    from fleetrl.services.learner import server
    from fleetrl.train.status import StatusBoard

    board = StatusBoard("L9")
    srv, port, _health = await server.start(board, "127.0.0.1:0")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = learner_pb2_grpc.LearnerServiceStub(channel)
        try:
            await stub.GetStatus(learner_pb2.LearnerStatusRequest(), timeout=5)
            raise AssertionError("expected NOT_FOUND")
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.NOT_FOUND
        first = board.start_job("j-1")
        first.step, first.phase = 3, "training"
        second = board.start_job("j-2")  # a learner running two jobs at once (max_jobs 2)
        second.step = 1
        status = await stub.GetStatus(learner_pb2.LearnerStatusRequest(job_id="j-1"), timeout=5)
        newest = await stub.GetStatus(learner_pb2.LearnerStatusRequest(), timeout=5)
        board.end_job("j-1")
        ended = await stub.GetStatus(learner_pb2.LearnerStatusRequest(job_id="j-1"), timeout=5)
    await srv.stop(0)
    assert status.step == 3 and status.phase == "training" and status.learner_id == "L9"
    assert (newest.job_id, newest.step) == ("j-2", 1) and ended.step == 3 and board.running == {"j-2"}
