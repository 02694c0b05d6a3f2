"""Environments for multi-turn jobs: the bases environment files subclass, and tool use.

- `base`: `Env` (abstract `reset` and `step`) and the types its methods return (`Observation`,
  `Message`, `StepResult`).
- `tools`: `ToolEnv` (an `Env` whose actions may call Python functions as tools), the tool-call parser
  and the system prompt describing the tools.
- `host`: the worker side that runs an environment file's episodes in the reward service's sandbox
  (`fleetrl.reward.worker_main` wires it).
- `agent`: the worker side of an agent file (`AgentHost`: its episodes, and whether a call appends or starts
  a segment), with `agent_http` (every httpx request answered by it), `agent_responses` (the Responses API as
  chat completions) and `agent_stream` (streamed replies); `fleetrl.reward.worker_main` wires them too.

An environment file writes `from fleetrl.env import Env, ToolEnv`. Stdlib only: the whole package is
bound into the sandbox, where user code runs.
"""

from fleetrl.env.base import Env, Message, Observation, StepResult
from fleetrl.env.tools import (
    ToolCall,
    ToolEnv,
    describe_tools,
    parse_tool_calls,
    run_tool_call,
    tool_schemas,
)

__all__ = ["Env", "Message", "Observation", "StepResult", "ToolCall", "ToolEnv", "describe_tools",
           "parse_tool_calls", "run_tool_call", "tool_schemas"]
