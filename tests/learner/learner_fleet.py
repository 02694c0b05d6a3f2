"""Test helpers of the learner tests: a real replay service, jobs in a real Redis, synthetic groups,
and a tiny word-level policy with a reward it can learn.

Groups are made here rather than by actors so a test controls exactly which groups exist and in
which fifo order; the learner under test cannot tell the difference.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from fleetrl.jobs.store import JobRecord, JobStore
from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.replay.client import ReplayClient
from fleetrl.services.replay.config import ReplaySettings
from fleetrl.services.replay.server import running
from fleetrl.spec.config import JobSpec
from fleetrl.tasks.feeder import task_ids_in_order

REPO = Path(__file__).resolve().parents[2]
WORDS = ["<pad>", "<eos>", "<unk>", *"0123456789", "+", "="]
"""The vocabulary of `tiny_policy`: enough for "a + b =" prompts and one-digit answers."""


def prompts_jsonl(n: int) -> bytes:
    return "".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                   for i in range(n)).encode()


def tiny_policy() -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A 15-token word-level tokenizer and a 2-layer, 32-wide Llama over it (the same weights every call)."""
    core = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=1, pad_token_id=0, bos_token_id=None)
    return LlamaForCausalLM(config).eval(), tokenizer


def first_word_is_seven(completion: str, prompt: str, **_: Any) -> float:
    """A reward `tiny_policy` learns in about ten steps: 1.0 when the completion starts with the word 7."""
    words = completion.split()
    return float(bool(words) and words[0] == "7")


def spec_for(**train: Any) -> JobSpec:
    """A tiny job: `train` fields as keywords, plus `replay={...}` and `algorithm={...}` sections."""
    replay, algorithm = train.pop("replay", {}), train.pop("algorithm", {})
    rollout = {"prompts_per_step": 2, "samples_per_prompt": 3, "max_new_tokens": 8}
    return JobSpec.model_validate({
        "name": "t", "model": "tiny-llama", "prompts": "prompts.jsonl", "seed": 7,
        "reward": {"builtin": "numeric_match"}, "algorithm": algorithm,
        "optim": {"learning_rate": 1e-3, "warmup_steps": 1, "lr_schedule": "linear"},
        "rollout": rollout, "train": {"max_steps": 4, "checkpoint_interval": 2, "max_staleness": 50,
                                      "micro_batch_samples": 4, "weights_dtype": "float32",
                                      "timeout_per_step_s": 60, **train},
        "replay": {"lease_timeout_s": 2.0, **replay},
    })


def demonstrations_jsonl(n: int) -> bytes:
    """n sft demonstrations: a calculator tool call, the tool's answer, then the reply (every third one a
    single turn), in chat format."""
    lines = []
    for i in range(n):
        a, b = 3 + i, 4 + 2 * i
        messages = [{"role": "system", "content": "Use <tool_call>calc(expression)</tool_call> for arithmetic."},
                    {"role": "user", "content": f"What is {a} * {b}?"}]
        if i % 3 != 2:
            messages += [{"role": "assistant", "content": f"<tool_call>calc({a} * {b})</tool_call>"},
                         {"role": "tool", "content": str(a * b)}]
        messages.append({"role": "assistant", "content": f"{a} * {b} = {a * b}"})
        lines.append(json.dumps({"messages": messages}))
    return ("\n".join(lines) + "\n").encode()


def sft_spec(**train: Any) -> JobSpec:
    """A tiny sft job on tiny-llama: `train` fields as keywords, plus `sft={...}` and `model=...`."""
    sft, model = train.pop("sft", {}), train.pop("model", "tiny-llama")
    return JobSpec.model_validate({
        "name": "sft", "model": model, "prompts": "demos.jsonl", "seed": 7, "algorithm": {"name": "sft"},
        "optim": {"learning_rate": 2e-2}, "sft": {"conversations_per_step": 4, "max_seq_tokens": 256, **sft},
        "train": {"max_steps": 6, "checkpoint_interval": 2, "micro_batch_samples": 4, "weights_dtype": "float32",
                  **train},
    })


