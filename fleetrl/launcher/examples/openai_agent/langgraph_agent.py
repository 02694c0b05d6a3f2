"""The addition task of `agent.py`, written with LangGraph: a small `StateGraph` whose nodes are the model
(LangChain's `ChatOpenAI`, streamed), the calculator and the answer's check.

It runs in the reward service's sandbox, where every httpx client is served by the policy being trained:
`ChatOpenAI(model="policy")` finds it through `OPENAI_BASE_URL` (`client` is not needed), and
`streaming=True` has it read each reply as server-sent events (the same reply, whole, in the stream's
format). The graph goes from the model to `tools` while the model calls the calculator
(`<tool_call>{"name": "calculator", "arguments": {...}}</tool_call>`), and back; a reply without a tool
call goes to `check`, which ends the graph on the right answer or after `tries` answers, and otherwise
appends "Not quite, try again." and goes back to the model. The right answer on the k-th try scores
1 / 2**(k-1); all wrong scores 0.

The graph's state keeps the messages LangChain got, and `ChatOpenAI` sends them all with every call, so
every call extends the one before: an episode is one training sample. There is no system prompt, the
model is bound to `agent.py`'s calculator schema, and `tools` answers a tool call as `agent.py` does (any
tool name, the "expression" argument as a str, or ""), so every call carries `agent.py`'s messages and
tools, and renders to the same tokens. LangGraph's `ToolNode` runs a call as its schema reads, not as
`agent.py` does: given the calculator as a `@tool` with this schema, `{"expression": 42}` reached it as an
int and raised, ending the episode as an error.
"""

import re

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph

NUMBER = re.compile(r"-?\d+")
FEEDBACK = "Not quite, try again. Answer with just the number."
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


class Episode(MessagesState):  # the messages, which each node appends to, and the answers so far
    answers: int
    reward: float


def build(answer: str, tries: int):  # the graph, compiled, for one task
    model = ChatOpenAI(model="policy", streaming=True).bind_tools([CALCULATOR])

    async def call_model(state: Episode) -> dict:
        return {"messages": [await model.ainvoke(state["messages"])]}

    def use_tools(state: Episode) -> dict:  # the agent runs its own tool here, in the sandbox
        return {"messages": [ToolMessage(calculator(str(call["args"].get("expression", ""))), tool_call_id=call["id"])
                             for call in state["messages"][-1].tool_calls]}

    def check(state: Episode) -> dict:
        answers = state["answers"] + 1
        numbers = NUMBER.findall(str(state["messages"][-1].content))
        if numbers and numbers[-1] == answer:
            return {"answers": answers, "reward": 1.0 / 2 ** (answers - 1)}
        return {"answers": answers, "messages": [HumanMessage(FEEDBACK)] if answers < tries else []}

    graph = StateGraph(Episode)
    graph.add_node("model", call_model)
    graph.add_node("tools", use_tools)
    graph.add_node("check", check)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", lambda state: "tools" if state["messages"][-1].tool_calls else "check")
    graph.add_edge("tools", "model")
    graph.add_conditional_edges("check", lambda state: END if state["reward"] or state["answers"] == tries else "model")
    return graph.compile()


async def run(client, task, tries=3):
    graph = build(task["answer"], tries)
    final = await graph.ainvoke({"messages": [HumanMessage(task["prompt"])], "answers": 0, "reward": 0.0})
    return final["reward"]
