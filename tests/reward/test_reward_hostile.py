"""Reward files written to break out, against a real reward service run as root and as an ordinary user.

Each file tries one family of escapes from the security issue (files by dir_fd, mkfifo and start-up
files; the service's secrets, run dir and log; /proc/<pid>/mem and signals; the audit hook switched
off, then fork, exec, ctypes and sockets of every kind; forged and deeply nested reply frames). It
returns which attempts worked, or raises when every one was refused: so each item must score as an
error within timeout + 1 s, with no byte of the planted secret in its result, nothing changed in
the planted directory, no connection on the planted listeners, the canary process and the service
alive, and the next benign batch right. The service is one process per mode for the whole module;
as an ordinary user it runs as `fleettest` (created with useradd when the tests run as root), in a
mount namespace that exposes the Python installation under a private /root and nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fleetrl.launcher.embedded import free_port, wait_for_port
from fleetrl.proto.fleetrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from fleetrl.runtime.grpcutil import channel
from tests.reward.conftest import (
    ROOT,
    UID_BASE,
    descendants,
    file_spec,
    items,
    launcher,
    sandbox_uid_processes,
    subreaper,
    wait_gone,
)

OK, ERROR = common_pb2.REWARD_STATUS_OK, common_pb2.REWARD_STATUS_ERROR
TIMEOUT_S = 1.0
LOAD_TIMEOUT_S = 4.0
BENIGN = "def reward(completion, prompt, **meta):\n    return float(completion.strip() == meta['answer'])\n"

TEMPLATE = """
import os, socket, stat, sys, signal, struct, json
WON = []

def attempt(name, fn):
    try:
        fn()
    except BaseException:
        return
    WON.append(name)

def reward(completion, prompt, **m):
    WON.clear()
    run(m)
    if WON:
        return {{name: 1.0 for name in WON}}
    raise PermissionError("every attempt was refused")

def hook_off():
    guard = sys.modules.get("fleetrl.reward.guard")
    if guard is not None:
        guard.DENIED_EVENTS = ("no-such-event",)
        guard.PATH_EVENTS.clear()

def pipes():
    return [int(fd) for fd in os.listdir("/proc/self/fd")
            if int(fd) > 2 and stat.S_ISFIFO(os.fstat(int(fd)).st_mode)]

{body}
"""

ATTACKS = {
    "files": """
def run(m):
    hook_off()
    plant, open_dir = m["plant"], m["plant"] + "/open"
    def by_dir_fd(base, name):
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
        os.close(os.open(name, os.O_WRONLY | os.O_CREAT, 0o666, dir_fd=fd))
    attempt("dir_fd_root", lambda: by_dir_fd("/", open_dir.lstrip("/") + "/escape-root"))
    attempt("dir_fd_open", lambda: by_dir_fd(open_dir, "escape-open"))
    attempt("mkfifo", lambda: os.mkfifo("fifo", dir_fd=os.open(open_dir, os.O_RDONLY)))
    attempt("bashrc", lambda: open(m["home"] + "/.bashrc", "a").write("touch /tmp/pwned\\n"))
    attempt("unlink", lambda: os.unlink(open_dir + "/victim"))
    attempt("rename", lambda: os.rename(open_dir + "/victim", open_dir + "/moved"))
    attempt("write_open", lambda: open(open_dir + "/victim", "a").write("x"))
""",
    "read_secrets": """
def run(m):
    hook_off()
    for name, path in (("key", m["plant"] + "/secret.key"), ("log", m["plant"] + "/run/reward.log"),
                       ("bashrc", m["home"] + "/.bashrc"), ("environ", f"/proc/{m['service_pid']}/environ"),
                       ("cmdline", f"/proc/{m['service_pid']}/cmdline"), ("run_dir", m["plant"] + "/run")):
        attempt(name, lambda: os.listdir(path) if name == "run_dir" else open(path, "rb").read(1))
""",
    "proc_mem": """
def run(m):
    hook_off()
    targets = {int(p) for p in os.listdir("/proc") if p.isdigit()} | {m["service_pid"], m["canary_pid"]}
    for pid in targets - {os.getpid()}:
        attempt(f"mem_{pid}", lambda: open(f"/proc/{pid}/mem", "r+b").write(b"\\xcc"))
        attempt(f"environ_{pid}", lambda: open(f"/proc/{pid}/environ", "rb").read(1) or 1 / 0)
