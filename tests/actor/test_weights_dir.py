"""An actor with `weights_dir` set (as every service of such a fleet is): the job's pointer and weights are read
from files there (`FilesystemTransport`), none from NATS, and a task's group is stored under that version."""

from __future__ import annotations

from pathlib import Path

import nats.js.errors
import pytest
from actor_fleet import MODEL, Fleet, job_spec, wait_until

from fleetrl.policy import models
from fleetrl.tasks import bus
from fleetrl.weights.channel import WeightChannel, encode_safetensors
from fleetrl.weights.filesystem import FilesystemTransport


async def test_an_actor_with_a_weights_dir_pulls_the_jobs_weights_from_files(fleet: Fleet, tmp_path: Path) -> None:
    weights_dir = tmp_path / "weights"
    job = await fleet.create_job(job_spec(rollout={"samples_per_prompt": 2, "max_new_tokens": 8}), [])
    tensors = models.state_dict_for_publish(models.load(MODEL)[0], "bfloat16")
    pointer = await WeightChannel(FilesystemTransport(weights_dir)).publish(job, 0, encode_safetensors(tensors),
                                                                           "bfloat16")
    fleet.start_actor("w0", f"weights_dir={weights_dir}")
    await wait_until(lambda: "loaded weights v0" in fleet.log_text("w0"), 90, "w0 to hold v0")
    await fleet.publish_task(job, 0, "What is 2 + 3? Answer with just the number.", "5")

    async def inserted() -> bool:
        return (await fleet.replay.stats(job)).inserted == 1

    await wait_until(inserted, 90, "the group in replay")
    [record] = await fleet.replay.query(job)
    assert record.lineage.actor_id == "w0" and record.policy_version == 0
    assert (weights_dir / job).is_dir() and pointer.version == 0
    with pytest.raises(nats.js.errors.BucketNotFoundError):  # nothing of the job's weights went to NATS
        await fleet.js.object_store(bus.weights_bucket(job))
