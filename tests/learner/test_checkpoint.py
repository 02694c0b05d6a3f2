"""Checkpoints: bit-identical round trip, partial ones ignored, pruning, old cursors; the lease book's rules."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from learner_fleet import make_group, spec_for
from transformers import AutoModelForCausalLM

from fleetrl.errors import FailedPrecondition
from fleetrl.jobs.store import job_dir
from fleetrl.tasks.feeder import FeederCursor, tasks_to_publish
from fleetrl.train import checkpoint as ckpt
from fleetrl.train.export import MetricsLog, export_model
from fleetrl.train.files import NoSpace
from fleetrl.train.leases import LeaseBook, LeaseRecord
from fleetrl.train.trained_policy import Policy
from tests.conftest import SmallDisks


def trained_policy() -> Policy:
    policy = Policy(spec_for(max_steps=4))
    policy.step([make_group("j", f"0/{i}", 0, 3) for i in range(2)])
    return policy


def test_round_trip_is_bit_identical(tmp_path: Path) -> None:
    policy = trained_policy()
    torch.manual_seed(123)
    saved = policy.state(1, {"cursor": {"epoch": 0}, "leases": {"pending": [["l1", ["0/1"]]], "skip": []}})
    ckpt.save(tmp_path, saved)
    expected_draw = torch.rand(3)
    fresh = Policy(spec_for(max_steps=4))
    loaded = ckpt.load_latest(tmp_path)
    assert loaded is not None and loaded.step == 1 and loaded.state["cursor"] == {"epoch": 0}
    fresh.restore(loaded)
    for name, tensor in policy.model.state_dict().items():
        assert torch.equal(tensor, fresh.model.state_dict()[name]), name
    for a, b in zip(policy.optimizer.state.values(), fresh.optimizer.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert fresh.scheduler.state_dict() == policy.scheduler.state_dict()
    assert torch.equal(torch.rand(3), expected_draw)  # RNG restored to the saved point
    group = [make_group("j", f"0/{i}", 0, 3) for i in range(2, 4)]
    assert policy.step(group)["loss"] == fresh.step(group)["loss"]  # the next step is the same step


def test_a_full_disk_names_the_file_and_enospc_and_keeps_no_partial_checkpoint(tmp_path: Path,
                                                                               small_disk: SmallDisks) -> None:
    """Whichever file meets the full disk (the model's safetensors, torch.save's optimizer state), the
    error is NoSpace naming that file and ENOSPC, and the partial directory is gone, so the
    attempt keeps none of the space; once space returns the same checkpoint is written and loads."""
    saved = trained_policy().state(2, {"cursor": {"epoch": 0}, "leases": {"pending": [], "skip": []}})
    model_bytes = (ckpt.save(tmp_path / "sizes", saved) / "model.safetensors").stat().st_size
    root = small_disk.mount(tmp_path / "disk", 4 * model_bytes // 2**20 + 8) / "checkpoints"
    filler = small_disk.fill(root.parent)
    full = filler.stat().st_size
    for room, name in [(0, "model.safetensors"), (model_bytes + 64 * 1024, "optimizer.pt")]:
        os.truncate(filler, full - room)
        with pytest.raises(NoSpace) as caught:
            ckpt.write(root, saved, lease_epoch=1)
        error = caught.value
        assert error.errno == errno.ENOSPC and Path(error.filename).name == name, (room, error)
        assert "ENOSPC" in str(error) and str(root / "step-00000002.e1.tmp" / name) in str(error)
        assert sorted(p.name for p in root.iterdir()) == []  # the partial directory was deleted
    filler.unlink()
    ckpt.save(root, saved)
    loaded = ckpt.load_latest(root)
    assert loaded is not None and loaded.step == 2


def test_an_export_on_a_full_disk_names_its_directory_and_leaves_nothing(tmp_path: Path,
                                                                          small_disk: SmallDisks) -> None:
    """The job's exported model (JobRun.finish waits a full disk out with it, as with a checkpoint): NoSpace
    naming the model directory and ENOSPC, no partial or temporary directory left; once space returns the
    same export is written and loads."""
    policy = trained_policy()
    run_dir = small_disk.mount(tmp_path / "disk", 2)  # smaller than tiny-llama's weights
    target = job_dir(run_dir, "j") / "model"
    with pytest.raises(NoSpace) as caught:
        export_model(policy.exportable(), policy.tokenizer, run_dir, "j")
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(target), caught.value
    assert "ENOSPC" in str(caught.value) and [p.name for p in target.parent.iterdir()] == []
    run_dir = tmp_path / "roomy"
    loaded = AutoModelForCausalLM.from_pretrained(export_model(policy.exportable(), policy.tokenizer, run_dir, "j"))
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in policy.exportable().parameters())


def test_a_metrics_line_that_does_not_fit_is_cut_off_again(tmp_path: Path, small_disk: SmallDisks) -> None:
    """An append to metrics.jsonl on a full disk raises NoSpace naming the file and leaves whole lines
    only, so the learner can repeat it once there is room."""
    log = MetricsLog(small_disk.mount(tmp_path / "disk", 1) / "jobs" / "j" / "metrics.jsonl")
    record = {"step": 0, "task_ids": [f"0/{i}" for i in range(200)]}
    with pytest.raises(NoSpace) as caught:
        for step in range(1, 10_000):
            log.append({**record, "step": step})
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(log.path)
    assert [line["step"] for line in log.read()] == list(range(1, step))  # the torn line was cut off
    data = log.path.read_bytes()
    os.truncate(log.path, data.index(b"\n", len(data) // 2) + 1)  # room again: the same append goes through
    kept = len(log.read())
    log.append({**record, "step": kept + 1})
    assert [line["step"] for line in log.read()] == list(range(1, kept + 2))


def test_partial_checkpoints_are_ignored_and_pruned(tmp_path: Path) -> None:
    policy = trained_policy()
    for step in (1, 2, 3):
        ckpt.save(tmp_path, policy.state(step, {}))
    (tmp_path / "step-00000004.tmp").mkdir()  # killed while writing
    renamed = tmp_path / "step-00000005"  # killed between the rename and the marker
    renamed.mkdir()
    (renamed / "model.safetensors").write_bytes(b"partial")
    assert ckpt.complete_steps(tmp_path) == [1, 2, 3]
    loaded = ckpt.load_latest(tmp_path)
    assert loaded is not None and loaded.step == 3
    ckpt.prune(tmp_path, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000002", "step-00000003", "step-00000004.tmp",
                                            "step-00000005"]
    (tmp_path / "step-00000005.e1.tmp").mkdir()  # a fenced learner's partial attempt at step 5
    ckpt.complete(tmp_path, ckpt.write(tmp_path, policy.state(5, {}), lease_epoch=2))  # the resumed one's
    ckpt.prune(tmp_path, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000003", "step-00000005"]


def test_lease_book_skips_copies_of_trained_groups() -> None:
    book = LeaseBook()
    groups = [make_group("j", t, 0, 2) for t in ("0/1", "0/2")]
    assert book.split(groups) == (groups, 0)
    book.add([LeaseRecord("a", ("0/1", "0/2"))])
    fresh, copies = book.split([groups[0], make_group("j", "0/3", 0, 2)])  # lease "a" expired early
    assert [g.task_id for g in fresh] == ["0/3"] and copies == 1
    state = book.to_state()
    restored = LeaseBook.from_state(state)
    pending = restored.take_pending()
    restored.lost(pending[0])  # its commit said NOT_FOUND: the groups came back
    assert restored.split(groups) == ([], 2)
    assert restored.skip == set()  # the new lease holds them now
    assert LeaseBook(filter_copies=False).split(groups) == (groups, 0)


def test_lora_round_trip_holds_adapters_only_and_resumes_identically(tmp_path: Path) -> None:
    spec = spec_for(max_steps=4, lora={"rank": 4, "alpha": 8}, algorithm={"kl_coef": 0.1})
    policy = Policy(spec)
    policy.step([make_group("j", f"0/{i}", 0, 3) for i in range(2)])
    ckpt.save(tmp_path, policy.state(1, {}))
    loaded = ckpt.load_latest(tmp_path)
    assert loaded is not None and all(".lora_" in name for name in loaded.model)
    fresh = Policy(spec)
    fresh.restore(loaded)
    group = [make_group("j", f"0/{i}", 0, 3) for i in range(2, 4)]
    assert policy.step(group)["loss"] == fresh.step(group)["loss"]
    adapters = {n: p for n, p in policy.model.named_parameters() if p.requires_grad}
    resumed = {n: p for n, p in fresh.model.named_parameters() if p.requires_grad}
    assert adapters.keys() == resumed.keys() and all(torch.equal(adapters[n], resumed[n]) for n in adapters)


def publishable_after_drops(cursor: FeederCursor, stale_total: int) -> int:
    """What `Feeder.settle_stale(stale_total)` settles, then how many tasks `top_up` publishes (2 prompts a
    step, max_staleness 1)."""
    cursor.settled += max(0, stale_total - cursor.stale)
    return tasks_to_publish(cursor, 2, 1)


def test_a_cursor_saved_without_its_stale_count_resumes_with_the_drops_it_settled(tmp_path: Path) -> None:
    """A checkpoint of step 3 (2 groups a step, max_staleness 1) by a learner that settled each Sample
    reply's stale drops and saved no `stale`: 6 trained + 3 stale drops + 1 dead letter settled, 14
    published. Replay counts 5 drops now (2 reported to an incarnation that died after the checkpoint).
    Resumed, the feeder settles those 2 and publishes 2 tasks, as from the same cursor saved with
    stale = 3; taken as 0, all 5 drops were settled again and 4 tasks published (settled > published)."""
    old = {"epoch": 0, "position": 14, "published": 14, "settled": 10, "dead_lettered": 1}
    ckpt.save(tmp_path, ckpt.Checkpoint(step=3, model={"w": torch.zeros(1)}, optimizer={}, scheduler={},
                                        rng=ckpt.rng_state(), state={"cursor": old}))
    saved = ckpt.load_latest(tmp_path)
    assert saved is not None and "stale" not in saved.state["cursor"]
    resumed = FeederCursor.from_dict(saved.state["cursor"], trained_groups=saved.step * 2)
    current = FeederCursor.from_dict({**old, "stale": 3}, trained_groups=6)
    assert resumed == current and resumed.stale == 3
    assert publishable_after_drops(resumed, 5) == 2
    assert publishable_after_drops(FeederCursor(**old), 5) == 4  # stale taken as 0: over-publishes
    with pytest.raises(FailedPrecondition, match="holds no stale count"):
        FeederCursor.from_dict({**old, "settled": 5}, trained_groups=6)
