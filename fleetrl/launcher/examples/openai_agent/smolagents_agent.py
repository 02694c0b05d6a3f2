"""The addition task of `agent.py`, written with smolagents: a `ToolCallingAgent` with a calculator tool.

It runs in the reward service's sandbox, where `client` is an `openai.OpenAI` served by the policy
being trained; smolagents' `OpenAIServerModel` wraps it (`OpenAIServerModel(model_id="policy")` with
no client works too: `OPENAI_BASE_URL` points at the policy). The agent's loop is smolagents': each
step asks the model for a tool call (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`),
runs the `calculator` tool here, and ends a run when the model calls `final_answer`; after
`steps_per_try` steps without one, smolagents asks once more, without tools, and takes that reply as
the answer. A wrong answer gets "Not quite, try again." as the agent's next task, with its memory
kept, up to `tries` answers. The right answer on the k-th try scores 1 / 2**(k-1); all wrong scores 0.

smolagents rewrites its history (its memory becomes the next request's messages: a tool call's text
gets "Calling tools: ..." appended), so a call after a tool call starts a new segment of the episode.
Its default system prompt is long (about 2,000 tokens); a short one fits a small model's budget.
"""

import importlib.resources
import re

import yaml
from smolagents import OpenAIServerModel, ToolCallingAgent, tool

NUMBER = re.compile(r"-?\d+")
SYSTEM = ("You can use a calculator: write <tool_call>{\"name\": \"calculator\", \"arguments\": "
          "{\"expression\": \"12 + 7\"}}</tool_call> to get a result. Give your answer, just the number, with "
          "<tool_call>{\"name\": \"final_answer\", \"arguments\": {\"answer\": \"19\"}}</tool_call>.")
TEMPLATES = yaml.safe_load(importlib.resources.files("smolagents.prompts").joinpath("toolcalling_agent.yaml")
                           .read_text())


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers, + and -.

    Args:
        expression: the expression, e.g. "12 + 7".
    """
    if not re.fullmatch(r"[\d\s+\-]{1,64}", expression):
        return "error: only integers, + and - are supported"
    total, sign = 0, 1
    for token in re.findall(r"\d+|[+-]", expression):
        if token in "+-":
            sign = 1 if token == "+" else -1
        else:
            total, sign = total + sign * int(token), 1
    return str(total)


def run(client, task, tries=3, steps_per_try=1):
    agent = ToolCallingAgent(tools=[calculator], model=OpenAIServerModel(model_id="policy", client=client),
                             prompt_templates={**TEMPLATES, "system_prompt": SYSTEM}, max_steps=steps_per_try,
                             verbosity_level=0)
    request = task["prompt"]
    for answers in range(1, tries + 1):
        numbers = NUMBER.findall(str(agent.run(request, reset=answers == 1)))
        if numbers and numbers[-1] == task["answer"]:
            return 1.0 / 2 ** (answers - 1)
        request = "Not quite, try again. Answer with just the number."
    return 0.0
