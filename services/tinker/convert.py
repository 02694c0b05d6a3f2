"""The SDK's wire format to `fleetrl.tinker.types` and back: JSON bodies and the protobuf ones.

JSON requests are read through pydantic models that ignore fields they do not name (newer SDKs add
fields; the domain dataclasses `AdamParams` and `LoraRequest` are validated as they are, with their
defaults, the SDK's) and name the field of any bad value (`InvalidArgument` with field violations). Requests for
features fleetrl does not serve (images, top-k log-probs, stop strings, other optimizers) are
refused here with the field's name, never silently ignored.

forward_backward bodies and the results the SDK reads as protobuf (ForwardBackwardOutput,
SampleResponse) use `fleetrl.v1` Tinker* messages, whose field numbers are the SDK's.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from typing import Any

import numpy as np
import zstandard
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleetrl.errors import FieldViolation, InvalidArgument
from fleetrl.proto.fleetrl.v1 import tinker_pb2 as pb
from fleetrl.spec.config import violations_of
from fleetrl.tinker.checkpoints import Listed
from fleetrl.tinker.service import RunInfo
from fleetrl.tinker.types import (
    AdamParams,
    Datum,
    ForwardResult,
    LoraRequest,
    SampleParams,
    SampleResult,
    SessionSummary,
)

PROTO = "application/x-protobuf"

_DTYPES: dict[int, np.dtype[Any]] = {
    pb.TINKER_DTYPE_FLOAT32: np.dtype("<f4"), pb.TINKER_DTYPE_INT64: np.dtype("<i8"),
    pb.TINKER_DTYPE_INT32: np.dtype("<i4"), pb.TINKER_DTYPE_BFLOAT16: np.dtype("<u2"),
}


class Wire(BaseModel):
    """A JSON body: unknown fields ignored (the SDK adds some), `model_` names allowed."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())


def parse(cls: type[Wire], body: Any) -> Any:
    """Validate a JSON body; InvalidArgument listing every bad field."""
    try:
        return cls.model_validate(body)
    except ValidationError as error:
        violations = violations_of(error)
        raise InvalidArgument("invalid request: " + "; ".join(f"{v.field}: {v.description}" for v in violations),
                              violations) from None


def unsupported(field: str, why: str) -> InvalidArgument:
    return InvalidArgument(f"{field}: {why}", [FieldViolation(field, why)])


# --------------------------------------------------------------------------- JSON requests


class CreateSession(Wire):
    sdk_version: str = ""


class SessionRef(Wire):
    session_id: str


class ListSessions(Wire):
    """`GET sessions` query (the SDK's list_sessions; `access_scope` is ignored: a tenant's sessions are its own).
    `all_tenants=true` (fleetrl's, for `fleetrl top --all-tenants`): every tenant's, for an operator only."""

    limit: int = Field(20, ge=1, le=10_000)
    offset: int = Field(0, ge=0)
    all_tenants: bool = False


def sessions_page(summaries: list[SessionSummary], page: ListSessions) -> dict[str, Any]:
    """The SDK's ListSessionsResponse (`sessions`: ids), and beside it each one's summary (`summaries`, which
    the SDK ignores and `fleetrl top` reads)."""
    shown = summaries[page.offset:page.offset + page.limit]
    return {"sessions": [s.session_id for s in shown], "summaries": [dataclasses.asdict(s) for s in shown]}


def _iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat()


def checkpoint(listed: Listed) -> dict[str, Any]:
    """The SDK's Checkpoint: its id is the path after the run (`weights/<name>`, `sampler_weights/<name>`)."""
    return {"checkpoint_id": f"{listed.path.kind}/{listed.path.name}",
            "checkpoint_type": "training" if listed.path.kind == "weights" else "sampler",
            "time": _iso(listed.written_at), "tinker_path": str(listed.path), "size_bytes": listed.size_bytes,
            "public": False}


def training_run(info: RunInfo) -> dict[str, Any]:
    """The SDK's TrainingRun, with its newest checkpoint of each kind."""
    def newest(kind: str) -> dict[str, Any] | None:
        of_kind = [c for c in info.checkpoints if c.path.kind == kind]
        return checkpoint(of_kind[-1]) if of_kind else None

    return {"training_run_id": info.model_id, "base_model": info.base_model, "model_owner": info.tenant,
            "is_lora": True, "lora_rank": info.lora_rank, "last_request_time": _iso(info.last_request_at),
            "last_checkpoint": newest("weights"), "last_sampler_checkpoint": newest("sampler_weights")}