""",
    "signals": """
def run(m):
    hook_off()
    attempt("service", lambda: os.kill(m["service_pid"], signal.SIGSTOP))
    attempt("canary", lambda: os.kill(m["canary_pid"], signal.SIGKILL))
    attempt("everyone", lambda: os.kill(-1, signal.SIGKILL))
""",
    "fork_exec_ctypes": """
def run(m):
    hook_off()
    def fork():
        if os.fork() == 0:
            os._exit(0)
    def spawn():
        import subprocess
        subprocess.run(["/bin/sh", "-c", "touch " + m["plant"] + "/open/spawned"], check=True)
    def ctypes_fork():
        import ctypes
        pid = ctypes.CDLL(None).fork()
        if pid == 0:
            os._exit(0)
        if pid < 0:
            raise OSError("fork refused")
    def ctypes_ptrace():
        import ctypes
        if ctypes.CDLL(None).ptrace(16, m["canary_pid"], 0, 0) != 0:  # PTRACE_ATTACH
            raise OSError("ptrace refused")
    attempt("fork", fork)
    attempt("subprocess", spawn)
    attempt("ctypes_fork", ctypes_fork)
    attempt("ctypes_ptrace", ctypes_ptrace)
""",
    "sockets": """
def run(m):
    hook_off()
    def connect(family, address):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.5)
            sock.connect(address)
    attempt("tcp", lambda: connect(socket.AF_INET, ("127.0.0.1", m["port"])))
    attempt("unix_fs", lambda: connect(socket.AF_UNIX, m["plant"] + "/open/sock"))
    attempt("unix_abstract", lambda: connect(socket.AF_UNIX, "\\0" + m["abstract"]))
""",
    "forge_reply": """
def run(m):
    forged = json.dumps({"value": 99.0}).encode()
    for fd in pipes():
        for _ in range(3):
            attempt(f"pipe_{fd}", lambda: os.write(fd, struct.pack(">I", len(forged)) + forged))
    WON.clear()  # writing is allowed (the pipe is this item's); what counts is the score it gets
""",
    "nested_reply": """
def run(m):
    nested = b"[" * 200_000 + b"]" * 200_000
    for fd in pipes():
        attempt(f"pipe_{fd}", lambda: os.write(fd, struct.pack(">I", len(nested)) + nested))
    WON.clear()
""",
}


@dataclass
class Hostile:
    """A running reward service and what the attacks aim at."""

    mode: str
    port: int
    proc: subprocess.Popen[bytes]
    plant: Path
    secret: str
    canary: subprocess.Popen[bytes]
    listeners: list[socket.socket]
    abstract: str
    uid: int

    def meta(self) -> dict[str, object]:
        return {"plant": str(self.plant), "home": str(self.plant / "home"), "service_pid": self.proc.pid,
                "canary_pid": self.canary.pid, "port": self.listeners[0].getsockname()[1], "abstract": self.abstract}


def snapshot(plant: Path) -> dict[str, bytes]:
    """Every file under plant but the service's log (which grows), with its contents."""
    out = {}
    for path in sorted(plant.rglob("*")):
        if path.is_file() and path.name != "reward.log":
            out[str(path.relative_to(plant))] = path.read_bytes()
        elif not path.is_file():
            out[str(path.relative_to(plant))] = b"<dir or socket>"
    return out


def make_plant(uid: int, gid: int) -> Path:
    plant = Path(tempfile.mkdtemp(prefix="fleetrl-hostile-"))
    for sub, mode in (("home", 0o700), ("run", 0o700), ("open", 0o777)):
        (plant / sub).mkdir()
        (plant / sub).chmod(mode)
    (plant / "home" / ".bashrc").write_text("# the service user's shell start-up file\n")
    (plant / "open" / "victim").write_text("a file any uid may change\n")
    for path in (plant, plant / "home", plant / "home" / ".bashrc", plant / "run"):
        os.chown(path, uid, gid)
    plant.chmod(0o755)
    return plant


@contextlib.contextmanager
def listeners(plant: Path, abstract: str) -> Iterator[list[socket.socket]]:
    tcp = socket.create_server(("127.0.0.1", 0))
    unix_fs = socket.socket(socket.AF_UNIX)
    unix_fs.bind(str(plant / "open" / "sock"))
    os.chmod(plant / "open" / "sock", 0o777)
    unix_abstract = socket.socket(socket.AF_UNIX)
    unix_abstract.bind("\0" + abstract)
    socks = [tcp, unix_fs, unix_abstract]
    for sock in socks:
        sock.listen()
        sock.setblocking(False)
    try:
        yield socks
    finally:
        for sock in socks:
            sock.close()


