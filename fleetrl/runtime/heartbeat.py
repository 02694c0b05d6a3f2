"""Heartbeats of fleet members in Redis: who is up and what it is doing, for `fleetrl top`.

Every actor and learner writes its own key `fleetrl:beat:<kind>:<member id>` (JSON) about once a
second with a TTL of a few seconds, so a killed member drops out by itself and nobody has to
deregister it. Readers SCAN the prefix; a fleet has tens of members, not millions. Redis rather
than a NATS KV bucket because a per-key TTL is what makes silence mean "gone".
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Literal

import redis.asyncio as aioredis

PREFIX = "fleetrl:beat:"
INTERVAL_S = 1.0
"""How often a member writes its beat."""
TTL_S = 5.0
"""A member silent for this long is gone."""

Kind = Literal["actor", "learner"]


@dataclass(frozen=True)
class Beat:
    """One member's state as of unix_ms (see FleetMember in gateway.proto for each field)."""

    kind: Kind
    member_id: str
    state: str
    job_id: str = ""
    policy_version: int = 0
    tokens_per_s: float = 0.0
    busy_fraction: float = 0.0
    unix_ms: int = 0
    served_s: dict[str, float] = field(default_factory=dict)
    """Actors: seconds of the last activity window spent on each job's tasks (the tenants' shares in `top`)."""


def key(kind: Kind, member_id: str) -> str:
    return f"{PREFIX}{kind}:{member_id}"


async def write(client: aioredis.Redis, beat: Beat, ttl_s: float = TTL_S) -> None:
    """Record the beat; it expires after ttl_s unless written again."""
    await client.set(key(beat.kind, beat.member_id), json.dumps(asdict(beat)), px=int(ttl_s * 1000))


async def clear(client: aioredis.Redis, kind: Kind, member_id: str) -> None:
    """Drop a member's beat at once (a clean shutdown)."""
    await client.delete(key(kind, member_id))


async def read_all(client: aioredis.Redis) -> list[Beat]:
    """Every live member's last beat, actors first, each kind sorted by id."""
    keys = [k async for k in client.scan_iter(match=PREFIX + "*", count=500)]
    values = await client.mget(keys) if keys else []
    beats = [Beat(**json.loads(v)) for v in values if v is not None]
    return sorted(beats, key=lambda b: (b.kind != "actor", b.member_id))
