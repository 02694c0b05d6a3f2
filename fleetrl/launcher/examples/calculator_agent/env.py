"""Multi-step arithmetic with a `calc` tool: the model may call it, then answers with the number.

Runs in the reward service's sandbox. The reward is 1 for the right final answer (the last number
of the answer), else 0; a correct answer worked out without the tool scores the same.
"""

import ast
import operator
import re

from fleetrl.env import ToolEnv

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.USub: operator.neg, ast.UAdd: operator.pos}
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_value(node.operand))
    raise ValueError("only numbers and + - * / ( ) are allowed")


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses, e.g. 37 * 24 - 158."""
    if len(expression) > 200:
        raise ValueError("the expression is too long")
    value = _value(ast.parse(expression, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


class Env(ToolEnv):
    tools = [calc]
    max_tool_calls = 4
    untagged_calls = True  # SmolLM2-135M writes calc(...) without the tags (fleetrl.env.tools' docstring)

    def reset(self):
        return [{"role": "system", "content": self.system_prompt()},
                {"role": "user", "content": self.task["prompt"]}]

    def finish(self, action):
        numbers = NUMBER.findall(action)
        correct = bool(numbers) and float(numbers[-1]) == float(self.task["answer"])
        return None, float(correct), True
