"""Every example job under examples/ validates, and its reward or environment runs in the reward service's sandbox.

Each `examples/**/*.toml` is read the way `fleetrl submit` reads it (files relative to the TOML),
must be a valid JobSpec, and its prompts must pass the gateway's line checks. Its reward goes
through the reward service's own submission check (`parse_spec`, then a sandboxed worker pool
that loads the file) and scores a prompt's gold answer: a reward file must expose `reward`. An
environment opens an episode for the first prompt in the sandbox and plays a scripted trajectory
to its known rewards; the LangGraph version of the openai_agent example sends the actor exactly what
its agent.py sends. An sft job's demonstrations pass the gateway's line checks, and the calculator's
replay, turn by turn, in its environment: what the environment answers is what the demonstration
holds, and the demonstrated answer scores 1. Prompt and demonstration generators must reproduce their
committed files byte for byte.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from fleetrl.reward.scorer import Item, Scorer, Status, parse_environment, parse_spec
from fleetrl.reward.sessions import Action, EpisodeResult, EpisodeSessions
from fleetrl.reward.settings import RewardSettings
from fleetrl.sdk.client import load_job_file
from fleetrl.spec.config import JobSpec, parse_job_spec
from fleetrl.spec.demonstrations import demonstration_violations
from fleetrl.spec.prompts import prompt_violations
from tests import sandbox_uids

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
JOB_FILES = sorted(EXAMPLES.rglob("*.toml"))
ENV_JOBS = [p for p in JOB_FILES if {"environment", "agent"} & set(tomllib.loads(p.read_text()))]
SFT_JOBS = [p for p in JOB_FILES if tomllib.loads(p.read_text()).get("algorithm", {}).get("name") == "sft"]
REWARD_JOBS = [p for p in JOB_FILES if p not in ENV_JOBS + SFT_JOBS]
GENERATORS = [p for p in sorted(EXAMPLES.rglob("make_prompts.py")) if p.parent.name != "addition"]
UID_BASE = sandbox_uids.claim()  # sandbox uids of this module, apart from every other's
GOLD_FIELD = {"addition": "answer", "gsm8k": "solution", "custom_reward": "answer"}
BEST_REWARD = {"addition": 1.5, "gsm8k": 1.1, "custom_reward": 1.5}


def _load(path: Path) -> tuple[JobSpec, bytes, bytes]:
    """(spec, prompts, the reward or environment file)."""
    payload = load_job_file(path)
    return parse_job_spec(payload.spec, "json"), payload.prompts, payload.reward_file or payload.environment_file


def _name(path: Path) -> str:
    """An example job's name: its folder, or folder/file for a job other than job.toml."""
    return path.parent.name if path.name == "job.toml" else str(path.relative_to(EXAMPLES).with_suffix(""))


def _module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{path.parent.name}_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_there_are_the_examples() -> None:
    assert {p.parent.name for p in REWARD_JOBS} >= {"addition", "gsm8k", "custom_reward"}
    assert {_name(p) for p in ENV_JOBS} == set(GOLD_EPISODES)
    assert {_name(p) for p in SFT_JOBS} == {"calculator_agent/sft"}
    assert all((p.parent / "README.md").is_file() for p in JOB_FILES)


