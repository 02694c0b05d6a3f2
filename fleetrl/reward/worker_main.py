"""The sandboxed worker process: isolate, load one reward spec, then score items until the service closes.

Started by `sandbox.WorkerProcess.start`, inside the bubblewrap jail (`jail`) or, in the legacy sandbox, as
a plain `python -I` in a new session. Its stdin is a Unix socket carrying requests, each with the
pipe its reply goes to (`protocol`); the worker shuts the socket for writing at once. The first
request is the boot message (mode, spec or source, limits, uid, temp dir, the service's pid, jail
or not); the worker isolates itself and answers {"isolation": {...}} naming the layers that hold,
before any user code runs. The second request loads the spec (a reward file's code runs here
first) and is answered {"ok": true} or {"ok": false, "reason": traceback}. Then each item is
answered {"value": x} | {"components": {...}} | {"error": reason} with its CPU seconds so far; in
"env" mode (an environment file) the requests are an episode's reset, steps and close instead
(`fleetrl.env.host`), and in "agent" mode (an agent file) the same requests run the agent, whose
chat completions answer them (`fleetrl.env.agent`).
User code sees /dev/null as stdin, stdout and stderr. Stdlib only, plus pyseccomp in the jail and
the built-in registry in "builtin" mode (both imported before the uid drop).
"""

from __future__ import annotations

import asyncio
import contextlib
import linecache
import os
import resource
import socket
import sys
import traceback
import types
import warnings
from collections.abc import Callable
from typing import Any

from fleetrl.env import host as env_host
from fleetrl.reward import codeexec, guard, protocol

RewardFn = Callable[..., Any]
Handler = Callable[[dict[str, Any]], dict[str, Any]]
USER_CODE_MODES = ("file", "env", "agent")
LOAD_WARNINGS: list[str] = []
"""Deprecation warnings the spec's load raised, reported to the service with the load's reply."""


def _private_channel() -> socket.socket:
    """The request socket (moved off fd 0 and shut for writing); fds 0-2 become /dev/null."""
    sock = socket.socket(fileno=os.dup(0))
    sock.shutdown(socket.SHUT_WR)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - lives as long as the process
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115
    return sock


def _supervise(child: int, sock: socket.socket, reply_fd: int) -> None:
    """Outer process of a PID namespace: wait for the item loop (PID 1 inside) and mirror its end.
    It closes its copies of the channel (a reply pipe must close when the item loop closes it)."""
    sock.close()
    os.close(reply_fd)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def isolate(boot: dict[str, Any], sock: socket.socket, reply_fd: int) -> dict[str, Any]:
    """Enter namespaces (legacy) or take the jail's, apply limits, drop to the worker's uid, load the
    seccomp filter (jail); returns the active layers."""
    jailed = bool(boot.get("jail"))
    if jailed:
        isolation: dict[str, Any] = {"mountns": True, "pidns": True, "netns": True, "userns": os.geteuid() != 0}
        parent = os.getppid()  # 0 when the worker is PID 1, else bwrap's init (1)
    else:
        isolation, parent = _enter_namespaces(boot, sock, reply_fd)
    limits = boot["limits"]
    os.chdir(boot["tmpdir"])
    if boot["mode"] == "builtin":
        _preload_builtins(boot)
    if boot["mode"] == "agent":
        _preload_agent()
    guard.set_limits(limits["memory_mb"], limits["cpu_s"], limits["file_mb"], limits["open_files"],
                     limits["processes"])
    uid = int(boot.get("uid") or 0)
    if uid and os.geteuid() == 0:
        if jailed:
            os.chown(boot["tmpdir"], uid, uid)
        else:
            isolation["mountns"] = guard.expose_paths(_python_paths(boot))
    isolation["dropped_uid"] = guard.drop_privileges(uid)
    guard.die_with_parent(parent)  # again: the uid change (and a fork) cleared it
    guard.forbid_new_privileges()
    guard.hide_from_same_uid()  # a code_tests child cannot read or write this process's memory
    if jailed:
        from fleetrl.reward import syscall_filter

        syscall_filter.load(allow_fork=boot["mode"] == "builtin")
        isolation["seccomp"] = True
    isolation.update(uid=os.getuid(), audit_hook=boot["mode"] in USER_CODE_MODES)
    return isolation


