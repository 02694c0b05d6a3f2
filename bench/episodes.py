"""Episode overhead: what an environment turn costs the actor next to generating the turn.

`python -m bench.episodes --json` prints one JSON object. A real RewardService (its jail and
sandboxed workers) runs a trivial environment (reset gives a question, each step echoes the action's
length, done after `--turns`); `fleetrl.rollout.episodes.EpisodeRunner` plays groups against it:
- env_step_ms: the actor's StepEpisodes round trip per turn (gRPC, the service, the group's
  episodes stepped concurrently in their workers), mean over turns; env_step_sandbox_ms: the part
  the service measured inside the sandbox (one episode's step call on its worker); env_open_ms: the
  OpenEpisodes round trip per group (a worker held and `reset` per episode);
- generate_ms: one turn's generation of the group on the HF backend (`--model`, default tiny-llama;
  `--model smollm2-135m` for the real one), mean over turns; overhead_per_turn: env_step_ms / generate_ms;
- agent: the same figures for an agent file playing the same episodes through the `openai` client
  (each call one turn: the sandbox round trip plus the worker's bookkeeping of the call), its
  overhead_per_call (goal <= 0.10), and rerender_changed: the fraction of agent episodes whose
  tokens would have changed had the conversation been re-rendered through the chat template from
  the decoded texts (what a trainer that re-tokenizes would have trained on);
- concurrent_agent: an async agent running `--branches` chains of `--turns` calls each under
  `asyncio.gather`: seconds and turns per group with its calls generated together (`max_parallel_calls`
  = branches) against one at a time (`max_parallel_calls` 1), and the speedup;
- episodes_per_s: with the fixed backend (`--fixed-latency-s` per turn), for 1, 2 and 4 runners
  playing different tasks concurrently against the one service. The runners share this process and
  its event loop (an actor process each would add their own CPU); the figure is the service's
  episode throughput under that load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from fleetrl.policy import models
from fleetrl.policy.backends import Backend, FixedBackend, HFBackend
from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.reward.client import RewardClient, environment_to_proto
from fleetrl.reward.settings import RewardSettings
from fleetrl.rollout.episodes import EpisodeRunner
from fleetrl.rollout.settings import ActorSettings
from fleetrl.services.reward.server import running
from fleetrl.spec.config import EnvironmentSpec, RolloutConfig

ENV = b'''
class Env:
    def __init__(self, task, turns=3):
        self.turns, self.turn = turns, 0

    def reset(self):
        return "Tell me something."

    def step(self, action):
        self.turn += 1
        return f"You wrote {len(action)} characters. More.", 1.0, self.turn >= self.turns
'''

AGENT = b'''
def run(client, task, turns=3):
    messages = [{"role": "user", "content": "Tell me something."}]
    for _ in range(turns):
        reply = client.chat.completions.create(model="policy", messages=messages)
        text = reply.choices[0].message.content
        messages += [reply.choices[0].message, {"role": "user", "content": f"You wrote {len(text)} characters. More."}]
    return 1.0
'''
CONCURRENT_AGENT = b'''
import asyncio

async def run(client, task, turns=3, branches=4):
    async def chain(branch):
        messages = [{"role": "user", "content": f"Tell me something about {branch}."}]
        for _ in range(turns):
            reply = await client.chat.completions.create(model="policy", messages=messages)
            text = reply.choices[0].message.content
            messages += [reply.choices[0].message, {"role": "user", "content": f"You wrote {len(text)} characters."}]
    await asyncio.gather(*(chain(branch) for branch in range(branches)))
    return 1.0
'''
FILES = {"env": ENV, "agent": AGENT}


class Timings:
    """Wall-clock seconds of each named stage, as `EpisodeRunner`'s stage callable records them."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = defaultdict(list)

    @contextlib.contextmanager
    def stage(self, name: str, state: str) -> Iterator[None]:
        started = time.perf_counter()
        yield
        self.seconds[name].append(time.perf_counter() - started)

    def mean_ms(self, name: str) -> float:
        return 1000 * statistics.fmean(self.seconds[name])


def task(index: int) -> common_pb2.Task:
    return common_pb2.Task(job_id="bench", task_id=f"0/{index}", prompt=f"question {index}", metadata_json="{}")


async def play(runner: EpisodeRunner, backend: Backend, env: EnvironmentSpec, rollout: RolloutConfig,
               tasks: list[common_pb2.Task], source: bytes | None = None) -> list[common_pb2.Sample]:
    samples: list[common_pb2.Sample] = []
    proto = environment_to_proto(env, source or FILES[env.kind])
    for one in tasks:
        samples += await runner.play("bench", 0, rollout, env, proto, backend, one)
    return samples


async def measure(args: argparse.Namespace) -> dict[str, object]:
    env = EnvironmentSpec(file="env.py", params={"turns": args.turns}, max_turns=args.turns, max_total_tokens=4096,
                          step_timeout_s=10.0, memory_limit_mb=512)
    agent = env.model_copy(update={"kind": "agent"})
    rollout = RolloutConfig(samples_per_prompt=args.episodes, max_new_tokens=args.new_tokens)
    settings = RewardSettings(listen="127.0.0.1:0", workers_per_pool=args.episodes, grace_s=0.5,
                              episode_idle_timeout_s=900)  # a loaded machine can take minutes a turn
    model, tokenizer = models.load(args.model)
    out: dict[str, object] = {"model": args.model, "episodes_per_group": args.episodes, "turns": args.turns,
                              "new_tokens_per_turn": args.new_tokens}
    async with running(settings) as service:
        client = RewardClient(f"127.0.0.1:{service.port}", timeout_s=60)
        try:
            runner = EpisodeRunner(ActorSettings(actor_id="bench"), client, Timings().stage)
            for spec in (env, agent):  # warm both pools
                await play(runner, HFBackend(model, tokenizer), spec, rollout, [task(-1)])
            tasks = [task(i) for i in range(args.groups)]
            figures = {spec.kind: await turn_costs(client, HFBackend(model, tokenizer), spec, rollout, tasks)
                       for spec in (env, agent)}
            figures["env"].pop("samples")
            out.update(figures["env"])
            agent_figures = figures["agent"]
            samples = agent_figures.pop("samples")
            agent_figures["overhead_per_call"] = agent_figures.pop("overhead_per_turn")
            agent_figures["rerender_changed"] = rerender_changed(tokenizer, samples, rollout)
            out["agent"] = agent_figures
            out["concurrent_agent"] = await concurrent_calls(client, HFBackend(model, tokenizer), agent, rollout,
                                                             tasks, args.branches)
            out["episodes_per_s"] = {str(n): await throughput(client, tokenizer, env, rollout, n, args)
                                     for n in (1, 2, 4)}
        finally:
            await client.close()
    return out


