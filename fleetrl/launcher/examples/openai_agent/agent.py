"""The addition task as an agent written against the `openai` client, with one tool.

It runs in the reward service's sandbox, where `client` is an `openai.OpenAI` served by the policy
being trained. The agent asks the question with a `calculator` tool declared (its schema goes to the
chat template, which renders it where the template has a tool format: Qwen2.5's, SmolLM3's; SmolLM2's
has none, and no system prompt explains it, so SmolLM2 rarely calls it); when the model calls the
tool (`<tool_call>{"name": "calculator", "arguments": {...}}</tool_call>`), the agent runs it and
sends the result back as a tool message. A wrong answer gets "Not quite, try again." and another call, up to
`tries` answers. The right answer on the k-th try scores 1 / 2**(k-1); all wrong scores 0.
"""

import json
import re

NUMBER = re.compile(r"-?\d+")
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression of integers, + and -.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def calculator(expression: str) -> str:
    if not re.fullmatch(r"[\d\s+\-]{1,64}", expression):
        return "error: only integers, + and - are supported"
    total, sign = 0, 1
    for token in re.findall(r"\d+|[+-]", expression):
        if token in "+-":
            sign = 1 if token == "+" else -1
        else:
            total, sign = total + sign * int(token), 1
    return str(total)


def run(client, task, tries=3):
    messages = [{"role": "user", "content": task["prompt"]}]
    answers = 0
    while answers < tries:
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        messages.append(message)
        if message.tool_calls:  # the agent runs its own tool here, in the sandbox
            for call in message.tool_calls:
                expression = json.loads(call.function.arguments or "{}").get("expression", "")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(str(expression))})
            continue
        answers += 1
        numbers = NUMBER.findall(message.content or "")
        if numbers and numbers[-1] == task["answer"]:
            return 1.0 / 2 ** (answers - 1)
        messages.append({"role": "user", "content": "Not quite, try again. Answer with just the number."})
    return 0.0
