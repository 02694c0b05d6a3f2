"""Zero-copy protobuf wire handling for the two hot RPCs, Insert and Sample.

A stored group is the exact bytes of its `Group` message. Insert therefore splits
the raw InsertRequest into the bytes of each `groups` entry instead of letting
gRPC decode them and re-encoding each group; Sample appends stored bytes as
`groups` entries to a small serialised SampleResponse header (protobuf merges
concatenated messages, and repeated fields append). The result is byte-for-byte
what the generated classes would accept; only the parse/re-encode copies go.
"""

from __future__ import annotations

from fleetrl.errors import InvalidArgument
from fleetrl.proto.fleetrl.v1 import replay_pb2

INSERT_GROUPS_FIELD = replay_pb2.InsertRequest.DESCRIPTOR.fields_by_name["groups"].number
SAMPLE_GROUPS_FIELD = replay_pb2.SampleResponse.DESCRIPTOR.fields_by_name["groups"].number
_WT_VARINT, _WT_I64, _WT_LEN, _WT_I32 = 0, 1, 2, 5


def read_varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    """The varint at data[pos:] and the position after it."""
    result = shift = 0
    while True:
        if pos >= len(data):
            raise InvalidArgument("truncated protobuf message")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise InvalidArgument("malformed varint in protobuf message")


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def split_field(data: bytes, field_number: int) -> list[bytes]:
    """The payloads of every length-delimited entry of `field_number` in a serialised message."""
    out: list[bytes] = []
    view, pos = memoryview(data), 0
    while pos < len(data):
        key, pos = read_varint(view, pos)
        wire_type = key & 7
        if wire_type == _WT_VARINT:
            _, pos = read_varint(view, pos)
        elif wire_type == _WT_LEN:
            size, pos = read_varint(view, pos)
            if pos + size > len(data):
                raise InvalidArgument("truncated protobuf message")
            if key >> 3 == field_number:
                out.append(data[pos:pos + size])
            pos += size
        elif wire_type in (_WT_I64, _WT_I32):
            pos += 8 if wire_type == _WT_I64 else 4
        else:
            raise InvalidArgument(f"unsupported protobuf wire type {wire_type}")
    return out


def append_field(header: bytes, field_number: int, payloads: list[bytes]) -> bytes:
    """header followed by each payload as a length-delimited entry of field_number."""
    tag = encode_varint(field_number << 3 | _WT_LEN)
    parts = [header]
    for payload in payloads:
        parts += (tag, encode_varint(len(payload)), payload)
    return b"".join(parts)
