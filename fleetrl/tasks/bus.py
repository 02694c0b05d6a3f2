"""NATS and JetStream: connection, subject names, and idempotent set-up.

Every subject, stream, consumer, KV bucket and object-store name of fleetrl is
built here and nowhere else. `ensure_*` functions create or update their
object and are safe to call from every replica at start-up.

Streams:
- FLEET_TASKS (work-queue retention): `fleet.tasks.<job>`, one durable pull
  consumer per job (`actors-<job>`) shared by every actor replica.
- FLEET_DLQ (limits): `fleet.dlq.<job>`, tasks that exhausted their retries.
- FLEET_EVENTS (limits, 7 days): `fleet.jobs.<job>.events`, state changes and metrics.
- FLEET_ADVISORIES (limits, 30 days): JetStream's MAX_DELIVERIES advisories of the task consumers,
  kept so a task the server stopped delivering (every delivery killed or hung its actor) is moved to
  the dead-letter subject by `dead_letter_exhausted`, even if the learner was down when it happened.
- FLEET_SAMPLES (work-queue retention): `fleet.samples.<base>`, the Tinker API's sample requests for one
  base model (`base_token`), one durable pull consumer per base (`samplers-<base>`) shared by every actor
  that serves it. Created by `ensure_sample_streams` (the tinker service and those actors), not by
  `ensure_streams`.
- FLEET_SAMPLE_RESULTS (limits, an hour): `fleet.sample_results.<service>`, their results, each published
  with `Nats-Msg-Id: result/<request id>` so a request served twice (its actor died before its ack) stores
  and delivers one result.
KV `fleet_weights`: key `<job>` -> weight pointer JSON. Object store
`fleet_w_<job>`: objects `v<version>`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext, api
from nats.js.errors import BadRequestError, NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from fleetrl.errors import FieldViolation, FleetError, InvalidArgument, Unavailable, clip
from fleetrl.spec.config import JobSpec

log = logging.getLogger(__name__)
T = TypeVar("T")

TASKS_STREAM = "FLEET_TASKS"
DLQ_STREAM = "FLEET_DLQ"
EVENTS_STREAM = "FLEET_EVENTS"
ADVISORIES_STREAM = "FLEET_ADVISORIES"
WEIGHTS_KV = "fleet_weights"
SAMPLES_STREAM = "FLEET_SAMPLES"
SAMPLE_RESULTS_STREAM = "FLEET_SAMPLE_RESULTS"
SAMPLE_DEDUP_S = 600.0
"""How long JetStream remembers a sample request's or result's msg id: a re-published request, or a second
result of one request, within it is dropped."""
CONNECT_TIMEOUT_S = 5.0
PING_INTERVAL_S = 10.0
MAX_OUTSTANDING_PINGS = 3
"""nats-py pings the server every PING_INTERVAL_S and takes the connection for dead (stale) when a ping is
due with more than MAX_OUTSTANDING_PINGS unanswered, then reconnects: a half-open connection (the server's
host vanished, a middlebox dropped the flow) is left within (MAX_OUTSTANDING_PINGS + 1) * PING_INTERVAL_S,
40 s, each call meanwhile failing at its own deadline."""
REQUEST_TIMEOUT_S = 10.0
FLUSH_TIMEOUT_S = 2.0
"""How long a publish waits for the socket when the client's outgoing buffer is past its limit (nats-py's
`pending_size`, 2 MiB: a weight object's third chunk). nats-py's default waits for good: a server that
stops reading (a partition that drops packets) held such a publish, and the weight publish of a learner
cut off from NATS with it, with no deadline. Past it the publish returns with its bytes still buffered,
and the error callback logs a flush timeout; the call's own deadline (its ack) decides."""
NATS_UNREACHABLE: tuple[type[Exception], ...] = (
    TimeoutError, nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
    nats.errors.NoRespondersError, nats.errors.StaleConnectionError, nats.errors.OutboundBufferLimitError,
    nats.js.errors.ServiceUnavailableError,
)
"""What a NATS call raises while the server is dead, restarting or stopped: a request sent to the dead
server gets no reply (nats.errors.TimeoutError is a TimeoutError, as is asyncio.wait_for's), and
JetStream answers 503 or nobody while it recovers its streams."""
JETSTREAM_FULL: dict[int, str] = {
    10023: "the server's or the account's JetStream storage limit (max_file_store, max_memory_store) is reached",
    10028: "the server's JetStream memory (max_memory_store) is used up",
    10047: "the server's JetStream storage (max_file_store) is used up",
    10077: "a stream or bucket is at its limit (max_bytes, max_msgs), or its store cannot be written",
}
"""JetStream's error codes for a write refused for want of space, and what each means. A write meets 10023
or 10077, answered 503, which nats-py raises as ServiceUnavailableError, the error of a recovering server
too; a reservation (a stream with max_bytes) meets 10028 or 10047, answered 500."""
_RETRY_OR_FULL: tuple[type[Exception], ...] = (*NATS_UNREACHABLE, nats.js.errors.APIError)
OUTAGE_RETRY_S = 60.0
"""How long `retry_outage` repeats a call through a NATS outage before it lets the error through."""
_JOB_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


