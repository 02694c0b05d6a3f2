"""sft jobs through the real learner (real NATS, Valkey, tiny-llama): trained on the demonstrations'
assistant tokens only, their loss on the demonstrations falls, the result is exported and published
like any job's, and a learner that dies mid-job is resumed from its checkpoint to the same losses."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from learner_fleet import demonstrations_jsonl, learner_process, sft_spec
from transformers import AutoModelForCausalLM

from fleetrl.jobs.store import JobState, JobStore
from fleetrl.launcher.embedded import EmbeddedNats, EmbeddedValkey
from fleetrl.policy import models
from fleetrl.policy.chat_mask import MaskedTokens, tokenized_or_raise
from fleetrl.services.learner.service import serve
from fleetrl.spec.demonstrations import read_demonstrations
from fleetrl.tasks import bus
from fleetrl.train import checkpoint as ckpt
from fleetrl.train.settings import LearnerSettings
from fleetrl.weights.channel import WeightChannel
from fleetrl.weights.filesystem import FilesystemTransport
from fleetrl.weights.store import WeightStore, decode_safetensors

DEMOS = 8
STEPS, PER_STEP = 6, 4
SPEC = sft_spec(max_steps=STEPS, checkpoint_interval=2, keep_checkpoints=3)
DATA = demonstrations_jsonl(DEMOS)


def settings(nats_url: str, redis_url: str, run_dir: Path, learner_id: str = "L1", **more: Any) -> LearnerSettings:
    """No replay service: an sft job never calls one."""
    return LearnerSettings(nats_url=nats_url, redis_url=redis_url, replay_addr="127.0.0.1:1", run_dir=run_dir,
                           listen="127.0.0.1:0", lease_s=3, learner_id=learner_id, **more)


def metrics(run_dir: Path, job_id: str) -> list[dict[str, Any]]:
    path = run_dir / "jobs" / job_id / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assistant_nll(model: torch.nn.Module, conversations: list[MaskedTokens]) -> float:
    """Mean negative log-likelihood of the conversations' assistant tokens under `model` (a plain forward)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for tokens in conversations:
            ids = torch.tensor([tokens.token_ids])
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            picked = logprobs.gather(-1, ids[0, 1:, None])[:, 0]
            trained = torch.tensor(tokens.mask[1:])
            total -= float(picked[trained].sum())
            count += int(trained.sum())
    return total / count


@dataclass(frozen=True)
class Trained:
    """An sft job run uninterrupted to its end, and the NATS, Valkey and run directory it ran on."""

    nats_url: str
    redis_url: str
    run_dir: Path
    job_id: str


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trained]:
    tmp = tmp_path_factory.mktemp("sft")
    with EmbeddedNats(data_dir=tmp / "nats") as nats, EmbeddedValkey(data_dir=tmp / "valkey") as valkey:
        async def run() -> str:
            jobs = JobStore.from_url(valkey.url)
            record = await jobs.create("tenant", SPEC, DATA, None)
            await jobs.close()
            await asyncio.wait_for(serve(settings(nats.url, valkey.url, tmp / "run"), asyncio.Event(), once=True), 120)
            return record.job_id

        yield Trained(nats.url, valkey.url, tmp / "run", asyncio.run(run()))


