"""sft jobs at the gateway: demonstrations checked at submission (every bad line named, then conversations
too long for the job's limit, measured with the model's own chat template), and the warm start: an sft job
trained by a real learner, then an RL job of the same tenant submitted with `model = "job:<sft job>"`, which
the gateway resolves to the sft job's export and a real learner starts from (its version 0 is the sft
result). Another tenant cannot name the job, a job that has not succeeded cannot be named, and the sft job
cannot be deleted while the RL job needs it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from fleetrl.errors import ConfigError, FailedPrecondition
from fleetrl.jobs.store import JobStore
from fleetrl.policy import models
from fleetrl.replay.client import ReplayClient
from fleetrl.sdk.client import Client
from fleetrl.services.learner.service import serve
from fleetrl.spec.config import JobSpec
from fleetrl.tasks import bus
from fleetrl.tasks.feeder import task_ids_in_order
from fleetrl.train.settings import LearnerSettings
from fleetrl.weights.store import WeightStore, decode_safetensors
from tests.gateway.conftest import TOKENS, Infra
from tests.learner.learner_fleet import demonstrations_jsonl, make_group, prompts_jsonl, replay_service

SFT: dict[str, Any] = {"name": "warm", "model": "tiny-llama", "prompts": "demos.jsonl", "algorithm": {"name": "sft"},
                       "optim": {"learning_rate": 2e-2}, "sft": {"conversations_per_step": 4, "max_seq_tokens": 256},
                       "train": {"max_steps": 4, "checkpoint_interval": 4, "weights_dtype": "float32"}}
LORA_SFT = {**SFT, "train": {**SFT["train"], "lora": {"rank": 4, "alpha": 8}}}
RL: dict[str, Any] = {"name": "rl", "prompts": "p.jsonl", "reward": {"builtin": "numeric_match"},
                      "rollout": {"prompts_per_step": 2, "samples_per_prompt": 3, "max_new_tokens": 8},
                      "train": {"max_steps": 1, "weights_dtype": "float32", "timeout_per_step_s": 60}}
GOOD = json.dumps({"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]})


def refused(client: Client, spec: dict[str, Any], data: bytes) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        client.submit(json.dumps(spec), data, spec_format="json")
    return {v.field: v.description for v in caught.value.violations}


def test_demonstrations_are_checked_line_by_line_then_through_the_chat_template(
        client_for: Callable[..., Client]) -> None:
    alice = client_for("alice")
    violations = refused(alice, SFT, "\n".join([GOOD, "{oops", '{"messages": [{"role": "user", "content": "a"}]}',
                                                GOOD]).encode())
    assert list(violations) == ["prompts[line 2]", "prompts[line 3].messages"], violations
    assert "not JSON" in violations["prompts[line 2]"] and "no assistant" in violations["prompts[line 3].messages"]
    long = json.dumps({"messages": [{"role": "user", "content": "word " * 300},
                                    {"role": "assistant", "content": "ok"}]})
    violations = refused(alice, SFT, f"{GOOD}\n{long}\n".encode())
    assert violations == {"prompts[line 2]": "333 tokens through the chat template, more than sft.max_seq_tokens "
                                             "(256)"}
    assert "the demonstrations file is empty" in refused(alice, SFT, b"")["prompts"]
    job = alice.submit(json.dumps(SFT), f"{GOOD}\n".encode(), spec_format="json")
    assert job.state == "queued" and job.spec["algorithm"]["name"] == "sft" and job.spec["reward"] is None


def learner(nats_url: str, redis_url: str, run_dir: Path, replay_addr: str = "127.0.0.1:1") -> LearnerSettings:
    return LearnerSettings(nats_url=nats_url, redis_url=redis_url, replay_addr=replay_addr, run_dir=run_dir,
                           listen="127.0.0.1:0", lease_s=3, sample_wait_s=0.5, learner_id="L1")


async def test_an_rl_job_starts_from_its_tenants_sft_job(infra: Infra, nats_url: str, redis_url: str,
                                                         tmp_path: Path) -> None:
    """The sft job (LoRA: the RL job starts from its merged model) is put in the store as the gateway would
    (its submission path is the test above), on a Valkey of its own, so the learner here claims no other
    test's job."""
    run_dir = tmp_path / "run"
    jobs = JobStore.from_url(redis_url)
    sft = await jobs.create("alice", JobSpec.model_validate(LORA_SFT), demonstrations_jsonl(8), None)
    await jobs.close()
    gateway = infra.gateway("sft-warm-start", f'run_dir = "{run_dir}"', redis_url=redis_url, nats_url=nats_url)
    gateway.start()
    alice, bob = (Client(gateway.address, token=TOKENS[t]) for t in ("alice", "bob"))
    try:
        warm = {**RL, "model": f"job:{sft.job_id}"}
        assert "only a succeeded job has a model" in refused(alice, warm, prompts_jsonl(4))["model"]
        await asyncio.wait_for(serve(learner(nats_url, redis_url, run_dir), asyncio.Event(), once=True), 120)
        exported = alice.get_job(sft.job_id)
        assert exported.state == "succeeded", exported.reason
        assert (Path(exported.model_uri).parent / "adapter").is_dir()
        assert "does not exist" in refused(bob, warm, prompts_jsonl(4))["model"]
        assert "does not exist" in refused(alice, {**warm, "model": "job:j-000000000000"}, prompts_jsonl(4))["model"]
        rl = alice.submit(json.dumps(warm), prompts_jsonl(4), spec_format="json")
        assert rl.spec["model"] == exported.model_uri and Path(rl.spec["model"]).is_relative_to(run_dir)
        with pytest.raises(FailedPrecondition, match=f"starts from job {sft.job_id}'s model"):
            alice.delete_job(sft.job_id)
        first_version = await train_rl(nats_url, redis_url, run_dir, rl.job_id)
        assert alice.get_job(rl.job_id).state == "succeeded", alice.get_job(rl.job_id).reason
    finally:
        alice.close()
        bob.close()
        gateway.stop()
    sft_weights = models.state_dict_for_publish(AutoModelForCausalLM.from_pretrained(exported.model_uri), "float32")
    base_weights = models.state_dict_for_publish(models.load("tiny-llama")[0], "float32")
    assert first_version.keys() == sft_weights.keys()
    assert all(torch.equal(first_version[k], sft_weights[k]) for k in sft_weights)
    assert not all(torch.equal(base_weights[k], sft_weights[k]) for k in sft_weights)


async def train_rl(nats_url: str, redis_url: str, run_dir: Path, job_id: str) -> dict[str, torch.Tensor]:
    """Run the RL job's learner: once it has published version 0, hand it groups (as actors would) for its
    one step; returns version 0's weights."""
    jobs = JobStore.from_url(redis_url)
    record = await jobs.get(job_id)
    await jobs.close()
    nc = await bus.connect(nats_url, "test")
    store = WeightStore(nc, bus.jetstream(nc))
    async with replay_service(redis_url) as addr:
        running = asyncio.create_task(serve(learner(nats_url, redis_url, run_dir, addr), asyncio.Event(), once=True))
        while (pointer := await store.latest(job_id)) is None:
            assert not running.done()
            await asyncio.sleep(0.05)
        version_0 = decode_safetensors(await store.pull(job_id, pointer))
        async with ReplayClient(addr) as replay:
            await replay.insert([make_group(job_id, task, 0, record.spec.rollout.samples_per_prompt)
                                 for task in task_ids_in_order(4, record.spec.seed, 2)])
        await asyncio.wait_for(running, 120)
    await nc.close()
    assert pointer.version == 0
    return version_0
