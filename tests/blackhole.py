"""A TCP proxy that can blackhole its connections: a real network partition between one process and a
server, while everyone else reaches the server directly.

`cut` stops moving bytes both ways and keeps every connection open, as a network that drops packets
does (no RST, no FIN: the client's sockets stay established and its requests get no answer), and
accepts new connections without forwarding them until `heal`. The bytes held during the cut are
delivered after it, as TCP would retransmit them. The proxy's sockets take at most `RECEIVE_BUFFER_BYTES`
from the client: over a network that drops packets nothing reaches the far side, so a client that
keeps writing during the cut fills its own send buffer and then waits, as it would there.

`drop_established` makes the connections open at that moment half-open for good: they stay open and
move no byte more either way, and an end that one side closes is not passed on, as when the peer's host
vanished or a middlebox dropped the flow; new connections are forwarded normally (the service restarted
elsewhere, the route healed). What the proxy cannot show is the kernel's part: its own TCP stack
acknowledges every byte it takes and answers TCP keepalive probes, so only an application's own
deadlines and pings can notice the dead flow, never `SO_KEEPALIVE` or `TCP_USER_TIMEOUT`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

RECEIVE_BUFFER_BYTES = 64 * 1024


class Flow:
    """One proxied connection: bytes move while it is not dropped and the proxy is not cut."""

    dropped: bool

    def __init__(self) -> None:
        self.dropped = False


class Blackhole:
    """A TCP proxy to one upstream that can stop moving bytes (`cut`, `drop_established`) and start
    again (`heal`, for a cut)."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.flows: list[Flow] = []
        self.accepted = 0

    async def start(self) -> int:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)  # accepted ones inherit it
        listener.bind(("127.0.0.1", 0))
        self.server = await asyncio.start_server(self._accept, sock=listener)
        return int(self.server.sockets[0].getsockname()[1])

    def cut(self) -> None:
        self.flowing.clear()

    def heal(self) -> None:
        self.flowing.set()

    def drop_established(self) -> int:
        """Blackhole every connection open now, for good; returns how many."""
        live = [flow for flow in self.flows if not flow.dropped]
        for flow in live:
            flow.dropped = True
        return len(live)

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        await self.flowing.wait()  # a connection made during the cut is held, never answered
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        flow = Flow()
        self.flows.append(flow)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(flow, source, sink))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _pipe(self, flow: Flow, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                await self._moving(flow)  # cut: the bytes wait here, the connection stays open
                sink.write(data)
                await sink.drain()
            await self._moving(flow)  # an end, too, waits out a cut and is never passed on once dropped
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                sink.close()

    async def _moving(self, flow: Flow) -> None:
        """Return when bytes may move on this flow; never, once it is dropped."""
        while flow.dropped or not self.flowing.is_set():
            if flow.dropped:
                await asyncio.Event().wait()  # until the proxy closes
            await self.flowing.wait()
