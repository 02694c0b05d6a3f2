"""Step metrics carry the mean of each named reward component (`reward/<name>`)."""

from __future__ import annotations

from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.train.batch import component_means


def _group(*components: dict[str, float]) -> common_pb2.Group:
    return common_pb2.Group(samples=[common_pb2.Sample(reward_components=c) for c in components])


def test_means_over_the_samples_that_report_each_component() -> None:
    groups = [_group({"correct": 1.0, "format": 1.0}, {"correct": 0.0, "format": 1.0}),
              _group({"correct": 1.0}, {})]
    assert component_means(groups) == {"reward/correct": 2 / 3, "reward/format": 1.0}


def test_no_components_no_metrics() -> None:
    assert component_means([_group({}, {})]) == {}
