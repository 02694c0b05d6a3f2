from fleetrl.proto.fleetrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EnvironmentSpec(_message.Message):
    __slots__ = ("spec_json", "file_source")
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    FILE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    spec_json: str
    file_source: bytes
    def __init__(self, spec_json: _Optional[str] = ..., file_source: _Optional[bytes] = ...) -> None: ...

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
    __slots__ = ("job_id", "spec", "items", "tenant")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    spec: RewardSpec
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    tenant: str
    def __init__(self, job_id: _Optional[str] = ..., spec: _Optional[_Union[RewardSpec, _Mapping]] = ..., items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ..., tenant: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("spec", "environment")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    spec: RewardSpec
    environment: EnvironmentSpec
    def __init__(self, spec: _Optional[_Union[RewardSpec, _Mapping]] = ..., environment: _Optional[_Union[EnvironmentSpec, _Mapping]] = ...) -> None: ...

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

class Message(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class EpisodeResult(_message.Message):
    __slots__ = ("episode", "observation", "reward", "done", "status", "reason", "latency_s", "tools_json", "segment", "max_new_tokens", "answer", "components", "call", "extends")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    EXTENDS_FIELD_NUMBER: _ClassVar[int]
    episode: int
    observation: _containers.RepeatedCompositeFieldContainer[Message]
    reward: float
    done: bool
    status: _common_pb2.RewardStatus
    reason: str
    latency_s: float
    tools_json: str
    segment: bool
    max_new_tokens: int
    answer: str
    components: _containers.ScalarMap[str, float]
    call: int
    extends: int
    def __init__(self, episode: _Optional[int] = ..., observation: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., reward: _Optional[float] = ..., done: _Optional[bool] = ..., status: _Optional[_Union[_common_pb2.RewardStatus, str]] = ..., reason: _Optional[str] = ..., latency_s: _Optional[float] = ..., tools_json: _Optional[str] = ..., segment: _Optional[bool] = ..., max_new_tokens: _Optional[int] = ..., answer: _Optional[str] = ..., components: _Optional[_Mapping[str, float]] = ..., call: _Optional[int] = ..., extends: _Optional[int] = ...) -> None: ...

class OpenEpisodesRequest(_message.Message):
    __slots__ = ("job_id", "session_id", "spec", "prompt", "metadata_json", "count", "tenant")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    session_id: str
    spec: EnvironmentSpec
    prompt: str
    metadata_json: str
    count: int
    tenant: str
    def __init__(self, job_id: _Optional[str] = ..., session_id: _Optional[str] = ..., spec: _Optional[_Union[EnvironmentSpec, _Mapping]] = ..., prompt: _Optional[str] = ..., metadata_json: _Optional[str] = ..., count: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class OpenEpisodesResponse(_message.Message):
    __slots__ = ("episodes",)
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    episodes: _containers.RepeatedCompositeFieldContainer[EpisodeResult]
    def __init__(self, episodes: _Optional[_Iterable[_Union[EpisodeResult, _Mapping]]] = ...) -> None: ...

class Action(_message.Message):
    __slots__ = ("episode", "turn", "text", "finish_reason", "prompt_tokens", "completion_tokens", "call")
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    episode: int
    turn: int
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    call: int
    def __init__(self, episode: _Optional[int] = ..., turn: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., call: _Optional[int] = ...) -> None: ...

class StepEpisodesRequest(_message.Message):
    __slots__ = ("session_id", "actions", "job_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    actions: _containers.RepeatedCompositeFieldContainer[Action]
    job_id: str
    def __init__(self, session_id: _Optional[str] = ..., actions: _Optional[_Iterable[_Union[Action, _Mapping]]] = ..., job_id: _Optional[str] = ...) -> None: ...

class StepEpisodesResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EpisodeResult]
    def __init__(self, results: _Optional[_Iterable[_Union[EpisodeResult, _Mapping]]] = ...) -> None: ...

class CloseEpisodesRequest(_message.Message):
    __slots__ = ("session_id", "job_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    job_id: str
    def __init__(self, session_id: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...

class CloseEpisodesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
