"""Receive one JetStream push consumer's messages straight into a caller's buffer.

Design choice: a weight pull is hundreds of MB in 1 MiB messages, and nats-py reads its socket
32 KiB at a time and copies each payload about five times (asyncio's stream buffer, the read slice,
the parser's buffer, a slice of it and its bytes) before the application sees it. `ChunkReader` is an
`asyncio.BufferedProtocol` on a connection of its own: the event loop `recv_into`s each payload at
its place in the destination, so the kernel's copy is the only one. It speaks just the part of the
client protocol a subscriber needs (INFO, CONNECT with the URL's credentials, SUB, PING/PONG,
MSG/HMSG, -ERR) and no reconnect (a lost connection fails the read with Unavailable; the caller
pulls again). Flow-control requests are answered, heartbeats skipped. A server that requires TLS gets
it as NATS does it (INFO in the clear, then the handshake), with nc's SSL context and host name;
asyncio's TLS layer decrypts each payload straight into the destination too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import ParseResult

import nats.aio.client

from fleetrl.errors import Unavailable

SCRATCH_BYTES = 64 * 1024
"""Control lines and status headers land here; message data goes to the destination."""
MAX_CONTROL_LINE = 4096
_SID = b"1"
_STALLED = b"nats-consumer-stalled:"


class ChunkReader(asyncio.BufferedProtocol):
    """The data of one subscription's messages, back to back in a buffer, until num_pending is 0.

    `filled` counts the bytes of whole messages written. The read is `done` after the first message
    whose ack reply says none are pending, or once a message does not fit (`overrun`)."""

    filled: int
    ended: bool
    overrun: bool
    _view: memoryview
    _scratch: bytearray
    _start: int
    _end: int
    _size: int
    _last: bool
    _data_left: int
    _skip: int
    _closed: bool
    _transport: asyncio.Transport | None
    _server_info: dict[str, Any] | None
    _ponged: bool
    _changed: asyncio.Event
    _error: Exception | None

    def __init__(self, buffer: memoryview) -> None:
        self._view = buffer
        self._scratch = bytearray(SCRATCH_BYTES)
        self._start = self._end = 0  # unparsed bytes: _scratch[_start:_end]
        self._size, self._last = 0, False  # the message whose data is under way
        self._data_left = 0  # of its data, still to come straight into _view
        self._skip = 0  # bytes to drop before the next control line (a CRLF, an unwanted payload)
        self.filled, self.ended, self.overrun, self._closed = 0, False, False, False
        self._transport, self._error = None, None
        self._server_info, self._ponged = None, False
        self._changed = asyncio.Event()

    @property
    def done(self) -> bool:
        return self.ended or self.overrun

    async def wait(self, stall_s: float | None = None) -> None:
        """Until a message arrived since the last call or the read ended; TimeoutError after stall_s."""
        await asyncio.wait_for(self._changed.wait(), stall_s)
        self._changed.clear()
        if self._error is not None:
            raise self._error

    async def subscribe(self, url: ParseResult, inbox: str, tls: ssl.SSLContext, tls_hostname: str) -> None:
        """Await INFO (then the TLS handshake, when the server requires it), send CONNECT + SUB + PING; the
        PONG confirms the subscription is registered."""
        while self._server_info is None:
            await self.wait()
        if self._server_info.get("tls_required"):
            await self._start_tls(tls, tls_hostname)
        options: dict[str, Any] = {
            "verbose": False, "pedantic": False, "headers": True, "no_responders": True, "protocol": 1,
            "lang": "python", "version": "fleetrl", "name": "fleetrl-chunk-reader",
        }
        if url.username and url.password:
            options |= {"user": url.username, "pass": url.password}
        elif url.username:
            options["auth_token"] = url.username
        self._write(b"CONNECT " + json.dumps(options).encode() + b"\r\nSUB " + inbox.encode() + b" 1\r\nPING\r\n")
        while not self._ponged:
            await self.wait()

    async def _start_tls(self, context: ssl.SSLContext, hostname: str) -> None:
        if self._transport is None:
            raise Unavailable("NATS connection lost before its TLS handshake")
        try:
            transport = await asyncio.get_running_loop().start_tls(self._transport, self, context,
                                                                     server_hostname=hostname)
        except (OSError, ConnectionError) as error:  # ssl.SSLError, a failed certificate check among them
            raise Unavailable(f"TLS handshake with NATS failed: {error}") from error
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def close(self) -> None:
        self._closed = True
        self._view = memoryview(bytearray())  # the transport keeps this protocol a while; not the buffer
        if self._transport is not None:
            self._transport.close()

    # ------------------------------------------------------------- protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if not self._closed:
            self._fail(Unavailable(f"NATS connection lost while reading chunks: {exc or 'EOF'}"))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._data_left:
            end = self.filled + self._size
            return self._view[end - self._data_left : end]
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._scratch):
            unparsed = self._end - self._start
            self._scratch[:unparsed] = self._scratch[self._start : self._end]
            self._start, self._end = 0, unparsed
        return memoryview(self._scratch)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._data_left:
            self._data_left -= nbytes
            if not self._data_left:
                self._end_data()
            return
        self._end += nbytes
        try:
            self._parse()
        except (Unavailable, ValueError, IndexError) as error:
            self._fail(error if isinstance(error, Unavailable) else Unavailable(f"bad NATS protocol: {error}"))

    # -------------------------------------------------------------- parsing

    def _parse(self) -> None:
        """Handle the control lines (with their headers) in scratch until a payload is under way."""
        while not self._data_left and self._error is None:
            if self._skip:
                step = min(self._skip, self._end - self._start)
                self._start += step
                self._skip -= step
                if self._skip:
                    return
            eol = self._scratch.find(b"\r\n", self._start, self._end)
            if eol < 0:
                if self._end - self._start > MAX_CONTROL_LINE:
                    raise Unavailable(f"NATS sent a control line over {MAX_CONTROL_LINE} bytes")
                return
            if not self._control(bytes(self._scratch[self._start : eol]), eol + 2):
                return

    def _control(self, line: bytes, after: int) -> bool:
        """Act on one control line; False while its message's headers are not all in scratch yet."""
        op, _, args = line.partition(b" ")
        op = op.upper()
        if op in (b"MSG", b"HMSG"):
            return self._message(args.split(), op == b"HMSG", after)
        self._start = after
        if op == b"PING":
            self._write(b"PONG\r\n")
        elif op == b"PONG":
            self._ponged = True
            self._changed.set()
        elif op == b"INFO":
            self._server_info = self._server_info or json.loads(args)
            self._changed.set()
        elif op == b"-ERR":
            raise Unavailable(f"NATS error: {args.decode(errors='replace')}")
        elif op != b"+OK":
            raise Unavailable(f"unexpected NATS protocol line {line[:80]!r}")
        return True

    def _message(self, args: list[bytes], has_headers: bool, after: int) -> bool:
        """`MSG <subject> <sid> [reply] <size>` or `HMSG <subject> <sid> [reply] <header size> <size>`."""
        header_size = int(args[-2]) if has_headers else 0
        data_size = int(args[-1]) - header_size
        if after + header_size > self._end:
            if header_size > SCRATCH_BYTES - MAX_CONTROL_LINE:
                raise Unavailable(f"NATS message headers of {header_size} bytes")
            return False
        reply = args[2] if len(args) == (5 if has_headers else 4) else b""
        header = bytes(self._scratch[after : after + header_size])
        self._start = after + header_size
        if args[1] != _SID or header[8:9] == b" ":  # "NATS/1.0 100 ...": a status, not data
            self._status(reply, header)
            self._skip = data_size + 2
        elif self.filled + data_size > len(self._view):
            self.overrun = True
            self._skip = data_size + 2
            self._changed.set()
        else:
            self._begin_data(data_size, _num_pending(reply) == 0)
        return True

    def _begin_data(self, size: int, last: bool) -> None:
        """Copy what scratch holds of the data; the kernel writes the rest via get_buffer."""
        self._size, self._last = size, last
        have = min(size, self._end - self._start)
        self._view[self.filled : self.filled + have] = self._scratch[self._start : self._start + have]
        self._start += have
        self._data_left = size - have
        if not self._data_left:
            self._end_data()

    def _end_data(self) -> None:
        self.filled += self._size
        self.ended = self.ended or self._last
        self._skip = 2  # the CRLF after the payload
        self._changed.set()

    def _status(self, reply: bytes, header: bytes) -> None:
        """Answer a flow-control request (a status with a reply) and a stalled-consumer heartbeat."""
        if reply:
            self._write(b"PUB " + reply + b" 0\r\n\r\n")
        for line in header.split(b"\r\n"):
            if line.lower().startswith(_STALLED):
                self._write(b"PUB " + line[len(_STALLED) :].strip() + b" 0\r\n\r\n")

    def _write(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)

    def _fail(self, error: Exception) -> None:
        if self._error is None:
            self._error = error
        self._changed.set()
        self.close()


