"""Learner tests start learners (and torchrun) as real processes: none outlives its test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from learner_fleet import kill_started


@pytest.fixture(autouse=True)
def _no_learner_outlives_its_test() -> Iterator[None]:
    yield
    kill_started()