async def test_an_sft_job_trains_the_assistant_tokens_exports_and_publishes(trained: Trained) -> None:
    jobs = JobStore.from_url(trained.redis_url)
    done = await jobs.get(trained.job_id)
    await jobs.close()
    assert done.state == JobState.SUCCEEDED, done.reason
    lines = metrics(trained.run_dir, trained.job_id)
    assert [x["step"] for x in lines] == list(range(1, STEPS + 1))
    assert lines[-1]["epoch"] == STEPS * PER_STEP / DEMOS
    for epoch in range(STEPS * PER_STEP // DEMOS):  # every conversation once an epoch, in a new order
        ids = [t for x in lines[2 * epoch : 2 * epoch + 2] for t in x["task_ids"]]
        assert sorted(ids) == sorted(f"{epoch}/{i}" for i in range(DEMOS))
    base, tokenizer = models.load("tiny-llama")
    conversations = tokenized_or_raise(tokenizer, read_demonstrations(DATA), 256)
    for line in lines:  # the loss counts the assistant's tokens, nothing else
        assert line["tokens"] == sum(sum(conversations[int(t.split("/")[1])].mask) for t in line["task_ids"])
    assert lines[-1]["loss"] < 0.5 * lines[0]["loss"], [x["loss"] for x in lines]
    exported = AutoModelForCausalLM.from_pretrained(done.model_uri)
    before, after = assistant_nll(base, conversations), assistant_nll(exported, conversations)
    print(f"sft: mean NLL of the demonstrations' assistant tokens {before:.3f} -> {after:.3f}; per step "
          f"{[round(x['loss'], 3) for x in lines]}")
    assert after < 0.5 * before
    nc = await bus.connect(trained.nats_url, "test")
    store = WeightStore(nc, bus.jetstream(nc))
    pointer = await store.latest(trained.job_id)
    assert pointer is not None and pointer.version == STEPS
    published = decode_safetensors(await store.pull(trained.job_id, pointer))
    await nc.close()
    expected = models.state_dict_for_publish(exported, "float32")
    assert published.keys() == expected.keys() and all(torch.equal(published[k], expected[k]) for k in expected)


async def test_a_learner_killed_mid_sft_job_resumes_to_the_same_losses(trained: Trained) -> None:
    """Job B, the same spec and data as the uninterrupted one, has its learner process SIGKILLed after step 3
    and a second learner resumes it from its last complete checkpoint: the same steps, conversations and
    losses, each step reported once (the killed process ran as many torch threads as this one)."""
    jobs = JobStore.from_url(trained.redis_url)
    b = await jobs.create("tenant", SPEC, DATA, None)
    run_dir, log = trained.run_dir, trained.run_dir / "learner.log"
    first = learner_process(trained.nats_url, trained.redis_url, "127.0.0.1:1", run_dir, log,
                            FLEETRL_LEARNER_TORCH_THREADS=str(torch.get_num_threads()))
    while len(metrics(run_dir, b.job_id)) < 3:
        assert first.poll() is None, log.read_text()
        await asyncio.sleep(0.01)
    first.send_signal(signal.SIGKILL)
    first.wait()
    holder = await jobs.lease_holder(b.job_id)
    assert holder is not None
    await jobs.release(b.job_id, holder)  # its lease lapses now, not lease_s later
    resumed_from = ckpt.complete_steps(ckpt.checkpoint_root(run_dir, b.job_id))[-1]
    assert 2 <= resumed_from < STEPS
    await asyncio.wait_for(serve(settings(trained.nats_url, trained.redis_url, run_dir, "L2"), asyncio.Event(),
                                 once=True), 120)
    done = await jobs.get(b.job_id)
    await jobs.close()
    assert done.state == JobState.SUCCEEDED, done.reason
    la, lb = metrics(run_dir, trained.job_id), metrics(run_dir, b.job_id)
    assert [x["step"] for x in lb] == list(range(1, STEPS + 1))
    assert [x["task_ids"] for x in lb] == [x["task_ids"] for x in la]
    assert [x["loss"] for x in lb] == [x["loss"] for x in la]


async def test_a_learner_with_a_weights_dir_publishes_there(trained: Trained, tmp_path: Path) -> None:
    """With `weights_dir` set the learner publishes a job's weights as files there (`FilesystemTransport`)
    instead of to NATS: the last version pulled from the directory is the exported model."""
    jobs = JobStore.from_url(trained.redis_url)
    record = await jobs.create("tenant", SPEC, DATA, None)
    weights_dir = tmp_path / "weights"
    await asyncio.wait_for(serve(settings(trained.nats_url, trained.redis_url, trained.run_dir, "L3",
                                          weights_dir=weights_dir), asyncio.Event(), once=True), 120)
    done = await jobs.get(record.job_id)
    await jobs.close()
    assert done.state == JobState.SUCCEEDED, done.reason
    channel = WeightChannel(FilesystemTransport(weights_dir))
    pointer = await channel.latest(record.job_id)
    assert pointer is not None and pointer.version == STEPS
    published = decode_safetensors(await channel.pull(record.job_id, pointer))
    expected = models.state_dict_for_publish(AutoModelForCausalLM.from_pretrained(done.model_uri), "float32")
    assert published.keys() == expected.keys() and all(torch.equal(published[k], expected[k]) for k in expected)
    nc = await bus.connect(trained.nats_url, "test")
    assert await WeightStore(nc, bus.jetstream(nc)).latest(record.job_id) is None
    await nc.close()
