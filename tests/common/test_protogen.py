"""The committed gRPC stubs are what the .proto files generate, and every element of the protos is documented."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc_tools
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from fleetrl.runtime import protogen

# Field numbers of the descriptor.proto fields that make up a SourceCodeInfo location path.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE = 4, 5, 6
_MESSAGE_FIELD, _MESSAGE_NESTED, _MESSAGE_ENUM, _MESSAGE_ONEOF = 2, 3, 4, 8
_ENUM_VALUE, _SERVICE_METHOD = 2, 2

Path_ = tuple[int, ...]


def test_committed_stubs_are_fresh() -> None:
    assert protogen.stale_files() == [], "run `python -m fleetrl.runtime.protogen` and commit the stubs"


def _descriptor_set(tmp_path: Path) -> descriptor_pb2.FileDescriptorSet:
    """Every .proto under protos/ compiled by protoc, with its comments (source info) kept."""
    out = tmp_path / "protos.pb"
    protos = sorted(str(p.relative_to(protogen.PROTO_DIR)) for p in protogen.PROTO_DIR.rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{protogen.PROTO_DIR}", f"-I{include}", "--include_source_info",
            f"--descriptor_set_out={out}", *protos]
    assert protoc.main(args) == 0, f"protoc failed on {protos}"
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _enum_elements(enum: descriptor_pb2.EnumDescriptorProto, path: Path_, name: str) -> Iterator[tuple[Path_, str]]:
    yield path, f"enum {name}"
    for i, value in enumerate(enum.value):
        yield (*path, _ENUM_VALUE, i), f"enum value {name}.{value.name}"


def _message_elements(msg: descriptor_pb2.DescriptorProto, path: Path_, name: str) -> Iterator[tuple[Path_, str]]:
    yield path, f"message {name}"
    for i, fld in enumerate(msg.field):
        if not msg.options.map_entry:  # a map field's synthetic entry message has no source of its own
            yield (*path, _MESSAGE_FIELD, i), f"field {name}.{fld.name}"
    for i, oneof in enumerate(msg.oneof_decl):
        yield (*path, _MESSAGE_ONEOF, i), f"oneof {name}.{oneof.name}"
    for i, nested in enumerate(msg.nested_type):
        if not nested.options.map_entry:
            yield from _message_elements(nested, (*path, _MESSAGE_NESTED, i), f"{name}.{nested.name}")
    for i, enum in enumerate(msg.enum_type):
        yield from _enum_elements(enum, (*path, _MESSAGE_ENUM, i), f"{name}.{enum.name}")


def _elements(file: descriptor_pb2.FileDescriptorProto) -> Iterator[tuple[Path_, str]]:
    """(source path, readable name) of every service, RPC, message, field, oneof, enum and enum value."""
    for i, service in enumerate(file.service):
        yield (_FILE_SERVICE, i), f"service {service.name}"
        for j, method in enumerate(service.method):
            yield (_FILE_SERVICE, i, _SERVICE_METHOD, j), f"rpc {service.name}.{method.name}"
    for i, msg in enumerate(file.message_type):
        yield from _message_elements(msg, (_FILE_MESSAGE, i), msg.name)
    for i, enum in enumerate(file.enum_type):
        yield from _enum_elements(enum, (_FILE_ENUM, i), enum.name)


def test_every_rpc_message_field_and_enum_value_has_a_leading_comment(tmp_path: Path) -> None:
    files = [f for f in _descriptor_set(tmp_path).file if f.package == "fleetrl.v1"]
    assert len(files) == len(list(protogen.PROTO_DIR.rglob("*.proto")))
    undocumented, checked = [], 0
    for file in files:
        comments = {tuple(loc.path): loc.leading_comments.strip() for loc in file.source_code_info.location}
        for path, name in _elements(file):
            checked += 1
            if not comments.get(path):
                undocumented.append(f"{file.name}: {name}")
    assert checked > 200  # the walk reached the fields, not just the top-level names
    assert not undocumented, "add a `//` comment above each of:\n" + "\n".join(undocumented)