def _enter_namespaces(boot: dict[str, Any], sock: socket.socket, reply_fd: int) -> tuple[dict[str, Any], int]:
    """The namespaces entered, and the pid of the item loop's parent (the service, or the outer process)."""
    parent = int(boot["parent_pid"])
    guard.die_with_parent(parent)
    isolation: dict[str, Any] = guard.unshare_namespaces(bool(boot["namespaces"]))
    if isolation["pidns"]:
        parent = os.getpid()
        child = os.fork()
        if child:
            _supervise(child, sock, reply_fd)
    return isolation, parent


def _python_paths(boot: dict[str, Any]) -> list[str]:
    paths = [p for p in sys.path if p and p != boot["root"]]
    return [*paths, sys.prefix, sys.base_prefix, sys.executable, boot["tmpdir"]]


def _preload_builtins(boot: dict[str, Any]) -> None:
    from fleetrl.reward import verifiers

    verifiers.preload(boot["spec"]["builtin"], boot["spec"]["params"])


def _preload_agent() -> None:
    """Import the openai SDK (and what it imports lazily on a first call) while files can still be read
    freely and before the limits: an agent's first call then costs no imports."""
    import openai
    import openai.resources.chat  # noqa: F401

    from fleetrl.env import agent_http  # noqa: F401


def run_user_file(source: str, tmpdir: str, root: str, name: str) -> dict[str, Any]:
    """Execute a user's file under the audit hook, as the module `name` (in `sys.modules`, as an import would
    put it); its namespace. It is compiled with its own future imports only, not this module's: postponed
    annotations here would turn its every annotation into a string that `typing.get_type_hints` (LangGraph's
    state classes, pydantic, dataclasses) then fails to resolve."""
    sys.path[:] = [p for p in sys.path if p != root]
    guard.install_hook(tmpdir)
    filename = f"{name}.py"
    # the file exists only here: its lines in linecache give `inspect.getsource` (smolagents' @tool reads
    # a tool's source) and tracebacks its text; an entry with no mtime is never checked against a file
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    module = types.ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module
    exec(compile(source, filename, "exec", dont_inherit=True), module.__dict__)
    return module.__dict__


def load_file(source: str, tmpdir: str, root: str) -> RewardFn:
    """Execute a user's reward file and return its `reward` callable."""
    fn = run_user_file(source, tmpdir, root, "reward_file").get("reward")
    if not callable(fn):
        raise TypeError("the reward file does not define a callable `reward(completion, prompt, **metadata)`")
    return fn


def load_env(source: str, tmpdir: str, root: str) -> env_host.EnvHost:
    """Execute a user's environment file (which imports `fleetrl.env`, or the deprecated `env_tools`) and
    host its environment class."""
    sys.modules["env_tools"] = env_host.deprecated_env_tools()
    return env_host.EnvHost(env_host.environment_class(run_user_file(source, tmpdir, root, "env_file")), tmpdir)


def load_scorer(boot: dict[str, Any]) -> RewardFn:
    """The function scoring one item (a reward file or a built-in)."""
    if boot["mode"] == "file":
        fn = load_file(boot["source"], boot["tmpdir"], boot["root"])
        params = boot["spec"].get("params") or {}
        if params:
            return lambda completion, prompt, **meta: fn(completion, prompt, params=params, **meta)
        return fn
    from fleetrl.reward import verifiers

    return verifiers.resolve(boot["spec"]["builtin"], boot["spec"]["params"])


