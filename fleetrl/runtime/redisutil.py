"""Redis clients of every service: redis-py's async client over a pool that forgets a broken path.

A command whose connection times out or breaks leaves that connection closed, and redis-py opens it
again at its next use, but the pool's idle connections were opened over the same path: after a
half-open spell (Redis's host vanished, a middlebox dropped the flows) each of them, taken up later by
a burst of concurrent calls, would wait out one more `socket_timeout` before failing. `client` drops
the idle connections too when one comes back closed, so one call pays for the broken path, not one
per pooled connection.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection, ConnectionPool


class ForgetfulPool(ConnectionPool):
    """A connection pool whose idle connections are closed when a connection comes back closed."""

    async def release(self, connection: AbstractConnection) -> None:
        broken = not connection.is_connected
        await super().release(connection)
        if broken:
            await self.disconnect(inuse_connections=False)


def client(url: str, *, tls_ca_file: Path | None = None, **kwargs: Any) -> aioredis.Redis:
    """`redis.asyncio.Redis.from_url(url, **kwargs)`, over a ForgetfulPool. A `rediss://` URL is TLS, the
    server's certificate and host name checked against tls_ca_file (None: the system's CAs)."""
    if tls_ca_file is not None and urlsplit(url).scheme == "rediss":
        kwargs["ssl_ca_certs"] = str(tls_ca_file)
    return aioredis.Redis.from_pool(ForgetfulPool.from_url(url, **kwargs))
