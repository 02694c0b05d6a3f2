"""The addition task of `agent.py`, written with the OpenAI Agents SDK: an `Agent` with a calculator
`@function_tool`, run by `Runner.run` on the SDK's default model.

It runs in the reward service's sandbox, where `client` is an `openai.AsyncOpenAI` served by the
policy being trained; `set_default_openai_client` hands it to the SDK (without it, the SDK builds the
same client from `OPENAI_BASE_URL`). No model is named: the SDK's default, `OpenAIResponsesModel`,
calls the Responses API, which the worker serves as the chat completion it stands for. When the model
calls the calculator (`<tool_call>{"name": "calculator", "arguments": {...}}</tool_call>`), the SDK
runs it here and calls again with its output; a reply without a tool call ends the run, its text the
answer. A wrong answer gets "Not quite, try again." appended to the run's items
(`result.to_input_list()`) and another run, up to `tries` answers. The right answer on the k-th try
scores 1 / 2**(k-1); all wrong scores 0.

The SDK sends the whole conversation with every call, the model's replies as it got them, so every
call extends the one before: an episode is one training sample, as with `agent.py`. The agent has no
instructions (SmolLM2's chat template renders no tools, and a system prompt explaining them did not
help `agent.py`), so its calls carry the same messages as `agent.py`'s.
"""

import re

from agents import Agent, Runner, function_tool, set_default_openai_client

NUMBER = re.compile(r"-?\d+")
FEEDBACK = {"role": "user", "content": "Not quite, try again. Answer with just the number."}


@function_tool
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


async def run(client, task, tries=3):
    set_default_openai_client(client, use_for_tracing=False)
    agent = Agent(name="adder", tools=[calculator])
    items = [{"role": "user", "content": task["prompt"]}]
    for answers in range(1, tries + 1):
        result = await Runner.run(agent, items)
        numbers = NUMBER.findall(str(result.final_output))
        if numbers and numbers[-1] == task["answer"]:
            return 1.0 / 2 ** (answers - 1)
        items = [*result.to_input_list(), FEEDBACK]
    return 0.0
