"""NATS's and Redis's credentials: one format, made in one place, for every way the fleet runs.

A credentials file holds a user on its first line and a password on its second (`fleetrl.spec.config
.read_credentials` reads it; `InfraSettings.nats_credentials_file` and `redis_credentials_file` put it into
the URLs). Each server is given its side as a line of its own configuration (`nats_authorization`,
`redis_requirepass`), in a file, never on a command line. Who makes them:

- `fleetrl up` / `fleetrl infra`: `Credentials.for_run`, once per run directory (mode 0600), for the
  embedded servers (`fleetrl.launcher.embedded`).
- docker compose: `fleetrl secrets DIR`, a one-shot service before NATS and Redis start, writes both
  clients' files and both servers' configuration (`nats-auth.conf`, included by deploy/compose/nats.conf;
  `redis.conf`, given to redis-server) into the volume at DIR. Files that exist are kept, so a restarted
  fleet keeps its passwords; delete the volume to rotate them. They are readable by every user (0644):
  the Redis image runs its server as its own user, while this runs as root. Only the fleet's containers
  mount the volume; the reward service, which runs user code, does not.
- Kubernetes: `fleetrl secrets --kubernetes NAME` prints the same four files as a Secret
  (`fleetrl secrets --kubernetes fleetrl-infra | kubectl create -f -`), for deploy/k8s.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from fleetrl.spec.config import read_credentials

NATS_USER = "fleetrl"
REDIS_USER = "default"
"""Redis's built-in user, the one `requirepass` sets the password of."""


@dataclass(frozen=True)
class Credentials:
    """A user and its password."""

    user: str
    password: str

    @classmethod
    def new(cls, user: str) -> Credentials:
        """A random, URL-safe password for user."""
        return cls(user, secrets.token_urlsafe(24))

    @classmethod
    def for_run(cls, path: Path, user: str) -> Credentials:
        """The credentials stored at path, made the first time (mode 0600), so a restarted server and its
        clients keep agreeing."""
        if path.exists():
            return cls(*read_credentials(path))
        path.parent.mkdir(parents=True, exist_ok=True)
        made = cls.new(user)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(made.file_text())
        return made

    def file_text(self) -> str:
        """The credentials file's text."""
        return f"{self.user}\n{self.password}\n"


def nats_authorization(login: Credentials) -> str:
    """The nats-server configuration line every client must log in by."""
    return f'authorization {{ user: "{login.user}", password: "{login.password}" }}\n'


def redis_requirepass(login: Credentials) -> str:
    """The Redis (or Valkey) configuration line that sets its default user's password."""
    return f'requirepass "{login.password}"\n'


def server_files(nats: Credentials, redis: Credentials) -> dict[str, str]:
    """The four files of a compose volume or Kubernetes Secret, by name: each client's credentials and each
    server's configuration of them."""
    return {"nats": nats.file_text(), "redis": redis.file_text(),
            "nats-auth.conf": nats_authorization(nats), "redis.conf": redis_requirepass(redis)}


def write_once(directory: Path) -> list[str]:
    """The files written into directory (none when every one is there already: the passwords stay)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = server_files(Credentials.new(NATS_USER), Credentials.new(REDIS_USER))
    if all((directory / name).exists() for name in files):
        return []
    for name, text in files.items():  # all four again: a half-written set would disagree with itself
        tmp = directory / f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, directory / name)
    return sorted(files)


def kubernetes_secret(name: str) -> str:
    """A Secret manifest (JSON, which kubectl reads) holding the four files under their names."""
    files = server_files(Credentials.new(NATS_USER), Credentials.new(REDIS_USER))
    return json.dumps({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                       "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "fleetrl"}},
                       "stringData": files}, indent=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleetrl secrets", description="make NATS's and Redis's credentials "
                                     "for docker compose (into DIR, once) or Kubernetes (a Secret, printed)")
    parser.add_argument("dir", type=Path, nargs="?", help="where to write the files (docker compose's volume)")
    parser.add_argument("--kubernetes", metavar="NAME", help="print a Kubernetes Secret of this name instead")
    args = parser.parse_args(argv)
    if args.kubernetes:
        print(kubernetes_secret(args.kubernetes))
        return 0
    if args.dir is None:
        parser.error("give a directory, or --kubernetes NAME")
    written = write_once(args.dir)
    print(f"wrote {', '.join(written)} to {args.dir}" if written else f"kept the credentials in {args.dir}",
          file=sys.stderr)
    return 0
