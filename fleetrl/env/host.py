"""The environment side of a sandboxed worker (boot mode "env"): one episode at a time.

`worker.load` builds an `EnvHost` from the environment file's `Env` class. The service sends {"op":
"reset", "task": {...}, "params": {...}} (builds `Env(task, **params)` and calls `reset()`), {"op":
"step", "action": text} (calls `step(action)`) and {"op": "close"} (drops the episode, so the worker
can serve the next one); a reset first empties the worker's temp dir, so an episode never sees the
files of the one before it on the same worker. Replies are {"observation": [messages], "reward": x,
"done": bool} (a reset's also "tools": the JSON schemas of the environment's `tools`, for the chat
template) or {"error": reason}. An observation may be a string (one user message), None (nothing) or
a list of {"role": "user" | "tool" | "system", "content": str} dicts. The values are checked here,
for a clear message, and again by the service (`fleetrl.reward.sessions`), since user code could
forge a reply. Stdlib only: imported inside the worker before isolation.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import traceback
import types
import warnings
from typing import Any

import fleetrl.env
from fleetrl.env import tools as env_tools
from fleetrl.env.base import Env
from fleetrl.reward import protocol

ROLES = ("user", "tool", "system")


class EnvError(Exception):
    """The environment returned something the episode protocol does not allow."""


def observation_messages(value: Any, roles: tuple[str, ...] = ROLES) -> list[dict[str, str]]:
    """The messages of an observation (str, None or a list of role/content dicts whose roles are in
    roles); EnvError otherwise."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise EnvError(f"observation is {type(value).__name__}, expected str, None or a list of messages")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict) or set(message) - {"role", "content"}:
            raise EnvError(f"observation[{index}] is not a {{'role', 'content'}} dict")
        role, content = message.get("role", "user"), message.get("content")
        if role not in roles or not isinstance(content, str):
            raise EnvError(f"observation[{index}] needs role in {roles} and a str content")
        messages.append({"role": role, "content": content})
    return messages


def observation_roles(reply: dict[str, Any]) -> tuple[str, ...]:
    """Roles a reply's observation may hold: an agent's segment (a whole conversation) has the
    assistant's turns too (`fleetrl.env.agent`)."""
    return (*ROLES, "assistant") if reply.get("segment") is True else ROLES


def step_reply(value: Any) -> dict[str, Any]:
    """The reply for what `step` returned: (observation, reward, done)."""
    if not isinstance(value, tuple | list) or len(value) != 3:
        raise EnvError(f"step returned {type(value).__name__}, expected (observation, reward, done)")
    observation, reward, done = value
    number = protocol.finite_number(reward)
    if number is None:
        shown = f"{reward!r:.80}" if not isinstance(reward, int) else "an int too large for a float"
        raise EnvError(f"step's reward is {shown}, expected a finite number")
    if not isinstance(done, bool):
        raise EnvError(f"step's done is {type(done).__name__}, expected bool")
    return {"observation": observation_messages(observation), "reward": number, "done": done}


def declared_tools(env: Any) -> list[dict[str, Any]]:
    """JSON schemas of the functions in the environment's `tools` list (a `ToolEnv`'s); [] without one."""
    tools = getattr(env, "tools", None)
    if not isinstance(tools, list) or not tools or not all(callable(t) for t in tools):
        return []
    return env_tools.tool_schemas(tools)


def empty_dir(directory: str) -> None:
    """Remove everything in directory (the worker's private temp dir), leaving the directory."""
    for entry in os.scandir(directory):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def environment_class(namespace: dict[str, Any]) -> type:
    """The environment class an environment file defines: its class `Env`, else its one subclass of
    `fleetrl.env.Env`; TypeError naming what is missing."""
    cls = namespace.get("Env")
    if not isinstance(cls, type) or cls is Env:
        subclasses = [v for v in namespace.values() if isinstance(v, type) and issubclass(v, Env)
                      and v.__module__ == namespace.get("__name__")]
        if len(subclasses) != 1:
            raise TypeError("the environment file defines no environment: a subclass of fleetrl.env.Env (or a class "
                            f"named Env with reset() and step(action)); found {len(subclasses)} subclasses")
        cls = subclasses[0]
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    missing += sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise TypeError(f"class {cls.__name__} does not define {' or '.join(sorted(set(missing)))}")
    return cls


def deprecated_env_tools() -> types.ModuleType:
    """The module `import env_tools` gives an environment file: `fleetrl.env` under its old name, warning
    on each use that the name goes in the next release."""
    shim = types.ModuleType("env_tools", "Deprecated: import from fleetrl.env instead.")

    def __getattr__(name: str) -> Any:
        warnings.warn(f"env_tools is deprecated and goes in the next release: write `from fleetrl.env import {name}`",
                      DeprecationWarning, stacklevel=2)
        return getattr(fleetrl.env, name)

    shim.__getattr__ = __getattr__  # type: ignore[method-assign]
    return shim


class EnvHost:
    """Runs the episodes of one environment class, one at a time."""

    cls: Any
    env: Any
    tmpdir: str

    def __init__(self, cls: Any, tmpdir: str) -> None:
        self.cls, self.env, self.tmpdir = cls, None, tmpdir

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """The reply to one request; anything the user's code raises becomes {"error": its last frames}."""
        try:
            return self._dispatch(request)
        except BaseException as error:  # user code: anything it raises ends this episode
            self.env = None
            if isinstance(error, EnvError):
                return {"error": str(error)}
            return {"error": "".join(traceback.format_exception(error, limit=-2))[-2000:].strip()}

    def _dispatch(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "reset":
            self.env = None
            empty_dir(self.tmpdir)  # an episode starts with none of the previous episode's files
            self.env = self.cls(request["task"], **request["params"])
            reply = {"observation": observation_messages(self.env.reset()), "reward": 0.0, "done": False}
            return {**reply, "tools": declared_tools(self.env)}
        if op == "step":
            if self.env is None:
                raise EnvError("step before reset")
            return step_reply(self.env.step(request["action"]))
        if op == "close":
            self.env = None
            return {"closed": True}
        raise EnvError(f"unknown op {op!r}")