def _inline(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` as a coroutine function that runs it in the event loop's thread."""

    async def run(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    return run


def load_agent(source: str, tmpdir: str, root: str, channel: Channel) -> Handler:
    """Execute a user's agent file and host its `run`: its clients, and every httpx client it makes,
    are answered by the policy through the channel. The event loop and clients are made before the
    audit hook (which refuses the loop's self-pipe socket) and reused by every episode; the agent's
    environment (`agent.ENVIRONMENT`) is set before its file runs, for clients it builds at import."""
    import openai

    from fleetrl.env import agent, agent_http

    # the async client finds the platform in a worker thread on its first call (`asyncify`), and that idle
    # thread would outlive the call: the lookup is quick file reads, so it runs inline instead
    openai._base_client.asyncify = _inline  # type: ignore[attr-defined]
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    clients = (openai.OpenAI(base_url=agent.BASE_URL, api_key=agent.API_KEY, max_retries=0),
               openai.AsyncOpenAI(base_url=agent.BASE_URL, api_key=agent.API_KEY, max_retries=0))
    os.environ.update(agent.ENVIRONMENT)
    run = agent.agent_run(run_user_file(source, tmpdir, root, "agent_file"))
    host = agent.AgentHost(run, tmpdir, channel.exchange, loop, clients)
    agent_http.serve_httpx(host)
    return host.handle


def load(boot: dict[str, Any], channel: Channel) -> Handler:
    """What answers one request, for the boot's mode."""
    if boot["mode"] == "agent":
        return load_agent(boot["source"], boot["tmpdir"], boot["root"], channel)
    if boot["mode"] == "env":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DeprecationWarning)
            handler = load_env(boot["source"], boot["tmpdir"], boot["root"]).handle
        LOAD_WARNINGS[:] = sorted({str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)})
        return handler
    fn = load_scorer(boot)
    return lambda request: score_one(fn, request)


def encode_value(value: Any) -> dict[str, Any]:
    """The reply for a reward function's return value (the service re-checks it)."""
    if isinstance(value, bool):
        return {"value": float(value)}
    if isinstance(value, int | float):
        number = protocol.finite_number(value)
        if number is None:
            shown = value if isinstance(value, float) else "an int too large for a float"
            return {"error": f"reward is not a finite number: {shown}"}
        return {"value": number}
    if isinstance(value, dict):
        components = {str(k): protocol.finite_number(float(v) if isinstance(v, bool) else v) for k, v in value.items()}
        bad = [k for k, v in components.items() if v is None]
        if bad:
            return {"error": f"reward dict has non-finite or non-numeric entries: {bad[:5]}"}
        return {"components": components}
    return {"error": f"reward returned {type(value).__name__} {str(value)[:80]!r}, expected a float or dict"}


def score_one(fn: RewardFn, request: dict[str, Any]) -> dict[str, Any]:
    """Call fn on one item; an exception becomes an error reply with its last frames."""
    try:
        value = fn(request["completion"], request["prompt"], **request["metadata"])
    except BaseException as error:  # user code: anything it raises is this item's error
        tail = traceback.format_exception(error, limit=-2)
        return {"error": "".join(tail)[-2000:].strip()}
    return encode_value(value)


def reply(fd: int, message: dict[str, Any]) -> None:
    """Write message on a request's reply pipe and close it; a pipe the service (or user code) closed
    already is left alone: the service then sees no reply."""
    try:
        protocol.write_fd(fd, message)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


class Channel:
    """The worker's end of the request socket: the request in hand, and the pipe its reply goes to."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.reply_fd = sock, -1

    def next(self) -> dict[str, Any] | None:
        """The next request (None once the service has hung up)."""
        try:
            request, self.reply_fd = protocol.receive(self.sock)
        except (EOFError, ConnectionError):
            return None
        codeexec.CHILD_CLOSE_FDS[:] = [self.sock.fileno(), self.reply_fd]
        return request

    def answer(self, message: dict[str, Any]) -> None:
        """Reply to the request in hand, with this process's CPU seconds so far."""
        usage = resource.getrusage(resource.RUSAGE_SELF)
        reply(self.reply_fd, {**message, "cpu_s": usage.ru_utime + usage.ru_stime})

    def exchange(self, message: dict[str, Any]) -> dict[str, Any]:
        """Answer the request in hand with message and wait for the next one ({} once the service hung up):
        how an agent's chat completion waits for the actor's reply."""
        self.answer(message)
        return self.next() or {}


def serve(handler: Handler, channel: Channel) -> None:
    while (request := channel.next()) is not None:
        channel.answer(handler(request))


def _reason(error: BaseException) -> str:
    return "".join(traceback.format_exception(error, limit=-3))[-4000:].strip()


def main() -> None:
    sock = _private_channel()
    boot, reply_fd = protocol.receive(sock)
    try:
        isolation = isolate(boot, sock, reply_fd)
    except BaseException as error:  # report why the worker cannot isolate itself, then exit
        reply(reply_fd, {"ok": False, "reason": _reason(error)})
        os._exit(3)
    reply(reply_fd, {"ok": True, "isolation": isolation})
    _, reply_fd = protocol.receive(sock)
    channel = Channel(sock)
    try:
        handler = load(boot, channel)
    except BaseException as error:  # report why the spec cannot load, then exit
        reply(reply_fd, {"ok": False, "reason": _reason(error)})
        os._exit(3)
    reply(reply_fd, {"ok": True, "warnings": LOAD_WARNINGS})
    serve(handler, channel)
    os._exit(0)
