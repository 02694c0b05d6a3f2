"""Fixture of the observability tests: one traced fleet per module (see obs_fleet.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from obs_fleet import TracedFleet, traced_fleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TracedFleet]:
    with traced_fleet(tmp_path_factory.mktemp("traced")) as running:
        yield running


@pytest.fixture(scope="module")
def finished(fleet: TracedFleet) -> TracedFleet:
    """The fleet after its job succeeded."""
    job = fleet.run.wait(timeout_s=300)
    assert job.state == "succeeded", job.reason
    return fleet
