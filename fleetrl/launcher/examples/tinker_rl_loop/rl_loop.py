"""GRPO on the demo's two-digit addition, written by the user against the official `tinker` SDK.

fleetrl serves the primitives (`fleetrl tinker`); this file is the whole training loop. Run:
    TINKER_BASE_URL=http://127.0.0.1:8090 TINKER_API_KEY=tml-... python examples/tinker_rl_loop/rl_loop.py
Settings from the environment: MODEL (smollm2-135m), STEPS (24), EVAL (100 held-out problems), OFF_POLICY (0;
1: sample the next step's groups while this one trains, as a fleetrl job with max_staleness = 1 does: faster
when the server samples on the fleet's actors and trains on its learners).
"""

import json
import os
import re
from pathlib import Path

import tinker
from tinker import types

DATA = Path(__file__).resolve().parent.parent / "addition"
MODEL = os.environ.get("MODEL", "smollm2-135m")
STEPS, EVAL = int(os.environ.get("STEPS", 24)), int(os.environ.get("EVAL", 100))
OFF_POLICY = os.environ.get("OFF_POLICY", "0") == "1"
PROMPTS, SAMPLES = 4, 8  # per step, as the demo job (examples/addition/job.toml)
SAMPLING = types.SamplingParams(max_tokens=12, temperature=0.7, top_p=1.0)


def load(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def reward(text: str, answer: str) -> float:  # the demo job's: right last number, plus half for a bare number
    numbers = re.findall(r"-?\d+", text)
    return float(bool(numbers) and numbers[-1] == answer) + 0.5 * bool(re.fullmatch(r"\s*-?\d+\s*", text))


training = tinker.ServiceClient().create_lora_training_client(base_model=MODEL, rank=16, seed=0).result()
tokenizer = training.get_tokenizer()


def prompt(text: str) -> list[int]:  # the chat template, as the demo's actors apply it
    chat = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)


def accuracy(sampler: tinker.SamplingClient, problems: list[dict]) -> float:
    futures = [sampler.sample(types.ModelInput.from_ints(prompt(p["prompt"])), 1, SAMPLING) for p in problems]
    texts = [tokenizer.decode(f.result().sequences[0].tokens, skip_special_tokens=True) for f in futures]
    return sum(reward(t, p["answer"]) >= 1 for t, p in zip(texts, problems, strict=True)) / len(problems)


def datum(tokens: list[int], **inputs: list[float]) -> types.Datum:  # next-token prediction over tokens
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], **inputs})


def ask(sampler: tinker.SamplingClient, step: int) -> list[tuple[dict, tinker.APIFuture]]:
    batch = train_set[step * PROMPTS:(step + 1) * PROMPTS]
    return [(p, sampler.sample(types.ModelInput.from_ints(prompt(p["prompt"])), SAMPLES, SAMPLING)) for p in batch]


held_out, train_set = load("eval.jsonl")[:EVAL], load("train.jsonl")
before = accuracy(training.save_weights_and_get_sampling_client().result(), held_out)
asked = ask(training.save_weights_and_get_sampling_client().result(), 0)
for step in range(STEPS):
    sequences, advantages, rewards = [], [], []
    for problem, future in asked:
        ids, samples = prompt(problem["prompt"]), future.result().sequences
        group = [reward(tokenizer.decode(s.tokens, skip_special_tokens=True), problem["answer"]) for s in samples]
        rewards += group
        for sample, r in zip(samples, group, strict=True):  # Dr. GRPO: reward - group mean, on completion tokens
            sequences.append(ids + sample.tokens)
            advantage = (r - sum(group) / len(group)) / (PROMPTS * SAMPLES)
            advantages.append([0.0] * (len(ids) - 1) + [advantage] * len(sample.tokens))
    if OFF_POLICY and step + 1 < STEPS:  # the next step's samples, from these weights, while this step trains
        asked = ask(training.save_weights_and_get_sampling_client().result(), step + 1)
    # REINFORCE: cross_entropy weighted by the advantages has the gradient of importance_sampling at ratio 1,
    # with no forward pass for the trainer's own log-probs (the samples used temperature 0.7, so the sampler's
    # log-probs are not the trainer's); with OFF_POLICY the samples are one step behind, uncorrected
    data = [datum(t, weights=a) for t, a in zip(sequences, advantages, strict=True)]
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    if not OFF_POLICY and step + 1 < STEPS:
        asked = ask(training.save_weights_and_get_sampling_client().result(), step + 1)
    print(json.dumps({"step": step, "reward_mean": round(sum(rewards) / len(rewards), 3)}), flush=True)
after = accuracy(training.save_weights_and_get_sampling_client().result(), held_out)
print(json.dumps({"model": MODEL, "steps": STEPS, "held_out": len(held_out), "accuracy_before": before,
                  "accuracy_after": after}))