def accepted(socks: list[socket.socket]) -> list[str]:
    out = []
    for sock in socks:
        with contextlib.suppress(BlockingIOError):
            conn, _ = sock.accept()
            conn.close()
            out.append(str(sock.getsockname()))
    return out


@pytest.fixture(scope="module", params=["root", "user"])
def hostile(request: pytest.FixtureRequest) -> Iterator[Hostile]:
    prefix, uid, gid = launcher(request.param)
    plant = make_plant(uid, gid)
    secret = f"secret-{uuid.uuid4().hex}"
    key = plant / "secret.key"
    key.write_text(secret)
    os.chown(key, uid, gid)
    key.chmod(0o600)
    abstract = f"fleetrl-hostile-{uuid.uuid4().hex}"
    port = free_port()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(plant / "home"),
           "FLEETRL_TEST_SECRET": secret, "PYTHONPATH": str(ROOT)}
    argv = [*prefix, sys.executable, "-m", "fleetrl.services.reward", "--listen", f"127.0.0.1:{port}", "--workers", "1",
            "--set", f"sandbox_uid_base={UID_BASE}", "--set", f"run_dir={plant / 'run'}",
            "--set", "burst_workers_per_pool=0", "--set", "worker_start_timeout_s=10",
            "--set", f"worker_load_timeout_s={LOAD_TIMEOUT_S:g}"]
    before = set(descendants())  # servers that other tests' session fixtures keep running
    with subreaper():  # what the service leaves behind when it exits stays a descendant of this process
        canary = subprocess.Popen([*prefix, sys.executable, "-I", "-c", "import time; time.sleep(3600)"], env=env)
        with listeners(plant, abstract) as socks, open(plant / "run" / "reward.log", "wb") as log:
            os.chown(plant / "run" / "reward.log", uid, gid)
            proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=log)
            try:
                wait_for_port("127.0.0.1", port, 60.0, proc)
                yield Hostile(request.param, port, proc, plant, secret, canary, socks, abstract, uid)
            finally:
                proc.terminate()
                proc.wait(30)
                canary.kill()
                canary.wait()
        # Every process the service started, whatever its uid (the ordinary user's processes may be another
        # suite's, run from a second checkout), and any of this process's own sandbox uid range (UID_BASE).
        # 10 s: the workers die with the service, and a loaded machine took more than 2 s to reap tens of them.
        left = wait_gone(lambda: sorted(set(descendants()) - before) + sandbox_uid_processes(), within_s=10.0)
    log_text = (plant / "run" / "reward.log").read_text()
    shutil.rmtree(plant)
    assert proc.returncode == 0, log_text[-3000:]
    assert "mode jail: bwrap mountns pidns netns seccomp hold; missing: none" in log_text, log_text[-3000:]
    assert left == [], f"processes left behind: {left}"


@pytest.mark.parametrize("attack", sorted(ATTACKS))
async def test_hostile_reward_file_is_refused(attack: str, hostile: Hostile) -> None:
    async with channel(f"127.0.0.1:{hostile.port}") as chan:
        await check_refused(attack, hostile, reward_pb2_grpc.RewardServiceStub(chan))


async def check_refused(attack: str, hostile: Hostile, stub: reward_pb2_grpc.RewardServiceStub) -> None:
    spec = file_spec(TEMPLATE.format(body=ATTACKS[attack]), timeout_s=TIMEOUT_S)
    validated = await stub.Validate(reward_pb2.ValidateRequest(spec=spec), timeout=30)
    assert validated.ok, validated.reason
    before = snapshot(hostile.plant)
    start = time.monotonic()
    reply = await stub.Score(reward_pb2.ScoreRequest(
        job_id="j", spec=spec, items=items(("x", hostile.meta()), ("y", hostile.meta()))), timeout=30)
    assert time.monotonic() - start < TIMEOUT_S + 1.0
    for result in reply.results:
        assert result.status == ERROR and result.reward == 0.0, (hostile.mode, attack, result)
        assert hostile.secret not in result.reason and not result.components, (hostile.mode, attack, result)
    assert snapshot(hostile.plant) == before, f"{attack} changed the planted files"
    assert accepted(hostile.listeners) == [], f"{attack} reached a listener"
    assert hostile.canary.poll() is None, "the canary process was killed"
    benign = await stub.Score(reward_pb2.ScoreRequest(
        job_id="j", spec=file_spec(BENIGN), items=items(("57", {"answer": "57"}), ("5", {"answer": "57"}))),
        timeout=30)
    assert [(r.status, r.reward) for r in benign.results] == [(OK, 1.0), (OK, 0.0)]
    assert hostile.proc.poll() is None and _state(hostile.proc.pid) != "T", "the service was killed or stopped"