def make_group(job_id: str, task_id: str, version: int, samples: int, seed: int = 0) -> common_pb2.Group:
    """A deterministic synthetic group (token ids inside the tiny model's vocabulary)."""
    rng = random.Random(f"{seed}:{task_id}")
    prompt = [rng.randrange(10, 2000) for _ in range(rng.randrange(4, 9))]
    out = []
    for k in range(samples):
        completion = [rng.randrange(10, 2000) for _ in range(rng.randrange(2, 7))]
        out.append(common_pb2.Sample(
            prompt_token_ids=prompt, completion_token_ids=completion,
            behaviour_logprobs=[-rng.uniform(5.0, 12.0) for _ in completion],
            reward=float(k % 2) + rng.uniform(0, 0.1), reward_status=common_pb2.REWARD_STATUS_OK,
            finish_reason="length",
        ))
    return common_pb2.Group(job_id=job_id, task_id=task_id, policy_version=version, samples=out, prompt="p")


def flat(group: common_pb2.Group) -> common_pb2.Group:
    """The group with every reward 0.5: zero variance, nothing for GRPO to learn (dapo skips it)."""
    for sample in group.samples:
        sample.reward = 0.5
    return group


async def create_job(jobs: JobStore, spec: JobSpec, num_prompts: int = 16) -> JobRecord:
    return await jobs.create("tenant", spec, prompts_jsonl(num_prompts), None)


async def insert_groups(replay: ReplayClient, record: JobRecord, count: int, version: int = 0,
                        num_prompts: int = 16, skip: int = 0) -> list[str]:
    """Insert the first `count` groups in the feeder's task order, less the first `skip` (inserted
    already, into the table configured then: a learner may hold it now); returns their task ids."""
    if not skip:
        await replay.configure(record.job_id, record.spec.replay)
    ids = task_ids_in_order(num_prompts, record.spec.seed, count)[skip:]
    groups = [make_group(record.job_id, t, version, record.spec.rollout.samples_per_prompt) for t in ids]
    await replay.insert(groups)
    return ids


@contextlib.asynccontextmanager
async def replay_service(redis_url: str) -> AsyncIterator[str]:
    settings = ReplaySettings(redis_url=redis_url, listen="127.0.0.1:0", reclaim_interval_s=0.2)
    async with running(settings) as svc:
        yield f"127.0.0.1:{svc.port}"


def learner_process(nats_url: str, redis_url: str, replay_addr: str, run_dir: Path, log: Path, *, once: bool = True,
                    **env: str) -> subprocess.Popen[bytes]:
    """`python -m fleetrl.services.learner --once` as a real child process (once=False: serving until
    SIGTERM, as deployed, claiming again after a run that stopped)."""
    environ = {**os.environ, "FLEETRL_LEARNER_LEASE_S": "3", "FLEETRL_LEARNER_LISTEN": "127.0.0.1:0",
               "FLEETRL_LEARNER_SAMPLE_WAIT_S": "0.5", "FLEETRL_LEARNER_TORCH_THREADS": "1",
               "FLEETRL_LEARNER_CLAIM_POLL_S": "0.3", **env}
    cmd = [sys.executable, "-m", "fleetrl.services.learner", *(["--once"] if once else []), "--nats-url", nats_url,
           "--redis-url", redis_url, "--replay-addr", replay_addr, "--run-dir", str(run_dir)]
    return started(subprocess.Popen(cmd, cwd=REPO, env=environ, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                                    start_new_session=True))


STARTED: list[subprocess.Popen[bytes]] = []
"""Processes the tests started, each in its own session; `kill_started` ends them after each test."""


def started(proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    STARTED.append(proc)
    return proc


def kill_started() -> None:
    """SIGKILL the process group of every process a test started: a test that failed or timed out
    mid-run must not leave a learner (or torchrun's ranks) running into the next tests."""
    while STARTED:
        proc = STARTED.pop()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
