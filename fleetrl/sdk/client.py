"""Synchronous Python client of the JobService, for notebooks and scripts.

    from fleetrl.sdk.client import Client
    client = Client("127.0.0.1:50051", token="...")          # or FLEETRL_GATEWAY / FLEETRL_TOKEN
    run = client.create_run(model="smollm2-135m", prompt_file="prompts.jsonl",
                            reward_file="reward.py", learning_rate=1e-5, max_steps=50)
    for step in run.watch():
        print(step.step, step["reward_mean"])
    run.wait(); run.download_model("out/")

Failed calls raise `fleetrl.errors` types: a bad spec is a ConfigError whose `violations`
name every bad field (from the BadRequest details), an unknown job NotFound, and so on. Local
mistakes are ConfigErrors too: an unreadable ca_file, spec_file or job file, a token that cannot be
sent, a download directory that cannot be written. `watch` survives a gateway restart: it
reconnects (bounded) and resumes after the last step it saw.

TLS: a ca_file (or FLEETRL_CA_FILE) trusts that CA; `tls=True` (or FLEETRL_TLS=1) without one trusts
gRPC's default roots (its bundled public CAs, or the file GRPC_DEFAULT_SSL_ROOTS_FILE_PATH names).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import grpc

from fleetrl.errors import ConfigError, FieldViolation, FleetError, from_grpc
from fleetrl.proto.fleetrl.v1 import gateway_pb2, gateway_pb2_grpc
from fleetrl.runtime.grpcutil import field_violations
from fleetrl.sdk import convert, sweep
from fleetrl.sdk.records import AccountingInfo, DeletedInfo, FleetInfo, JobEventInfo, JobInfo, StepInfo
from fleetrl.spec.config import apply_overrides, read_bytes, read_toml, set_dotted

DEFAULT_ADDRESS = "127.0.0.1:50051"
ENV_ADDRESS, ENV_TOKEN, ENV_CA_FILE, ENV_TLS = "FLEETRL_GATEWAY", "FLEETRL_TOKEN", "FLEETRL_CA_FILE", "FLEETRL_TLS"
SECTIONS = ("reward", "environment", "agent", "algorithm", "optim", "rollout", "train", "replay", "eval", "sft")
FLAT_PARAMS = {
    "learning_rate": "optim.learning_rate", "warmup_steps": "optim.warmup_steps",
    "clip_eps": "algorithm.clip_eps", "clip_eps_high": "algorithm.clip_eps_high",
    "kl_coef": "algorithm.kl_coef", "entropy_coef": "algorithm.entropy_coef", "algorithm": "algorithm.name",
    "epochs_per_step": "train.epochs_per_step", "max_steps": "train.max_steps",
    "max_staleness": "train.max_staleness", "publish_interval": "train.publish_interval",
    "checkpoint_interval": "train.checkpoint_interval", "max_retries_per_episode": "train.max_retries_per_episode",
    "timeout_per_step_s": "train.timeout_per_step_s", "prompts_per_step": "rollout.prompts_per_step",
    "samples_per_prompt": "rollout.samples_per_prompt", "max_new_tokens": "rollout.max_new_tokens",
    "temperature": "rollout.temperature", "top_p": "rollout.top_p", "seed": "seed",
}
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 64 << 20)]
WATCH_RECONNECTS = 10
LONG_CALL_S = 7 * 24 * 3600.0


def to_domain_error(error: grpc.RpcError) -> FleetError:
    """The domain error of a failed call; INVALID_ARGUMENT becomes ConfigError with its violations."""
    if error.code() == grpc.StatusCode.INVALID_ARGUMENT:  # type: ignore[attr-defined]
        out = ConfigError(error.details() or "invalid argument")  # type: ignore[attr-defined]
        out.violations = [FieldViolation(f, d) for f, d in field_violations(error)]
        return out
    return from_grpc(error)


def spec_from_params(params: dict[str, Any]) -> dict[str, Any]:
    """A spec table from flat knob names (FLAT_PARAMS), dotted or `__`-joined paths, or section dicts."""
    data: dict[str, Any] = {}
    unknown = []
    for key, value in params.items():
        dotted = FLAT_PARAMS.get(key) or key.replace("__", ".")
        if dotted.split(".")[0] in SECTIONS and isinstance(value, dict) and "." not in dotted:
            data.setdefault(dotted, {}).update(value)
        elif key in FLAT_PARAMS or "." in dotted:
            set_dotted(data, dotted, value)
        else:
            unknown.append(FieldViolation(key, "unknown parameter; use a dotted spec path like optim.learning_rate"))
    if unknown:
        raise ConfigError("unknown run parameters", unknown)
    return data


@dataclass(frozen=True)
class JobPayload:
    """A spec as JSON text and the contents of the files it names."""

    spec: str
    prompts: bytes
    reward_file: bytes = b""
    eval_prompts: bytes = b""
    environment_file: bytes = b""


def load_job_file(path: Path, overrides: list[str] | None = None) -> JobPayload:
    """The spec and files of a job TOML; its file paths are relative to the TOML's directory."""
    data = read_toml(Path(path), "spec")
    apply_overrides(data, overrides or [])
    return job_payload(data, Path(path).parent)