SLOW_IMPORT = "import time\ntime.sleep(60)\ndef reward(completion, prompt, **meta):\n    return 1.0\n"


async def test_slow_import_scores_errors_within_the_item_timeout(hostile: Hostile) -> None:
    """A reward file whose top-level code sleeps holds no Score call past its items' timeout + 1 s (each item
    an error naming the load), another job is served meanwhile, and Validate fails at the load deadline."""
    async with channel(f"127.0.0.1:{hostile.port}") as chan:
        stub = reward_pb2_grpc.RewardServiceStub(chan)
        benign = reward_pb2.ScoreRequest(job_id="b", spec=file_spec(BENIGN), items=items(("57", {"answer": "57"})))
        await stub.Score(benign, timeout=30)  # the other job's pool up
        slow = reward_pb2.ScoreRequest(job_id="j", spec=file_spec(SLOW_IMPORT, timeout_s=TIMEOUT_S),
                                       items=items(("x", {}), ("y", {})))
        for _ in range(2):  # the second call finds the load still going
            start = time.monotonic()
            scoring = asyncio.ensure_future(stub.Score(slow, timeout=30))
            await asyncio.sleep(0.1)
            other = await stub.Score(benign, timeout=30)
            assert time.monotonic() - start < 0.6, "another job's call waited for the slow load"
            assert [(r.status, r.reward) for r in other.results] == [(OK, 1.0)]
            reply = await scoring
            assert time.monotonic() - start < TIMEOUT_S + 1.0
            for result in reply.results:
                assert result.status == ERROR and result.reward == 0.0, (hostile.mode, result)
                assert "not loaded within the item timeout 1s" in result.reason, (hostile.mode, result.reason)
        start = time.monotonic()
        validated = await stub.Validate(reward_pb2.ValidateRequest(spec=slow.spec), timeout=30)
        assert not validated.ok and f"did not load within {LOAD_TIMEOUT_S:g}s" in validated.reason, validated.reason
        assert time.monotonic() - start < LOAD_TIMEOUT_S + 1.0


CRASH_EVERY_ITEM = "import os\ndef reward(completion, prompt, **meta):\n    os._exit(1)\n"


async def test_a_reward_file_killing_its_worker_on_every_item_is_rate_limited(hostile: Hostile) -> None:
    """Its pool starts at most worker_respawn_burst (8) workers back to back, then 2 a second; the other
    items fail at once naming the back-off, and another job is served right after."""
    async with channel(f"127.0.0.1:{hostile.port}") as chan:
        stub = reward_pb2_grpc.RewardServiceStub(chan)
        start = time.monotonic()
        reply = await stub.Score(reward_pb2.ScoreRequest(
            job_id="j", spec=file_spec(CRASH_EVERY_ITEM, timeout_s=TIMEOUT_S), items=items(*[("x", {})] * 30)),
            timeout=30)
        elapsed = time.monotonic() - start
        killed = [r for r in reply.results if r.status == common_pb2.REWARD_STATUS_KILLED]
        refused = [r for r in reply.results if r.status == ERROR]
        assert len(killed) + len(refused) == 30 and all(r.reward == 0.0 for r in reply.results)
        assert len(killed) <= 1 + 8 + 2 * elapsed + 1, (hostile.mode, len(killed), elapsed)
        assert refused and all("reward pool backing off" in r.reason for r in refused), refused[:1]
        assert elapsed < 5.0, elapsed
        benign = await stub.Score(reward_pb2.ScoreRequest(
            job_id="b", spec=file_spec(BENIGN), items=items(("57", {"answer": "57"}))), timeout=30)
        assert [(r.status, r.reward) for r in benign.results] == [(OK, 1.0)]


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