async def turn_costs(client: RewardClient, backend: Backend, spec: EnvironmentSpec, rollout: RolloutConfig,
                     tasks: list[common_pb2.Task]) -> dict[str, Any]:
    """The per-turn figures of one kind of episode (env or agent), and its samples."""
    timings = Timings()
    samples = await play(EpisodeRunner(ActorSettings(actor_id="bench"), client, timings.stage), backend, spec,
                         rollout, tasks)
    sandbox_ms = 1000 * statistics.fmean(t.env_latency_s for s in samples for t in s.turns)
    return {"env_open_ms": timings.mean_ms("env_open"), "env_step_ms": timings.mean_ms("env_step"),
            "env_step_sandbox_ms": sandbox_ms, "generate_ms": timings.mean_ms("generate"),
            "overhead_per_turn": timings.mean_ms("env_step") / timings.mean_ms("generate"), "samples": samples}


async def concurrent_calls(client: RewardClient, backend: Backend, agent: EnvironmentSpec, rollout: RolloutConfig,
                           tasks: list[common_pb2.Task], branches: int) -> dict[str, Any]:
    """An async agent running `branches` chains of calls under `asyncio.gather`: seconds per group with its
    calls generated together (`max_parallel_calls` = branches) against one at a time (1), in this run."""
    turns = agent.params["turns"]
    figures: dict[str, Any] = {"branches": branches}
    for parallel in (branches, 1):
        spec = agent.model_copy(update={"params": {"turns": turns, "branches": branches},
                                        "max_parallel_calls": parallel, "max_turns": turns * branches})
        runner = EpisodeRunner(ActorSettings(actor_id="bench"), client, Timings().stage)
        await play(runner, backend, spec, rollout, [task(-2)], CONCURRENT_AGENT)  # warm its pool
        timings = Timings()
        runner = EpisodeRunner(ActorSettings(actor_id="bench"), client, timings.stage)
        started = time.perf_counter()
        samples = await play(runner, backend, spec, rollout, tasks, CONCURRENT_AGENT)
        key = "together" if parallel > 1 else "one_at_a_time"
        figures[f"seconds_per_group_{key}"] = (time.perf_counter() - started) / len(tasks)
        figures[f"turns_per_group_{key}"] = len(timings.seconds["generate"]) / len(tasks)
        assert all(s.episode_status == common_pb2.EPISODE_STATUS_DONE for s in samples), "an episode did not finish"
    figures["speedup"] = figures["seconds_per_group_one_at_a_time"] / figures["seconds_per_group_together"]
    return figures


def rerender_changed(tokenizer: Any, samples: list[common_pb2.Sample], rollout: RolloutConfig) -> float:
    """The fraction of samples whose tokens differ from their conversation re-rendered through the chat
    template from the decoded texts of its turns (`AGENT`'s conversation, rebuilt from the sample)."""
    changed = 0
    for sample in samples:
        ids = list(sample.completion_token_ids)
        texts = [tokenizer.decode(ids[t.start:t.end], skip_special_tokens=True) for t in sample.turns]
        messages = [{"role": "user", "content": "Tell me something."}]
        for k, text in enumerate(texts):
            messages.append({"role": "assistant", "content": text})
            if k + 1 < len(texts):
                messages.append({"role": "user", "content": f"You wrote {len(text)} characters. More."})
        system = [{"role": "system", "content": rollout.system_prompt}] if rollout.system_prompt else []
        rendered = list(tokenizer.apply_chat_template([*system, *messages], tokenize=True, return_dict=False))
        stored = [*sample.prompt_token_ids, *ids]
        changed += rendered[:len(stored)] != stored
    return changed / max(1, len(samples))


async def throughput(client: RewardClient, tokenizer: object, env: EnvironmentSpec, rollout: RolloutConfig,
                     runners: int, args: argparse.Namespace) -> float:
    """Episodes per second of `runners` concurrent runners on the fixed backend."""
    backend = FixedBackend(tokenizer, args.fixed_latency_s)
    players = [EpisodeRunner(ActorSettings(actor_id=f"bench-{r}"), client, Timings().stage) for r in range(runners)]
    started = time.perf_counter()
    done = await asyncio.gather(*(play(p, backend, env, rollout, [task(1000 * r + i) for i in range(args.groups)])
                                  for r, p in enumerate(players)))
    return sum(len(samples) for samples in done) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--episodes", type=int, default=8, help="episodes per group (samples_per_prompt)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32, help="max_new_tokens per turn")
    parser.add_argument("--groups", type=int, default=4, help="groups per measurement")
    parser.add_argument("--branches", type=int, default=4, help="the concurrent agent's chains of calls")
    parser.add_argument("--fixed-latency-s", type=float, default=0.05, help="the fixed backend's time per turn")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