def session_summary(item: dict[str, Any]) -> SessionSummary:
    """One of `sessions_page`'s summaries, read back."""
    return SessionSummary(**{**item, "base_models": tuple(item["base_models"]),
                             "lora_ranks": tuple(item["lora_ranks"])})


class CreateModel(Wire):
    session_id: str
    model_seq_id: int
    base_model: str
    lora_config: LoraRequest | None = None
    optimizer_config: dict[str, Any] = Field(default_factory=lambda: {"type": "adamw"})

    def lora(self) -> LoraRequest:
        if self.lora_config is None:
            raise unsupported("lora_config", "required: fleetrl trains LoRA adapters only")
        if self.optimizer_config.get("type", "adamw") != "adamw":
            raise unsupported("optimizer_config.type", f"{self.optimizer_config.get('type')!r} is not supported "
                              "(adamw only)")
        return self.lora_config


class ModelRef(Wire):
    model_id: str


class OptimStep(Wire):
    model_id: str
    seq_id: int
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None

    def adam(self) -> AdamParams:
        if self.adam_params is None:
            kind = (self.optimizer_params or {}).get("type")
            raise unsupported("optimizer_params", f"optimizer {kind!r} is not supported (Adam only)")
        return self.adam_params


class SaveWeights(Wire):
    model_id: str
    seq_id: int
    path: str | None = None


class SaveForSampler(Wire):
    model_id: str
    seq_id: int
    path: str | None = None
    kind: str = "snapshot"

    def checked(self) -> SaveForSampler:
        if self.kind != "snapshot":
            raise unsupported("kind", f"{self.kind!r} sampling clients are not supported (snapshot only)")
        return self


class LoadWeights(Wire):
    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None


class CreateSamplingSession(Wire):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class WireChunk(Wire):
    type: str = "encoded_text"
    tokens: list[int] = Field(default_factory=list)


class WireSamplingParams(Wire):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class Sample(Wire):
    sampling_session_id: str | None = None
    seq_id: int | None = None
    num_samples: int = 1
    prompt: dict[str, list[WireChunk]]
    sampling_params: WireSamplingParams
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None

    def params(self) -> SampleParams:
        for name, value in (("topk_prompt_logprobs", self.topk_prompt_logprobs),
                            ("topk_sample_logprobs", self.topk_sample_logprobs),
                            ("prompt_alt_tokens_k", self.prompt_alt_tokens_k)):
            if value:
                raise unsupported(name, "not supported yet")
        for name, given in (("target_prompt_logprobs", self.target_prompt_logprobs),
                            ("prompt_logprobs_last_n", self.prompt_logprobs_last_n)):
            if given is not None:
                raise unsupported(name, "not supported yet")
        sp = self.sampling_params
        if sp.max_tokens is None:
            raise unsupported("sampling_params.max_tokens", "required")
        if sp.top_k not in (-1, 0):
            raise unsupported("sampling_params.top_k", "top-k sampling is not supported (-1 only)")
        return SampleParams(prompt_tokens(self.prompt.get("chunks", []), "prompt"), self.num_samples, sp.max_tokens,
                            sp.temperature, sp.top_p, sp.seed, stop_tokens(sp.stop), bool(self.prompt_logprobs))


class Retrieve(Wire):
    request_id: str


def prompt_tokens(chunks: list[WireChunk], field: str) -> list[int]:
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        if chunk.type != "encoded_text":
            raise unsupported(f"{field}.chunks[{i}]", f"{chunk.type} chunks are not supported (text tokens only)")
        tokens.extend(chunk.tokens)
    return tokens


def stop_tokens(stop: str | list[str] | list[int] | None) -> frozenset[int] | None:
    if stop is None:
        return None
    if isinstance(stop, str) or any(isinstance(s, str) for s in stop):
        raise unsupported("sampling_params.stop", "stop strings are not supported yet; pass stop token ids")
    return frozenset(int(s) for s in stop)


# --------------------------------------------------------------------------- protobuf requests


def forward_backward(body: bytes, content_encoding: str | None) -> pb.TinkerForwardBackwardRequest:
    if content_encoding == "zstd":
        body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 31)
    message = pb.TinkerForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as error:  # protobuf's DecodeError: not a ForwardBackwardRequest
        raise InvalidArgument(f"the forward_backward body is not a ForwardBackwardRequest: {error}") from None
    return message