def _num_pending(reply: bytes) -> int:
    """The num_pending token of a JetStream ack reply ($JS.ACK.<stream>.<consumer>.<delivered>.<sseq>
    .<cseq>.<ts>.<pending>, or the 11/12-token form with domain and account hash)."""
    tokens = reply.split(b".")
    if tokens[:2] != [b"$JS", b"ACK"] or len(tokens) not in (9, 11, 12):
        raise Unavailable(f"chunk without a JetStream ack reply: {reply[:80]!r}")
    return int(tokens[8] if len(tokens) == 9 else tokens[10])


@contextlib.asynccontextmanager
async def chunk_reader(nc: nats.aio.client.Client, buffer: memoryview, inbox: str) -> AsyncIterator[ChunkReader]:
    """A ChunkReader on its own connection to nc's current server, subscribed to `inbox`; closed on exit."""
    url = nc.connected_url
    if url is None or url.hostname is None:
        raise Unavailable("NATS is not connected")
    loop = asyncio.get_running_loop()
    try:
        _, reader = await loop.create_connection(lambda: ChunkReader(buffer), url.hostname, url.port or 4222)
    except OSError as error:
        raise Unavailable(f"cannot connect to NATS at {url.hostname}:{url.port}: {error}") from error
    try:
        await reader.subscribe(url, inbox, nc.ssl_context, nc.options.get("tls_hostname") or url.hostname)
        yield reader
    finally:
        reader.close()
