"""Fixture of the end-to-end tests: one whole fleet per session, shared by test_fleet_e2e.py and
test_fleet_faults.py (a fleet start costs about a minute on 2 cores; see e2e_fleet.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2e_fleet import FleetUnderTest, running_fleet


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetUnderTest]:
    with running_fleet(tmp_path_factory.mktemp("fleet")) as running:
        yield running
