"""Write demos.jsonl: demonstrations of the calculator episode for the sft warm start (sft.toml).

`python examples/calculator_agent/make_demos.py` regenerates the file byte for byte (fixed seed). Each
line is one whole episode as the environment plays it: the opening messages `Env.reset` gives (the
system prompt `ToolEnv.system_prompt` writes and the user's question), the assistant's tagged call
`<tool_call>calc(<expression>)</tool_call>`, the `tool` message `Env.step` answers it with, and the
assistant's answer, the number alone. The environment itself writes every message that is not the
assistant's, so a demonstration renders exactly as an episode does on the actors, and the tool schemas
an actor hands the chat template ride along in `tools`.

Design choice: the questions are a seeded sample of train.jsonl, so they are disjoint from eval.jsonl
(make_prompts.py keeps the two apart) and phrased exactly as the RL job's prompts.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from typing import Any

from fleetrl.env import tool_schemas

HERE = Path(__file__).resolve().parent
SEED = 7
DEMONSTRATIONS = 48


def environment() -> Any:
    """The example's `Env` class, loaded from env.py beside this file."""
    spec = importlib.util.spec_from_file_location("calculator_agent_env", HERE / "env.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Env


def demonstration(env_class: Any, task: dict[str, Any]) -> dict[str, Any]:
    """One episode of `task`: the environment's messages around a call of calc and the answer."""
    env = env_class(task)
    opening = env.reset()
    call = f"<tool_call>calc({task['expression']})</tool_call>"
    tool_messages, _, done = env.step(call)
    assert not done, "the demonstrated call must reach the tool"
    messages = [*opening, {"role": "assistant", "content": call}, *tool_messages,
                {"role": "assistant", "content": task["answer"]}]
    return {"messages": messages, "tools": tool_schemas(env_class.tools)}


def files() -> dict[str, str]:
    """{"demos.jsonl": its contents}: DEMONSTRATIONS episodes of a seeded sample of train.jsonl's questions."""
    train = [json.loads(line) for line in (HERE / "train.jsonl").read_text().splitlines()]
    env_class = environment()
    chosen = random.Random(SEED).sample(train, DEMONSTRATIONS)
    return {"demos.jsonl": "".join(json.dumps(demonstration(env_class, task)) + "\n" for task in chosen)}


def main() -> None:
    for name, text in files().items():
        (HERE / name).write_text(text)


if __name__ == "__main__":
    main()
