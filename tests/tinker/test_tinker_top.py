"""`fleetrl top` lists the caller's live Tinker sessions: the official SDK trains on a real Tinker API server,
and top's client, frame, table and JSON show each session with its tenant, shape and optimizer steps;
another tenant's session is its own row, in that tenant's view only, unless an operator asks for every
tenant's (`fleetrl top --all-tenants`)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest
import tinker
from rich.console import Console
from tinker import types

from fleetrl.errors import PermissionDenied
from fleetrl.launcher import top
from fleetrl.sdk.records import FleetInfo
from tests.tinker.conftest import KEYS, MODEL, TinkerServer

ADAM = types.AdamParams(learning_rate=1e-3)
TOKENS = list(range(1000, 1012))


def trained(client: tinker.ServiceClient, rank: int, steps: int) -> tinker.TrainingClient:
    tc = client.create_lora_training_client(base_model=MODEL, rank=rank, seed=0).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:]})
    for _ in range(steps):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(ADAM).result()
    return tc


class NoJobs:
    """The gateway's side of top, empty: this test is about the Tinker API's side."""

    address = "gateway-not-asked"

    def fleet(self, all_tenants: bool = False) -> FleetInfo:
        return FleetInfo([], [], 0, "mode jail")

    def list_jobs(self, limit: int, all_tenants: bool = False) -> list[object]:
        return []


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerServer]:
    """This module's server: alice is an operator (`operators`), bob is not."""
    running = TinkerServer(tmp_path_factory.mktemp("tinker-top"), max_training_runs_per_tenant=100,
                           operators=["alice"]).start()
    yield running
    running.stop()


def frame_of(server: TinkerServer, tenant: str, *flags: str) -> top.Frame:
    args = top.parser().parse_args(["--tinker", server.url, "--token", KEYS[tenant], "--once", "--json", *flags])
    return top.snapshot(NoJobs(), top.tinker_client(args), args.all_tenants)  # type: ignore[arg-type]


def rendered(frame: top.Frame) -> str:
    out = Console(file=io.StringIO(), width=240, record=True)
    out.print(top.render(frame))
    return out.export_text()


def test_top_shows_each_tenants_live_sessions_with_their_steps(server: TinkerServer) -> None:
    alice, bob = server.client("alice"), server.client("bob")
    alice_run = trained(alice, rank=4, steps=2)
    alice_run.save_weights_and_get_sampling_client().result()
    bob_run = trained(bob, rank=8, steps=1)
    alice_session, bob_session = (tc.model_id.partition(":")[0] for tc in (alice_run, bob_run))

    mine = frame_of(server, "alice")
    assert [s.session_id for s in mine.sessions or []] == [alice_session]  # bob's is not alice's to see
    (session,) = mine.sessions or []
    assert (session.tenant, session.state, session.base_models, session.lora_ranks) == ("alice", "idle", (MODEL,), (4,))
    assert (session.training_runs, session.sampling_sessions, session.optim_steps) == (1, 1, 2)
    assert 0 <= session.last_request_age_s < 60

    data = json.loads(json.dumps(mine.to_dict()))  # what `fleetrl top --json` prints
    assert data["tinker"] == server.url
    assert [(s["session_id"], s["tenant"], s["optim_steps"]) for s in data["sessions"]] == [(alice_session, "alice", 2)]
    text = rendered(mine)
    assert "tinker sessions" in text and bob_session not in text
    row = [cell.strip() for cell in next(line for line in text.splitlines() if alice_session in line).split("│")]
    assert row[1:-2] == [alice_session, "alice", "idle", MODEL, "4", "1", "1", "2"] and row[-2].endswith("s ago")

    theirs = frame_of(server, "bob")
    assert [(s.session_id, s.tenant, s.lora_ranks, s.optim_steps) for s in theirs.sessions or []] == [
        (bob_session, "bob", (8,), 1)]
    assert alice_session not in rendered(theirs)

    # alice is an operator: asked, her view holds every tenant's sessions, by tenant; bob may not ask
    everyone = frame_of(server, "alice", "--all-tenants")
    assert sorted((s.session_id, s.tenant) for s in everyone.sessions or []) == sorted(
        [(alice_session, "alice"), (bob_session, "bob")])
    assert bob_session in rendered(everyone)
    with pytest.raises(PermissionDenied, match="not an operator"):
        frame_of(server, "bob", "--all-tenants")

    # the SDK's own list_sessions sees the same ids, and a closed session leaves the listing
    rest = tinker.RestClient(base_url=server.url, api_key=KEYS["alice"])
    assert rest.list_sessions().result().sessions == [alice_session]
    alice.close("success").result()
    assert frame_of(server, "alice").sessions == []
    assert [s.session_id for s in frame_of(server, "bob").sessions or []] == [bob_session]
    bob.close("success").result()


def test_top_without_a_tinker_api_has_no_sessions_table() -> None:
    frame = top.snapshot(NoJobs())  # type: ignore[arg-type]
    assert frame.to_dict()["sessions"] is None and "tinker sessions" not in rendered(frame)

