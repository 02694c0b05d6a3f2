"""A TCP proxy that can blackhole its connections: a real network partition between one process and a
server, while everyone else reaches the server directly.

`cut` stops moving bytes both ways and keeps every connection open, as a network that drops packets
does (no RST, no FIN: the client's sockets stay established and its requests get no answer), and
accepts new connections without forwarding them until `heal`. The bytes held during the cut are
delivered after it, as TCP would retransmit them. The proxy's sockets take at most `RECEIVE_BUFFER_BYTES`
from the client: over a network that drops packets nothing reaches the far side, so a client that
keeps writing during the cut fills its own send buffer and then waits, as it would there.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

RECEIVE_BUFFER_BYTES = 64 * 1024


class Blackhole:
    """A TCP proxy to one upstream that can stop moving bytes (`cut`) and start again (`heal`)."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

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

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.flowing.wait()  # a connection made during the cut is held, never answered
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(source, sink))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                await self.flowing.wait()  # cut: the bytes wait here, the connection stays open
                sink.write(data)
                await sink.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                sink.close()