class NatsUnreachable(Unavailable, TimeoutError):
    """`retry_outage` gave up on a call through a NATS outage: names the call, how long and how often it was
    tried, and the last error (its cause); or a call that timed out found the server not answering a ping
    (`answers`), as a weight write does before it would spend more deadlines on a probe and a purge. Still a
    TimeoutError, so whoever catches NATS_UNREACHABLE catches it; the learner waits it out with its job paused
    (`fleetrl.train.full_stores`)."""


class JetStreamFull(FleetError, RuntimeError):
    """JetStream refused a write for want of space (`jetstream_full`): not an outage that passes by itself,
    so `retry_outage` raises it at once; the learner waits it out with its job paused
    (`fleetrl.train.full_stores`)."""


def jetstream_full(error: BaseException) -> str:
    """Why JetStream refused a write for want of space, or "" when error is anything else."""
    if not isinstance(error, nats.js.errors.APIError) or error.err_code not in JETSTREAM_FULL:
        return ""
    return f"JetStream is full: {error.description} (err_code {error.err_code}: {JETSTREAM_FULL[error.err_code]})"


def check_job_id(job_id: str) -> str:
    """Job ids become subject tokens and bucket names: letters, digits, `-` and `_` only."""
    if not _JOB_ID_RE.fullmatch(job_id):  # not match(): its `$` lets a trailing newline through
        problem = f"{clip(job_id, 80)!r} is not 1-64 of [A-Za-z0-9_-]"
        raise InvalidArgument(f"invalid job_id: {problem}", [FieldViolation("job_id", problem)])
    return job_id


def task_subject(job_id: str) -> str:
    return f"fleet.tasks.{check_job_id(job_id)}"


def dlq_subject(job_id: str) -> str:
    return f"fleet.dlq.{check_job_id(job_id)}"


def events_subject(job_id: str) -> str:
    return f"fleet.jobs.{check_job_id(job_id)}.events"


def task_consumer(job_id: str) -> str:
    """Durable consumer every actor replica of a job shares."""
    return f"actors-{check_job_id(job_id)}"


def max_deliveries_subject(job_id: str) -> str:
    """JetStream's advisory when the job's task consumer gives up on a message (max_deliver reached)."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{TASKS_STREAM}.{task_consumer(job_id)}"


def weights_bucket(job_id: str) -> str:
    return f"fleet_w_{check_job_id(job_id)}"


def base_token(model: str) -> str:
    """A base model's name as one subject token and consumer name: model names hold `/` and `.`."""
    readable = re.sub(r"[^A-Za-z0-9_-]", "_", model)[:32]
    return f"{readable}-{hashlib.sha256(model.encode()).hexdigest()[:12]}"


def sample_subject(model: str) -> str:
    """Where the Tinker API's sample requests for one base model go."""
    return f"fleet.samples.{base_token(model)}"


def sample_consumer(model: str) -> str:
    """Durable consumer of one base's sample requests, shared by every actor serving that base."""
    return f"samplers-{base_token(model)}"