def job_payload(data: dict[str, Any], base: Path) -> JobPayload:
    """Read the files a spec table names (relative to base) and encode the spec as JSON."""

    def named(section: str, key: str) -> bytes:
        table = data.get(section) if section else data
        name = table.get(key) if isinstance(table, dict) else None
        field = f"{section}.{key}" if section else key
        return read_bytes(base / name, field) if isinstance(name, str) and name else b""

    return JobPayload(json.dumps(data, default=str), named("", "prompts"), named("reward", "file"),
                      named("eval", "prompts"), named("environment", "file") or named("agent", "file"))


class Client:
    """A connection to a gateway. Thread-safe; close() or use as a context manager."""

    address: str
    timeout_s: float
    _channel: grpc.Channel
    _stub: gateway_pb2_grpc.JobServiceStub
    _metadata: tuple[tuple[str, str], ...]

    def __init__(self, address: str | None = None, token: str | None = None, ca_file: str | Path | None = None,
                 timeout_s: float = 30.0, *, tls: bool | None = None) -> None:
        self.address = address or os.environ.get(ENV_ADDRESS) or DEFAULT_ADDRESS
        self.timeout_s = timeout_s
        token = token if token is not None else os.environ.get(ENV_TOKEN)
        ca_file = ca_file if ca_file is not None else os.environ.get(ENV_CA_FILE)
        tls = tls if tls is not None else os.environ.get(ENV_TLS, "").lower() in ("1", "true", "yes")
        if token and not (token.isascii() and token.isprintable()):
            raise ConfigError("invalid token", [FieldViolation("token", "must be printable ASCII")])
        if ca_file or tls:
            roots = read_bytes(Path(ca_file), "ca_file") if ca_file else None
            creds = grpc.ssl_channel_credentials(root_certificates=roots)
            self._channel = grpc.secure_channel(self.address, creds, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self._stub = gateway_pb2_grpc.JobServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: Any, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return method(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as error:
            raise to_domain_error(error) from None

    # ------------------------------------------------------------------ jobs

    def submit(self, spec: str, prompts: bytes, reward_file: bytes = b"", *, spec_format: str = "toml",
               idempotency_key: str = "", eval_prompts: bytes = b"", environment_file: bytes = b"") -> JobInfo:
        """Submit a spec text with the contents of its files."""
        request = gateway_pb2.SubmitJobRequest(spec=spec, spec_format=spec_format, prompts=prompts,
                                               reward_file=reward_file, idempotency_key=idempotency_key,
                                               eval_prompts=eval_prompts, environment_file=environment_file)
        return convert.job_info(self._call(self._stub.SubmitJob, request))

    def submit_payload(self, payload: JobPayload, idempotency_key: str = "") -> JobInfo:
        return self.submit(payload.spec, payload.prompts, payload.reward_file, spec_format="json",
                           idempotency_key=idempotency_key, eval_prompts=payload.eval_prompts,
                           environment_file=payload.environment_file)

    def submit_file(self, path: str | Path, overrides: list[str] | None = None, *,
                    idempotency_key: str = "") -> JobInfo:
        """Submit a job TOML (with `key=value` overrides); its prompts, reward or environment file and eval
        file travel with it."""
        return self.submit_payload(load_job_file(Path(path), overrides), idempotency_key)

    def create_run(self, model: str, prompt_file: str | Path, reward_file: str | Path | None = None, *,
                   reward_builtin: str | None = None, reward_params: dict[str, Any] | None = None,
                   name: str | None = None, spec_file: str | Path | None = None, idempotency_key: str = "",
                   **params: Any) -> Run:
        """Submit a job from keyword arguments (see FLAT_PARAMS for the flat knob names) and return its Run."""
        base = read_toml(Path(spec_file), "spec_file") if spec_file else {}
        data = _merge(base, spec_from_params(params))
        data["model"], data["prompts"] = model, str(Path(prompt_file).resolve())
        if name is not None:
            data["name"] = name
        if reward_file is not None or reward_builtin is not None:
            data["reward"] = {k: v for k, v in data.get("reward", {}).items() if k not in ("file", "builtin")}
            data["reward"].update({"file": str(Path(reward_file).resolve())} if reward_file is not None
                                  else {"builtin": reward_builtin})
        if reward_params is not None:
            data.setdefault("reward", {})["params"] = reward_params
        payload = job_payload(data, Path(spec_file).parent if spec_file else Path.cwd())
        return Run(self, self.submit_payload(payload, idempotency_key).job_id)

    def sweep(self, grid: dict[str, list[Any]], job_file: str | Path | None = None, *,
              overrides: list[str] | None = None, name: str | None = None, **run_kwargs: Any) -> sweep.Sweep:
        """One job per combination of the grid's values ({dotted spec key: values}), from job_file with
        `overrides`, or from create_run's keyword arguments; `.wait()` returns their rows."""
        return sweep.submit(self, grid, job_file, overrides=overrides or [], name=name, **run_kwargs)

    def accounting(self, job_id: str, include_tasks: bool = False, timeout_s: float | None = None) -> AccountingInfo:
        """What became of every task the job published (the end-to-end ledger), counts and optionally each task."""
        request = gateway_pb2.GetJobAccountingRequest(job_id=job_id, include_tasks=include_tasks)
        return convert.accounting_info(self._call(self._stub.GetJobAccounting, request, timeout_s))

    def fleet(self, timeout_s: float | None = None, all_tenants: bool = False) -> FleetInfo:
        """Live actors and learners and the task queues of your active jobs (what `fleetrl top` shows); with
        `all_tenants` (an operator's token only) every tenant's, by name."""
        request = gateway_pb2.GetFleetRequest(all_tenants=all_tenants)
        return convert.fleet_info(self._call(self._stub.GetFleet, request, timeout_s))

    def get_job(self, job_id: str) -> JobInfo:
        return convert.job_info(self._call(self._stub.GetJob, gateway_pb2.GetJobRequest(job_id=job_id)))

    def list_jobs(self, limit: int = 50, all_tenants: bool = False) -> list[JobInfo]:
        """Your jobs, newest first; with `all_tenants` (an operator's token only) every tenant's."""
        response = self._call(self._stub.ListJobs, gateway_pb2.ListJobsRequest(limit=limit, all_tenants=all_tenants))
        return [convert.job_info(job) for job in response.jobs]

    def cancel_job(self, job_id: str, reason: str = "") -> JobInfo:
        return convert.job_info(self._call(self._stub.CancelJob, gateway_pb2.CancelJobRequest(job_id=job_id,
                                                                                               reason=reason)))

    def delete_job(self, job_id: str) -> DeletedInfo:
        """Delete a finished job's data from every store (FailedPrecondition while it is queued or running)."""
        response = self._call(self._stub.DeleteJob, gateway_pb2.DeleteJobRequest(job_id=job_id))
        return DeletedInfo(response.redis_keys, response.redis_bytes, response.nats_messages, response.nats_bytes,
                           response.disk_files, response.disk_bytes)

    def run(self, job_id: str) -> Run:
        """A handle on an existing job (NotFound if it is not yours or does not exist)."""
        self.get_job(job_id)
        return Run(self, job_id)

    def watch_job(self, job_id: str, from_step: int = 0, timeout_s: float | None = None) -> Iterator[JobEventInfo]:
        """State changes and step metrics until the job ends; reconnects after a gateway restart."""
        deadline = time.monotonic() + (timeout_s or LONG_CALL_S)
        next_step, last_state, failures = from_step, None, 0
        while True:
            request = gateway_pb2.WatchJobRequest(job_id=job_id, from_step=next_step)
            try:
                for raw in self._stub.WatchJob(request, timeout=max(0.1, deadline - time.monotonic()),
                                               metadata=self._metadata):
                    event = convert.event_info(raw)
                    failures = 0
                    if event.step is not None:
                        next_step = event.step.step + 1
                    elif event.state == last_state:
                        continue  # the current state, re-sent after a reconnect
                    else:
                        last_state = event.state
                    yield event
                return
            except grpc.RpcError as error:
                failures += 1
                if error.code() != grpc.StatusCode.UNAVAILABLE or failures > WATCH_RECONNECTS:  # type: ignore[attr-defined]
                    raise to_domain_error(error) from None
                time.sleep(min(5.0, 0.2 * 2 ** failures) * (0.5 + random.random()))

    def download_model(self, job_id: str, path: str | Path, timeout_s: float = 3600.0, *,
                       merged: bool = False) -> Path:
        """Write the succeeded job's exported model directory under path; returns path. A LoRA job's
        is its PEFT adapter directory (`PeftModel.from_pretrained` on the base), or with `merged` its
        merged full HF model.

        ConfigError (naming `path`) if the directory or a file in it cannot be created or written."""
        root = Path(path)
        handle = None
        try:
            with _writing(root):
                root.mkdir(parents=True, exist_ok=True)
            for chunk in self._stub.DownloadModel(gateway_pb2.DownloadModelRequest(job_id=job_id, merged=merged),
                                                  timeout=timeout_s, metadata=self._metadata):
                with _writing(root):
                    if chunk.offset == 0:
                        target = root / _safe_relative(chunk.path)
                        target.parent.mkdir(parents=True, exist_ok=True)
                        handle = target.open("wb")
                    assert handle is not None, "a file's first chunk has offset 0"
                    handle.write(chunk.data)
                    if chunk.last:
                        handle.close()
                        handle = None
        except grpc.RpcError as error:
            raise to_domain_error(error) from None
        finally:
            if handle is not None:
                handle.close()
        return root


class Run:
    """One submitted job: status, watch, wait, cancel, download."""

    client: Client
    job_id: str

    def __init__(self, client: Client, job_id: str) -> None:
        self.client, self.job_id = client, job_id

    def __repr__(self) -> str:
        return f"Run({self.job_id!r})"

    def status(self) -> JobInfo:
        return self.client.get_job(self.job_id)

    def events(self, from_step: int = 0) -> Iterator[JobEventInfo]:
        return self.client.watch_job(self.job_id, from_step)

    def watch(self, from_step: int = 0) -> Iterator[StepInfo]:
        """Metrics of each step as it finishes, until the job ends."""
        for event in self.client.watch_job(self.job_id, from_step):
            if event.step is not None:
                yield event.step

    def wait(self, timeout_s: float | None = None) -> JobInfo:
        """Block until the job ends; returns its final state (DeadlineExceeded after timeout_s)."""
        for event in self.client.watch_job(self.job_id, from_step=2**62, timeout_s=timeout_s):
            if event.job.done:
                return event.job
        return self.status()

    def cancel(self, reason: str = "") -> JobInfo:
        return self.client.cancel_job(self.job_id, reason)

    def download_model(self, path: str | Path, *, merged: bool = False) -> Path:
        return self.client.download_model(self.job_id, path, merged=merged)


@contextlib.contextmanager
def _writing(root: Path) -> Iterator[None]:
    """Local file errors while writing a download become a ConfigError naming `path`."""
    try:
        yield
    except OSError as error:
        raise ConfigError(f"cannot write the model under {root}", [FieldViolation(
            "path", f"{error.filename or root}: {error.strerror or error}")]) from None


def _safe_relative(name: str) -> Path:
    rel = PurePosixPath(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise FleetError(f"refusing to write model file outside the target directory: {name!r}")
    return Path(*rel.parts)


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