def loss_settings(message: pb.TinkerForwardBackwardRequest) -> dict[str, float]:
    """loss_fn_config, from its v2 map when the SDK sent one (numbers only)."""
    if message.loss_fn_config_v2:
        settings = {}
        for key, value in message.loss_fn_config_v2.items():
            if value.WhichOneof("value") != "number":
                raise unsupported(f"loss_fn_config.{key}", "string settings are not supported")
            settings[key] = value.number
        return settings
    return dict(message.loss_fn_config)


def datums(message: pb.TinkerForwardBackwardRequest) -> list[Datum]:
    return [_datum(i, d) for i, d in enumerate(message.data)]


def _datum(i: int, datum: pb.TinkerDatum) -> Datum:
    tokens: list[int] = []
    for j, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise unsupported(f"data[{i}].model_input[{j}]", f"{kind} chunks are not supported (text tokens only)")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist())
    inputs = {name: _array(f"data[{i}].loss_fn_inputs.{name}", t) for name, t in datum.loss_fn_inputs.items()}
    return Datum(tokens, inputs)


def _array(field: str, tensor: pb.TinkerTensor) -> np.ndarray:
    """A loss input as numpy, widened (int64 or float32) and densified."""
    dtype = _DTYPES.get(tensor.dtype)
    if dtype is None:
        raise unsupported(f"{field}.dtype", f"dtype {tensor.dtype} is not supported")
    shape = [int(s) for s in tensor.shape]
    try:
        if tensor.WhichOneof("encoding") == "sparse_csr":
            values = _widen(np.frombuffer(tensor.sparse_csr.values, dtype=dtype), tensor.dtype)
            crow = np.frombuffer(tensor.sparse_csr.crow_indices, dtype="<i8")
            cols = np.frombuffer(tensor.sparse_csr.col_indices, dtype="<i8")
            dense = np.zeros(shape, dtype=values.dtype)
            for row in range(len(crow) - 1):
                dense[row, cols[crow[row]:crow[row + 1]]] = values[crow[row]:crow[row + 1]]
            return dense
        values = _widen(np.frombuffer(tensor.dense, dtype=dtype), tensor.dtype)
        return values.reshape(shape) if shape else values
    except (ValueError, IndexError) as error:
        raise InvalidArgument(f"{field}: values do not fit shape {shape}: {error}",
                              [FieldViolation(field, "values do not fit the shape")]) from None


def _widen(values: np.ndarray, dtype: int) -> np.ndarray:
    if dtype == pb.TINKER_DTYPE_BFLOAT16:
        return (values.astype(np.uint32) << 16).view(np.float32)
    if dtype == pb.TINKER_DTYPE_INT32:
        return values.astype(np.int64)
    return values.copy()


# --------------------------------------------------------------------------- results


def forward_output(result: ForwardResult) -> bytes:
    """A ForwardBackwardOutput: one ArrayRecord whose `logprobs` field holds every datum's, float32."""
    record = pb.TinkerArrayRecord(type_tag="ArrayRecord", num_datums=len(result.logprobs))
    values = [np.asarray(lp, dtype="<f4") for lp in result.logprobs]
    offsets = np.cumsum([0, *(v.nbytes for v in values)]).astype("<i8")
    record.fields["logprobs"].CopyFrom(pb.TinkerBatchedTensor(
        data=b"".join(v.tobytes() for v in values), offsets=offsets.tobytes(), dtype=pb.TINKER_DTYPE_FLOAT32))
    out = pb.TinkerForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    out.metrics.update(result.metrics)
    return out.SerializeToString()


def sample_output(result: SampleResult) -> bytes:
    out = pb.TinkerSampleResponse()
    for seq in result.sequences:
        out.sequences.add(
            stop_reason=pb.TINKER_STOP_REASON_STOP if seq.stopped else pb.TINKER_STOP_REASON_LENGTH,
            tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes())
    if result.prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray([math.nan if v is None else v for v in result.prompt_logprobs],
                                         dtype="<f4").tobytes()
    return out.SerializeToString()


def future(request_id: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The UntypedAPIFuture every queued request answers at once."""
    return {"request_id": request_id, **extra}