def sample_results_subject(service_id: str) -> str:
    """Where actors publish the results of one tinker service process's sample requests."""
    return f"fleet.sample_results.{check_job_id(service_id)}"


TRAIN_HOSTS = "tinker-learners"
"""The queue group of the learners hosting Tinker training runs: one of them takes each placement."""


def train_place_subject(model: str) -> str:
    """Where the Tinker API places a training run of one base model (a learner hosting that base takes it)."""
    return f"fleet.tinker_train.place.{base_token(model)}"


def train_host_subject(learner_id: str) -> str:
    """Where the calls of the Tinker training runs one learner holds go (learner ids hold `/` and `.`)."""
    return f"fleet.tinker_train.host.{base_token(learner_id)}"


def sample_result_msg_id(request_id: str) -> str:
    return f"result/{request_id}"


def task_msg_id(job_id: str, epoch: int, prompt_index: int) -> str:
    """`Nats-Msg-Id` of a task: a re-publish inside the duplicate window is dropped by JetStream."""
    return f"{job_id}/{epoch}/{prompt_index}"


async def connect(url: str, name: str, *, tls_ca_file: Path | None = None, max_reconnect_attempts: int = -1,
                  ping_interval_s: float = PING_INTERVAL_S, max_outstanding_pings: int = MAX_OUTSTANDING_PINGS) -> NATS:
    """Connect with bounded connect time and endless, spaced reconnects (a NATS restart is survivable).
    TLS when the URL says `tls://` or the server requires it: the server's certificate and host name are
    checked against tls_ca_file (None: the system's CAs)."""

    async def on_error(error: Exception) -> None:
        log.warning("nats %s: %s", name, error)

    async def on_disconnected() -> None:
        log.warning("nats %s: disconnected", name)

    async def on_reconnected() -> None:
        log.warning("nats %s: reconnected", name)

    try:
        return await nats.connect(
            servers=url.split(","),
            name=name,
            connect_timeout=CONNECT_TIMEOUT_S,
            reconnect_time_wait=0.5,
            max_reconnect_attempts=max_reconnect_attempts,
            allow_reconnect=True,
            ping_interval=ping_interval_s,  # type: ignore[arg-type]  # nats-py annotates int, sleeps any number
            flush_timeout=FLUSH_TIMEOUT_S,
            max_outstanding_pings=max_outstanding_pings,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            **({"tls": ssl.create_default_context(cafile=tls_ca_file)} if tls_ca_file is not None else {}),
        )
    except (TimeoutError, OSError, nats.errors.NoServersError) as error:
        raise Unavailable(f"cannot connect to NATS at {url}: {error}") from error


async def retry_outage(call: Callable[[], Awaitable[T]], *, what: str, deadline_s: float = OUTAGE_RETRY_S,
                       interval_s: float = 1.0) -> T:
    """call() again while it fails with NATS_UNREACHABLE, every interval_s, until deadline_s after the
    first try (then the error goes through); each failure is logged. Only for calls that are safe to
    repeat: a JetStream publish with a `Nats-Msg-Id`, a read, a write that checks what landed. A write
    refused for want of space (`jetstream_full`, most often answered 503 like an outage) is not retried
    here: it raises JetStreamFull naming what was refused and why. A call that still fails at the deadline
    raises NatsUnreachable naming `what` (its cause the last error)."""
    started = time.monotonic()
    deadline = started + deadline_s
    attempt = 0
    while True:
        attempt += 1
        try:
            return await call()
        except _RETRY_OR_FULL as error:
            if full := jetstream_full(error):
                raise JetStreamFull(f"{what} refused: {full}") from error
            if not isinstance(error, NATS_UNREACHABLE):
                raise
            if time.monotonic() + interval_s >= deadline:
                raise NatsUnreachable(f"{what} failed: NATS unreachable for {time.monotonic() - started:.1f}s, "
                                      f"{attempt} tries, the last {type(error).__name__} {error}") from error
            log.warning("%s failed (attempt %d: %s %s); again in %.1fs", what, attempt, type(error).__name__,
                        error, interval_s)
        await asyncio.sleep(interval_s)