@pytest.mark.parametrize("path", JOB_FILES, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_job_file_is_a_valid_spec_with_good_prompts(path: Path) -> None:
    spec, prompts, user_file = _load(path)
    assert (demonstration_violations if path in SFT_JOBS else prompt_violations)(prompts) == []
    names_a_file = (spec.reward is not None and spec.reward.file is not None) or spec.environment is not None
    assert names_a_file == bool(user_file)


@pytest.mark.parametrize("path", REWARD_JOBS, ids=lambda p: str(p.relative_to(EXAMPLES)))
async def test_reward_loads_in_the_sandbox_and_scores_the_gold_answer(path: Path, tmp_path: Path) -> None:
    spec, prompts, reward_file = _load(path)
    assert spec.reward is not None
    checked = parse_spec(spec.reward.model_dump_json(), reward_file)
    first = json.loads(prompts.decode().splitlines()[0])
    prompt = first.pop("prompt")
    gold = str(first[GOLD_FIELD[path.parent.name]])
    scorer = Scorer(RewardSettings(workers_per_pool=1, sandbox_uid_base=UID_BASE, sandbox_dir=tmp_path))
    try:
        await scorer.validate(checked)
        good, bad = await scorer.score("examples", checked, [Item(gold, prompt, first), Item("no idea", prompt, first)])
    finally:
        await scorer.close()
    assert good.status == Status.OK and bad.status == Status.OK, (good.reason, bad.reason)
    assert good.reward == pytest.approx(BEST_REWARD[path.parent.name])
    assert bad.reward < good.reward


GOLD_EPISODES: dict[str, list[tuple[str, str, float, bool]]] = {
    # example -> per turn: (action with {expression} / {answer} / {a} / {b} filled from the prompt line,
    #                       the observation's text (a segment's last message), the reward, done)
    "calculator_agent": [("<tool_call>calc({expression})</tool_call>", "{answer}", 0.0, False),
                         ("The answer is {answer}.", "", 1.0, True)],
    "retry_feedback": [("I think 0.", "Not quite, try again. Answer with just the number.", 0.0, False),
                       ("{answer}", "", 0.5, True)],
    "openai_agent": [("I think 0.", "Not quite, try again. Answer with just the number.", 0.0, False),
                     ('<tool_call>{{"name": "calculator", "arguments": {{"expression": "40 + 2"}}}}</tool_call>', "42",
                      0.0, False),
                     ("{answer}", "", 0.5, True)],
    # the OpenAI Agents SDK's default model (the Responses API) sends the whole conversation back: every call
    # extends the one before, the tool's output and the feedback its only new messages
    "openai_agent/agents_sdk_job": [
        ("I think 0.", "Not quite, try again. Answer with just the number.", 0.0, False),
        ('<tool_call>{{"name": "calculator", "arguments": {{"expression": "40 + 2"}}}}</tool_call>', "42", 0.0, False),
        ("{answer}", "", 0.5, True)],
    # LangChain's ChatOpenAI, streamed, sends the graph's messages with every call: each call extends the one before
    "openai_agent/langgraph_job": [
        ("I think 0.", "Not quite, try again. Answer with just the number.", 0.0, False),
        ('<tool_call>{{"name": "calculator", "arguments": {{"expression": "40 + 2"}}}}</tool_call>', "42", 0.0, False),
        ("{answer}", "", 0.5, True)],
    # smolagents rewrites its history at every step: each call after the first is a new segment
    "openai_agent/smolagents_job": [
        ('<tool_call>{{"name": "final_answer", "arguments": {{"answer": "0"}}}}</tool_call>',
         "Observation:\n0\nNew task:\nNot quite, try again. Answer with just the number.", 0.0, False),
        # its one step used, smolagents asks for the answer without tools
        ('<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a} + {b}"}}}}</tool_call>',
         "Observation:\n{answer}\nBased on the above, please provide an answer to the following user task:\n"
         "Not quite, try again. Answer with just the number.", 0.0, False),
        ("{answer}", "", 0.5, True)],
}
SEGMENTED = {"openai_agent/smolagents_job"}


async def _scripted_episode(path: Path, tmp_path: Path, actions: list[str]) -> list[EpisodeResult]:
    """The job's environment or agent, in the sandbox, on its first prompt, played with these actions (filled
    from the prompt line): the open's result, then each step's, their latencies cleared."""
    spec, prompts, environment_file = _load(path)
    assert spec.environment is not None
    checked = parse_environment(spec.environment.model_dump_json(), environment_file)
    task = json.loads(prompts.decode().splitlines()[0])
    scorer = Scorer(RewardSettings(workers_per_pool=1, sandbox_uid_base=UID_BASE, sandbox_dir=tmp_path))
    sessions = EpisodeSessions(scorer)
    try:
        (result,) = await sessions.open("s", "examples", checked, task, 1)
        results = [result]
        for turn, action in enumerate(actions):
            assert result.status == Status.OK and not result.done, result.reason
            # an agent's action answers its pending call by id (an environment's call is 0)
            (result,) = await sessions.step("examples", "s", [Action(0, turn, action.format(**task), call=result.call)])
            results.append(result)
    finally:
        sessions.close_all()
        await scorer.close()
    return [dataclasses.replace(result, latency_s=0.0) for result in results]


@pytest.mark.parametrize("path", ENV_JOBS, ids=lambda p: str(p.relative_to(EXAMPLES)))
async def test_environment_plays_a_scripted_episode_in_the_sandbox(path: Path, tmp_path: Path) -> None:
    spec, prompts, _ = _load(path)
    assert spec.environment is not None
    task = json.loads(prompts.decode().splitlines()[0])
    first, *results = await _scripted_episode(path, tmp_path, [turn[0] for turn in GOLD_EPISODES[_name(path)]])
    assert first.status == Status.OK and first.observation, first.reason
    for result, (_, observed, reward, done) in zip(results, GOLD_EPISODES[_name(path)], strict=True):
        assert result.status == Status.OK, result.reason
        assert (result.reward, result.done, result.segment) == (reward, done, _name(path) in SEGMENTED and not done)
        shown = [m["content"] for m in result.observation]
        assert (shown[-1:] if result.segment else shown) == ([observed.format(**task)] if observed else [])
    assert spec.environment.max_turns >= len(GOLD_EPISODES[_name(path)])


ODD_TOOL_CALLS = [
    # two tool calls in one reply, one naming another tool with another argument, one a number; then 3 wrong answers
    '<tool_call>{{"name": "calc", "arguments": {{"expr": "1 + 1"}}}}</tool_call>'
    '<tool_call>{{"name": "calculator", "arguments": {{"expression": 42}}}}</tool_call>',
    "I think 0.", "1", "2"]


@pytest.mark.parametrize("script", ["gold", "odd_tool_calls"])
async def test_the_langgraph_agent_sends_what_agent_py_sends(script: str, tmp_path: Path) -> None:
    """The LangGraph version of the addition agent, given the same actions, sends the actor exactly what agent.py
    sends: the same messages and tool schema on the open, the same new messages extending the same calls (the
    tool's outputs, the feedback), the same reward. The actor renders the training tokens from these alone, so
    its episodes train as agent.py's do."""
    actions = [turn[0] for turn in GOLD_EPISODES["openai_agent"]] if script == "gold" else ODD_TOOL_CALLS
    plain = await _scripted_episode(EXAMPLES / "openai_agent" / "job.toml", tmp_path / "plain", actions)
    langgraph = await _scripted_episode(EXAMPLES / "openai_agent" / "langgraph_job.toml", tmp_path / "lg", actions)
    assert json.loads(langgraph[0].tools_json)[0]["function"]["name"] == "calculator"
    assert langgraph[-1].done and langgraph[-1].reward == (0.5 if script == "gold" else 0.0), langgraph[-1].reason
    assert langgraph == plain


@pytest.mark.parametrize("path", REWARD_JOBS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_reward_file_imports_and_exposes_reward(path: Path) -> None:
    spec, _, _ = _load(path)
    assert spec.reward is not None
    if spec.reward.file is None:
        return  # a built-in: checked by the sandbox test above
    assert callable(_module(path.parent / spec.reward.file).reward)


@pytest.mark.parametrize("path", GENERATORS, ids=lambda p: p.parent.name)
def test_prompt_generator_reproduces_its_files(path: Path) -> None:
    files = _module(path).files()
    assert files and all((path.parent / name).read_text() == text for name, text in files.items())
    train, held_out = ({json.loads(line)["prompt"] for line in files[n].splitlines()} for n in ("train.jsonl",
                                                                                               "eval.jsonl"))
    assert not train & held_out


async def test_calculator_demonstrations_replay_in_its_environment(tmp_path: Path) -> None:
    """Each demonstration is the episode the environment plays when the assistant says what it says: the
    environment opens with the demonstration's first messages and tools, answers the call with its tool
    message, and scores the answer 1 (the sft warm start then trains exactly the RL job's episodes)."""
    spec, prompts, environment_file = _load(EXAMPLES / "calculator_agent" / "job.toml")
    assert spec.environment is not None
    checked = parse_environment(spec.environment.model_dump_json(), environment_file)
    _, demos, _ = _load(EXAMPLES / "calculator_agent" / "sft.toml")
    tasks = {task["prompt"]: task for task in map(json.loads, prompts.decode().splitlines())}
    scorer = Scorer(RewardSettings(workers_per_pool=1, sandbox_uid_base=UID_BASE, sandbox_dir=tmp_path))
    sessions = EpisodeSessions(scorer)
    try:
        for number, line in enumerate(demos.decode().splitlines()[:3]):
            demo = json.loads(line)
            messages = demo["messages"]
            (first,) = await sessions.open(f"d{number}", "examples", checked, tasks[messages[1]["content"]], 1)
            assert (first.status, first.observation, json.loads(first.tools_json)) == (Status.OK, messages[:2],
                                                                                      demo["tools"]), first.reason
            (called,) = await sessions.step("examples", f"d{number}", [Action(0, 0, messages[2]["content"])])
            assert (called.observation, called.reward, called.done) == ([messages[3]], 0.0, False)
            (answered,) = await sessions.step("examples", f"d{number}", [Action(0, 1, messages[4]["content"])])
            assert (answered.reward, answered.done, len(messages)) == (1.0, True, 5)
    finally:
        sessions.close_all()
        await scorer.close()


def test_calculator_demonstrations_are_reproduced_and_not_held_out() -> None:
    here = EXAMPLES / "calculator_agent"
    files = _module(here / "make_demos.py").files()
    assert files["demos.jsonl"] == (here / "demos.jsonl").read_text()
    held_out = {json.loads(line)["prompt"] for line in (here / "eval.jsonl").read_text().splitlines()}
    asked = [json.loads(line)["messages"][1]["content"] for line in files["demos.jsonl"].splitlines()]
    assert len(set(asked)) == len(asked) == 48 and not set(asked) & held_out
