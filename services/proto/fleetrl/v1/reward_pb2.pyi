from services.proto.fleetrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RewardSpec(_message.Message):
    __slots__ = ("spec_json", "file_source")
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    FILE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    spec_json: str
    file_source: bytes
    def __init__(self, spec_json: _Optional[str] = ..., file_source: _Optional[bytes] = ...) -> None: ...

class ScoreItem(_message.Message):
    __slots__ = ("completion", "prompt", "metadata_json")
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    completion: str
    prompt: str
    metadata_json: str
    def __init__(self, completion: _Optional[str] = ..., prompt: _Optional[str] = ..., metadata_json: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("job_id", "spec", "items")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    spec: RewardSpec
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    def __init__(self, job_id: _Optional[str] = ..., spec: _Optional[_Union[RewardSpec, _Mapping]] = ..., items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("reward", "components", "status", "reason", "latency_s")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REWARD_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    reward: float
    components: _containers.ScalarMap[str, float]
    status: _common_pb2.RewardStatus
    reason: str
    latency_s: float
    def __init__(self, reward: _Optional[float] = ..., components: _Optional[_Mapping[str, float]] = ..., status: _Optional[_Union[_common_pb2.RewardStatus, str]] = ..., reason: _Optional[str] = ..., latency_s: _Optional[float] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoreResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ScoreResult, _Mapping]]] = ...) -> None: ...

class ValidateRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: RewardSpec
    def __init__(self, spec: _Optional[_Union[RewardSpec, _Mapping]] = ...) -> None: ...

class ValidateResponse(_message.Message):
    __slots__ = ("ok", "reason", "sandbox")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    sandbox: SandboxReport
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ..., sandbox: _Optional[_Union[SandboxReport, _Mapping]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SandboxReport(_message.Message):
    __slots__ = ("mode", "layers", "problem", "summary")
    class LayersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bool
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bool] = ...) -> None: ...
    MODE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    mode: str
    layers: _containers.ScalarMap[str, bool]
    problem: str
    summary: str
    def __init__(self, mode: _Optional[str] = ..., layers: _Optional[_Mapping[str, bool]] = ..., problem: _Optional[str] = ..., summary: _Optional[str] = ...) -> None: ...
