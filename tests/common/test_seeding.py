"""Seeding rules are deterministic and distinct."""

from fleetrl.spec.seeding import prompt_order, task_id, task_seed


def test_task_seed_is_stable_and_distinct() -> None:
    assert task_seed(0, "0/1") == task_seed(0, "0/1")
    assert len({task_seed(s, task_id(e, i)) for s in range(3) for e in range(3) for i in range(10)}) == 90


def test_prompt_order_is_a_permutation_per_epoch() -> None:
    first, second = prompt_order(50, 7, 0), prompt_order(50, 7, 1)
    assert sorted(first) == list(range(50)) and first != second
    assert prompt_order(50, 7, 0) == first
