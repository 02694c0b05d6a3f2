"""Length-prefixed JSON frames between the reward service and its sandboxed workers.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON. JSON is the only
encoding in both directions, so the service never unpickles anything a worker produced; a frame
nested too deeply to parse, holding an integer too long to convert, or holding text that is not
valid Unicode (a lone surrogate, which JSON's escapes can carry but protobuf refuses) is a
ProtocolError like any other malformed frame, so it fails only the item it answers.

Requests travel on a Unix socket (the worker's stdin, which the worker shuts for writing); each
request carries, as SCM_RIGHTS ancillary data on one marker byte before its frame, the write end of
a pipe made for that request alone, and the reply is the one frame on that pipe before it closes.
The service reads nothing else: a frame user code writes anywhere else reaches no reader, a pipe of
an earlier request is closed, and a second frame on the current one makes that item an error.
This module is stdlib-only because it is imported inside the worker before any isolation is in place.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
from typing import Any

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 * 1024 * 1024


class ProtocolError(Exception):
    """A frame is malformed, oversized or truncated."""


def encode(message: dict[str, Any]) -> bytes:
    """One frame carrying message."""
    body = json.dumps(message, separators=(",", ":")).encode()
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> dict[str, Any]:
    """The message of a frame body; ProtocolError unless it is a JSON object."""
    try:
        message = json.loads(body)
        _check_text(message)
    except (UnicodeDecodeError, UnicodeEncodeError) as error:
        raise ProtocolError(f"frame holds text that is not valid Unicode: {error.reason}") from None
    except ValueError as error:  # JSONDecodeError, and an integer past Python's digit limit
        raise ProtocolError(f"frame is not JSON: {str(error)[:200]}") from None
    except RecursionError:
        raise ProtocolError("frame is nested too deeply") from None
    if not isinstance(message, dict):
        raise ProtocolError("frame is not a JSON object")
    return message


def finite_number(value: Any) -> float | None:
    """value as a float when it is a finite int or float (not a bool), else None; an int too large for a
    float is not finite. Worker and service check rewards with this one rule."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _check_text(value: Any) -> None:
    """UnicodeEncodeError when any string of a decoded frame (key or value) cannot be encoded as UTF-8."""
    if isinstance(value, str):
        value.encode()
    elif isinstance(value, dict):
        for key, item in value.items():
            key.encode()
            _check_text(item)
    elif isinstance(value, list):
        for item in value:
            _check_text(item)


def _read_exact(fd: int, size: int) -> bytes:
    chunks: list[bytes] = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            raise EOFError("peer closed the pipe")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def read_fd(fd: int) -> dict[str, Any]:
    """Read one frame from a blocking file descriptor (worker side)."""
    (size,) = HEADER.unpack(_read_exact(fd, HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
    return decode(_read_exact(fd, size))


def write_fd(fd: int, message: dict[str, Any]) -> None:
    """Write one frame to a blocking file descriptor (worker side)."""
    data = memoryview(encode(message))
    while data:
        data = data[os.write(fd, data):]


def send_request(sock: socket.socket, reply_fd: int) -> None:
    """Send the marker byte carrying reply_fd (the request's frame follows on the same socket)."""
    socket.send_fds(sock, [b"R"], [reply_fd])


def receive(sock: socket.socket) -> tuple[dict[str, Any], int]:
    """The next request and the descriptor its reply goes to (worker side); EOFError when the service
    has closed the socket, ProtocolError when a request came without its descriptor."""
    marker, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if not marker:
        raise EOFError("the service closed the socket")
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ProtocolError("a request came without its reply descriptor")
    return read_fd(sock.fileno()), fds[0]
