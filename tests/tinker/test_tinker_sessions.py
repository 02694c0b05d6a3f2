"""A session whose client went away (no heartbeat for session_idle_s) is finished and its runs freed."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import numpy as np
import pytest

from fleetrl.errors import NotFound, ResourceExhausted
from fleetrl.tinker.requests import RequestLog
from fleetrl.tinker.service import Limits, TinkerService
from fleetrl.tinker.types import LoraRequest
from tests.tinker.conftest import MODEL


def test_a_silent_session_is_reaped_and_a_live_one_kept(tmp_path: Path) -> None:
    service = TinkerService(Limits((MODEL,), (), tmp_path, 64, 64, 4, 8, 8),
                            RequestLog(concurrent.futures.ThreadPoolExecutor(1)))
    silent, live = service.create_session("alice"), service.create_session("alice")
    created = service.create_model("alice", silent, 0, MODEL, LoraRequest(rank=4, seed=0))
    created.future.result()
    sampler = service.create_sampling_session("alice", silent, MODEL, None)
    later = time.monotonic() + 301
    service.heartbeat("alice", live).last_seen = later - 10  # the live client's heartbeat, 10 s before
    assert service.reap(300, now=later) == [silent]
    with pytest.raises(NotFound):
        service.run("alice", created.extra["model_id"])
    with pytest.raises(NotFound):
        service.sampler("alice", sampler.id)
    assert not service.session("alice", live).finished


def test_a_replayed_request_that_queues_no_work_takes_no_place_in_the_quota(tmp_path: Path) -> None:
    """A creation whose work failed, sent again with the same name (the SDK's retry), is answered from the
    request log and runs nothing: it must not hold a training run's place in the tenant's quota."""
    service = TinkerService(Limits((MODEL,), (), tmp_path, 64, 64, 4, 8, 1),
                            RequestLog(concurrent.futures.ThreadPoolExecutor(1)))
    session = service.create_session("alice")
    missing = f"tinker://{session}:train:9/weights/none"
    failed = service.create_from_state("alice", session, 0, missing, False)
    with pytest.raises(NotFound):
        failed.future.result()
    for _ in range(3):
        assert service.create_from_state("alice", session, 0, missing, False) is failed
    created = service.create_model("alice", session, 1, MODEL, LoraRequest(rank=4, seed=0))  # the one place
    created.future.result()
    with pytest.raises(ResourceExhausted, match="holds 1 training runs"):
        service.create_model("alice", session, 2, MODEL, LoraRequest(rank=4, seed=0))


class Held(concurrent.futures.Executor):
    """An executor that never runs its work: a request stays queued."""

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        return concurrent.futures.Future()


def test_a_session_with_a_queued_request_is_working_and_listed_to_its_tenant_only(tmp_path: Path) -> None:
    service = TinkerService(Limits((MODEL,), (), tmp_path, 64, 64, 4, 8, 8), RequestLog(Held()))
    session = service.create_session("alice")
    service.session("alice", session).last_request -= 100  # created 100 s ago
    service.create_model("alice", session, 0, MODEL, LoraRequest(rank=4, seed=0))  # queued, never run
    (summary,) = service.sessions("alice")
    assert (summary.session_id, summary.tenant, summary.state, summary.training_runs) == (session, "alice",
                                                                                           "working", 0)
    assert summary.last_request_age_s < 100  # the create_model request counted
    assert service.sessions("bob") == []
    service.finish_session("alice", session)
    assert service.sessions("alice") == []


def test_training_runs_on_one_base_share_it_and_train_apart(tmp_path: Path) -> None:
    """Two runs on one base hold its weights once (one copy of every frozen tensor); a step of one leaves
    the other's losses as they were; the base is dropped with the last run's session."""
    from fleetrl.tinker.types import AdamParams, Datum

    service = TinkerService(Limits((MODEL,), (), tmp_path, 64, 64, 4, 8, 8),
                            RequestLog(concurrent.futures.ThreadPoolExecutor(1)))
    sessions = [service.create_session("alice"), service.create_session("bob")]
    ids = []
    for seq, (tenant, session) in enumerate(zip(("alice", "bob"), sessions, strict=True)):
        created = service.create_model(tenant, session, seq, MODEL, LoraRequest(rank=4, seed=seq))
        created.future.result()
        ids.append(created.extra["model_id"])
    first, second = service.run("alice", ids[0]), service.run("bob", ids[1])
    assert service._bases.held() == {(MODEL, "cpu"): 2}
    frozen = [{n: p.data_ptr() for n, p in run.model.named_parameters() if not p.requires_grad}
              for run in (first, second)]
    assert frozen[0] == frozen[1] and frozen[0]
    tokens = list(range(5, 17))
    datum = Datum(tokens[:-1], {"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1)})

    def loss(run_id: str, tenant: str, seq: int, backward: bool) -> float:
        result = service.forward_backward(tenant, run_id, seq, [datum], "cross_entropy", {}, not backward)
        return float(result.future.result().metrics["loss:sum"])

    before = loss(ids[1], "bob", 1, False)
    loss(ids[0], "alice", 1, True)
    service.optim_step("alice", ids[0], 2, AdamParams(learning_rate=1e-2)).future.result()
    assert loss(ids[0], "alice", 3, False) != before  # alice's adapter moved
    assert loss(ids[1], "bob", 2, False) == before  # bob's did not
    service.finish_session("alice", sessions[0])
    assert service._bases.held() == {(MODEL, "cpu"): 1}
    service.finish_session("bob", sessions[1])
    assert service._bases.held() == {}