async def answers(nc: NATS, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
    """Whether the server answers a ping within timeout_s, after the bytes the client has buffered before it:
    False when it is unreachable (a partition, a stopped server) or the connection is closed."""
    try:
        await nc.flush(timeout=timeout_s)  # type: ignore[arg-type]  # nats-py annotates int, waits any number
    except (TimeoutError, nats.errors.Error):
        return False
    return True


def jetstream(nc: NATS) -> JetStreamContext:
    return nc.jetstream(timeout=REQUEST_TIMEOUT_S)


async def ensure_stream(js: JetStreamContext, config: api.StreamConfig) -> api.StreamInfo:
    """Create the stream, or update it to config if it exists."""
    try:
        return await js.add_stream(config)
    except BadRequestError as error:
        if error.err_code != 10058:  # stream name already in use with a different configuration
            raise
        return await js.update_stream(config)


async def ensure_streams(js: JetStreamContext) -> None:
    """The four fleet streams, file-backed."""
    await ensure_stream(js, api.StreamConfig(
        name=TASKS_STREAM, subjects=["fleet.tasks.*"], retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType.FILE, duplicate_window=24 * 3600.0,
    ))
    await ensure_stream(js, api.StreamConfig(
        name=DLQ_STREAM, subjects=["fleet.dlq.*"], retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE, max_age=30 * 24 * 3600.0,
    ))
    await ensure_stream(js, api.StreamConfig(
        name=ADVISORIES_STREAM, subjects=[f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{TASKS_STREAM}.*"],
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE, max_age=30 * 24 * 3600.0,
    ))
    await ensure_stream(js, api.StreamConfig(
        name=EVENTS_STREAM, subjects=["fleet.jobs.*.events"], retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE, max_age=7 * 24 * 3600.0,
    ))


async def ensure_sample_streams(js: JetStreamContext) -> None:
    """FLEET_SAMPLES and FLEET_SAMPLE_RESULTS, file-backed."""
    await ensure_stream(js, api.StreamConfig(
        name=SAMPLES_STREAM, subjects=["fleet.samples.*"], retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType.FILE, duplicate_window=SAMPLE_DEDUP_S, max_age=3600.0,
    ))
    await ensure_stream(js, api.StreamConfig(
        name=SAMPLE_RESULTS_STREAM, subjects=["fleet.sample_results.*"], retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE, duplicate_window=SAMPLE_DEDUP_S, max_age=3600.0,
    ))


async def ensure_sample_consumer(js: JetStreamContext, model: str, *, ack_wait_s: float,
                                 max_deliver: int) -> api.ConsumerInfo:
    """One base's shared durable pull consumer of sample requests. A consumer that exists with other settings
    (another actor's) is used as it is, logged: every actor serving the base should set the same."""
    config = api.ConsumerConfig(
        durable_name=sample_consumer(model), filter_subject=sample_subject(model),
        ack_policy=api.AckPolicy.EXPLICIT, deliver_policy=api.DeliverPolicy.ALL,
        ack_wait=ack_wait_s, max_deliver=max_deliver,
    )
    try:
        return await js.add_consumer(SAMPLES_STREAM, config)
    except BadRequestError as error:
        log.warning("sample consumer of %s exists with other settings; using them: %s", model, error)
        return await js.consumer_info(SAMPLES_STREAM, sample_consumer(model))


async def ensure_task_consumer(
    js: JetStreamContext, job_id: str, *, ack_wait_s: float, max_deliver: int, max_ack_pending: int
) -> api.ConsumerInfo:
    """The job's shared durable pull consumer. A task whose delivery max_deliver ends without an ack
    (it killed or hung its actor every time) is not delivered again: JetStream announces it on
    `max_deliveries_subject` (when the consumer's next pull comes, so while some actor still serves
    the job), and `dead_letter_exhausted` moves it to the dead-letter subject."""
    config = api.ConsumerConfig(
        durable_name=task_consumer(job_id), filter_subject=task_subject(job_id),
        ack_policy=api.AckPolicy.EXPLICIT, deliver_policy=api.DeliverPolicy.ALL,
        ack_wait=ack_wait_s, max_deliver=max_deliver, max_ack_pending=max_ack_pending,
    )
    return await js.add_consumer(TASKS_STREAM, config)


async def ensure_weights_kv(js: JetStreamContext) -> KeyValue:
    try:
        return await js.key_value(WEIGHTS_KV)
    except NotFoundError:
        return await js.create_key_value(api.KeyValueConfig(
            bucket=WEIGHTS_KV, history=5, storage=api.StorageType.FILE,
        ))


async def ensure_object_store(js: JetStreamContext, job_id: str) -> ObjectStore:
    bucket = weights_bucket(job_id)
    try:
        return await js.object_store(bucket)
    except NotFoundError:
        return await js.create_object_store(bucket, api.ObjectStoreConfig(storage=api.StorageType.FILE))


def task_consumer_limits(spec: JobSpec) -> dict[str, float | int]:
    """Consumer settings derived from a job spec, so learner and actors create identical consumers.

    max_ack_pending bounds how many of the job's tasks all actors together hold unacked: the
    feeder never has more than prompts_per_step * (max_staleness + 1) in flight, twice that
    leaves room for redeliveries without letting one slow actor hoard the queue.
    """
    in_flight = spec.rollout.prompts_per_step * (spec.train.max_staleness + 1)
    return {
        "ack_wait_s": spec.train.task_ack_wait_s,
        "max_deliver": spec.train.max_retries_per_episode,
        "max_ack_pending": max(4, 2 * in_flight),
    }


@dataclass(frozen=True)
class TaskQueue:
    """A job's task queue now (see TaskQueue in gateway.proto)."""

    job_id: str
    pending: int = 0
    in_flight: int = 0
    redelivered: int = 0
    dead_lettered: int = 0


async def task_queue(js: JetStreamContext, job_id: str) -> TaskQueue:
    """Depth of the job's task consumer and size of its dead-letter subject (zeros if none exist yet)."""
    try:
        info = await js.consumer_info(TASKS_STREAM, task_consumer(job_id), timeout=REQUEST_TIMEOUT_S)
        dlq = await js.stream_info(DLQ_STREAM, subjects_filter=dlq_subject(job_id))
    except NotFoundError:
        return TaskQueue(job_id)
    return TaskQueue(job_id, int(info.num_pending or 0), int(info.num_ack_pending or 0),
                     int(info.num_redelivered or 0), int((dlq.state.subjects or {}).get(dlq_subject(job_id), 0)))


async def ensure_job_consumer(js: JetStreamContext, job_id: str, spec: JobSpec) -> api.ConsumerInfo:
    """The job's shared task consumer, with the settings its spec implies."""
    limits = task_consumer_limits(spec)
    return await ensure_task_consumer(
        js, job_id, ack_wait_s=float(limits["ack_wait_s"]), max_deliver=int(limits["max_deliver"]),
        max_ack_pending=int(limits["max_ack_pending"]),
    )


async def publish_dead_letter(js: JetStreamContext, job_id: str, data: bytes, original_msg_id: str, reason: str,
                              deliveries: int, by: str) -> None:
    """A task to the job's dead-letter subject with why, after how many deliveries and who moved it
    (deduplicated on its original msg id, so moving it twice stores it once)."""
    headers = {"Fleet-Reason": " ".join(reason.split())[:1000], "Fleet-Deliveries": str(deliveries),
               "Fleet-Original-Msg-Id": original_msg_id, "Fleet-Actor-Id": by}
    if original_msg_id:
        headers["Nats-Msg-Id"] = f"dlq/{original_msg_id}"
    await js.publish(dlq_subject(job_id), data, headers=headers, timeout=REQUEST_TIMEOUT_S)


def advisory_consumer(job_id: str) -> str:
    """Durable consumer of the job's MAX_DELIVERIES advisories (the learner's)."""
    return f"dlq-{check_job_id(job_id)}"


async def ensure_advisory_consumer(js: JetStreamContext, job_id: str) -> api.ConsumerInfo:
    return await js.add_consumer(ADVISORIES_STREAM, api.ConsumerConfig(
        durable_name=advisory_consumer(job_id), filter_subject=max_deliveries_subject(job_id),
        ack_policy=api.AckPolicy.EXPLICIT, deliver_policy=api.DeliverPolicy.ALL))


async def dead_letter_exhausted(js: JetStreamContext, job_id: str) -> int:
    """Move every task the job's consumer stopped delivering (max_deliver reached) from FLEET_TASKS to
    the dead-letter subject; returns how many were moved now.

    Reads the job's MAX_DELIVERIES advisories through its durable `advisory_consumer` (created by
    `ensure_advisory_consumer`), so each is handled once even across restarts: dead-letter publish
    (deduplicated), then delete from the task stream, then ack the advisory. A learner calls it while
    it waits for data."""
    consumer = advisory_consumer(job_id)
    if not (await js.consumer_info(ADVISORIES_STREAM, consumer)).num_pending:
        return 0
    sub = await js.pull_subscribe_bind(consumer, ADVISORIES_STREAM)
    moved = 0
    try:
        for advisory in await sub.fetch(100, timeout=REQUEST_TIMEOUT_S):
            moved += await _move_exhausted(js, job_id, json.loads(advisory.data))
            await advisory.ack_sync(timeout=REQUEST_TIMEOUT_S)
    finally:
        await sub.unsubscribe()
    return moved


async def _move_exhausted(js: JetStreamContext, job_id: str, advisory: dict[str, Any]) -> int:
    seq, deliveries = int(advisory["stream_seq"]), int(advisory.get("deliveries", 0))
    try:
        msg = await js.get_msg(TASKS_STREAM, seq=seq)
    except NotFoundError:  # moved before (the advisory's ack was lost) or purged
        return 0
    reason = (f"delivered {deliveries} times without a result: each delivery killed or hung its actor "
              "(the task consumer's max_deliver)")
    await publish_dead_letter(js, job_id, msg.data or b"", (msg.headers or {}).get("Nats-Msg-Id", ""), reason,
                              deliveries, "server")
    await js.delete_msg(TASKS_STREAM, seq)
    log.error("job %s: task %s dead-lettered after %d deliveries by the server's delivery limit", job_id,
              (msg.headers or {}).get("Nats-Msg-Id", ""), deliveries)
    return 1


@dataclass(frozen=True)
class DeadLetter:
    """One task in a job's dead-letter subject."""

    task_id: str
    reason: str
    deliveries: int


async def _subject_messages(js: JetStreamContext, stream: str, subject: str) -> list[api.RawStreamMsg]:
    """Every message of one subject still in the stream, oldest first (one request per message)."""
    out: list[api.RawStreamMsg] = []
    seq = 1
    while True:
        try:
            msg = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        except NotFoundError:  # no message at or after seq on the subject (or no stream)
            return out
        out.append(msg)
        seq = int(msg.seq or 0) + 1


def _task_id_of_msg_id(msg_id: str) -> str:
    """`<job>/<epoch>/<index>` (task_msg_id) -> `<epoch>/<index>` (the task id)."""
    return msg_id.split("/", 1)[1] if "/" in msg_id else ""


async def job_tasks_in_stream(js: JetStreamContext, job_id: str) -> list[str]:
    """Task ids of the job's tasks still in FLEET_TASKS (queued, or held unacked by an actor).

    Work-queue retention refuses a second consumer on the subject, so this reads by sequence; the
    feeder's in-flight bound keeps it to a few hundred requests."""
    msgs = await _subject_messages(js, TASKS_STREAM, task_subject(job_id))
    return [_task_id_of_msg_id((m.headers or {}).get("Nats-Msg-Id", "")) for m in msgs]


async def dead_letters(js: JetStreamContext, job_id: str) -> list[DeadLetter]:
    """Every task in the job's dead-letter subject, with its reason."""
    out = []
    for m in await _subject_messages(js, DLQ_STREAM, dlq_subject(job_id)):
        headers = m.headers or {}
        out.append(DeadLetter(_task_id_of_msg_id(headers.get("Fleet-Original-Msg-Id", "")),
                              headers.get("Fleet-Reason", ""), int(headers.get("Fleet-Deliveries", "0") or 0)))
    return out
