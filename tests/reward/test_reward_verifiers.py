"""Built-in verifiers: table-driven extraction and equivalence, and the built-ins through the service."""

from __future__ import annotations

import pytest

from fleetrl.proto.fleetrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from fleetrl.reward import verifiers
from fleetrl.reward.scorer import check_builtin
from tests.reward.conftest import builtin_spec, items

OK, TIMEOUT = common_pb2.REWARD_STATUS_OK, common_pb2.REWARD_STATUS_TIMEOUT


@pytest.mark.parametrize(("text", "mode", "want"), [
    ("The answer is 57.", "last_number", "57"),
    ("3 apples and 4 pears: 7", "last_number", "7"),
    ("total 1,234.5 dollars", "last_number", "1,234.5"),
    ("-12", "last_number", "-12"),
    ("no digits here", "last_number", None),
    ("so \\boxed{\\frac{1}{2}} done", "boxed", "\\frac{1}{2}"),
    ("\\boxed{1} then \\boxed{{2}}", "boxed", "{2}"),
    ("\\boxed{unclosed", "boxed", None),
    ("work...\n#### 72", "hash", "72"),
    ("#### 1,000", "hash", "1,000"),
    (" 57 \n", "strict", "57"),
    ("57.", "strict", None),
    ("It is 57", "strict", None),
    ("\\boxed{3} and #### 4 and 5", "auto", "3"),
    ("#### 4 and 5", "auto", "4"),
    ("just 5", "auto", "5"),
])
def test_extraction(text: str, mode: str, want: str | None) -> None:
    assert verifiers.extract_answer(text, mode) == want


@pytest.mark.parametrize(("completion", "answer", "params", "want"), [
    ("57", "57", {}, 1.0),
    ("The sum is 57.", "57", {}, 1.0),
    ("58", "57", {}, 0.0),
    ("1,000", "1000", {}, 1.0),
    ("0.5", "1/2", {}, 0.0),
    ("Natalia sold 72", "She sold 48 + 24 = 72 clips\n#### 72", {}, 1.0),
    ("The sum is 57.", "57", {"extract": "strict"}, 0.0),
    ("\\boxed{57} but 12", "57", {"extract": "boxed"}, 1.0),
])
def test_numeric_match(completion: str, answer: str, params: dict[str, object], want: float) -> None:
    value = verifiers.resolve("numeric_match", params)(completion, "p", answer=answer)
    assert verifiers.scalar(value) == want


@pytest.mark.parametrize(("completion", "answer", "want"), [
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("The answer is $\\frac{2}{4}$", "\\frac{1}{2}", 1.0),
    ("$x^2+2x+1$", "(x+1)^2", 1.0),
    ("\\boxed{\\sqrt{2}}", "2^{1/2}", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("\\boxed{[1,2]}", "[1,2]", 1.0),
    ("no math here", "4", 0.0),
])
def test_math_equivalence(completion: str, answer: str, want: float) -> None:
    assert verifiers.resolve("math_equiv", {})(completion, "p", answer=answer) == want


@pytest.mark.parametrize(("completion", "answer", "params", "want"), [
    ("Paris", "paris", {}, 1.0),
    ("  Paris. ", "Paris", {}, 1.0),
    ("Paris", "paris", {"case_sensitive": True}, 0.0),
    ("answer: \\boxed{Paris}", "Paris", {"extract": "boxed"}, 1.0),
])
def test_exact_match(completion: str, answer: str, params: dict[str, object], want: float) -> None:
    assert verifiers.resolve("exact_match", params)(completion, "p", answer=answer) == want


def test_regex_length_and_weighted_sum() -> None:
    fmt = verifiers.resolve("regex", {"pattern": r"\s*-?\d+\s*", "mode": "fullmatch"})
    assert (fmt("57", "p"), fmt("57 apples", "p")) == (1.0, 0.0)
    penalty = verifiers.resolve("length_penalty", {"max_length": 10, "penalty": 2.0})
    assert [penalty("x" * n, "p") for n in (5, 10, 15, 20, 40)] == [0.0, 0.0, -1.0, -2.0, -2.0]
    addition = verifiers.resolve("weighted_sum", {"terms": [
        {"builtin": "numeric_match", "name": "correct"},
        {"builtin": "regex", "params": {"pattern": r"\s*-?\d+\s*", "mode": "fullmatch"}, "weight": 0.5,
         "name": "format"}]})
    assert addition("57", "p", answer="57") == {"correct": 1.0, "format": 1.0, "reward": 1.5}
    assert addition("It is 57", "p", answer="57") == {"correct": 1.0, "format": 0.0, "reward": 1.0}
    numeric = verifiers.resolve("numeric_match", {"format_weight": 0.5})
    assert numeric("58", "p", answer="57") == {"correct": 0.0, "format": 1.0, "reward": 0.5}


@pytest.mark.parametrize(("name", "params", "field"), [
    ("no_such", {}, "reward.builtin"),
    ("numeric_match", {"extract": "first"}, "reward.params.extract"),
    ("numeric_match", {"tolerance": 1}, "reward.params.tolerance"),
    ("regex", {"pattern": "("}, "reward.params"),
    ("length_penalty", {}, "reward.params.max_length"),
    ("weighted_sum", {"terms": [{"builtin": "nope"}]}, "reward.params.terms.0"),
])
def test_bad_builtin_specs_name_the_field(name: str, params: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError) as caught:
        check_builtin(name, params)
    assert any(v.field.startswith(field) for v in caught.value.violations)  # type: ignore[attr-defined]


async def test_builtins_through_the_service(reward_stub: reward_pb2_grpc.RewardServiceStub) -> None:
    spec = builtin_spec("numeric_match", {"extract": "last_number", "format_weight": 0.5})
    reply = await reward_stub.Score(reward_pb2.ScoreRequest(job_id="add", spec=spec, items=items(
        ("57", {"answer": "57"}), ("I think 57", {"answer": "57"}), ("56", {"answer": "57"}), ("57", {}))),
        timeout=30)
    got = [(r.status, r.reward, dict(r.components)) for r in reply.results]
    assert got[:3] == [(OK, 1.5, {"correct": 1.0, "format": 1.0}), (OK, 1.0, {"correct": 1.0, "format": 0.0}),
                       (OK, 0.5, {"correct": 0.0, "format": 1.0})]
    assert got[3][0] == common_pb2.REWARD_STATUS_ERROR and "answer" in reply.results[3].reason
    math_reply = await reward_stub.Score(reward_pb2.ScoreRequest(job_id="m", spec=builtin_spec("math_equiv"),
        items=items(("\\boxed{\\frac{1}{2}}", {"answer": "0.5"}))), timeout=60)
    assert math_reply.results[0].status == OK and math_reply.results[0].reward == 1.0
    bad = await reward_stub.Validate(reward_pb2.ValidateRequest(spec=builtin_spec("regex", {"pattern": "("})),
                                     timeout=10)
    assert not bad.ok and "reward.params" in bad.reason


async def test_code_tests_run_completions_sandboxed(reward_stub: reward_pb2_grpc.RewardServiceStub) -> None:
    params = {"tests": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", {"input": "4 5\n", "output": "9"}],
              "per_test_timeout_s": 0.5}
    good = "```python\nimport sys\ndef add(a, b):\n    return a + b\nif sys.stdin.read().strip():\n" \
           "    pass\n```\n"
    io = "```python\nimport sys\ndef add(a, b):\n    return a + b\ndata = sys.stdin.read().split()\n" \
         "if data:\n    print(add(*map(int, data)))\n```"
    wrong = "def add(a, b):\n    return a + b if a > 0 else 99\n"
    hang = "def add(a, b):\n    while True:\n        pass\n"
    forks = "import os\nos.fork()\ndef add(a, b):\n    return a + b\n"
    net = "import socket\nsocket.create_connection(('127.0.0.1', 1))\ndef add(a, b):\n    return a + b\n"
    reply = await reward_stub.Score(reward_pb2.ScoreRequest(
        job_id="c", spec=builtin_spec("code_tests", params, timeout_s=5.0),
        items=items(*[(c, {}) for c in (io, good, wrong, hang, forks, net)])), timeout=30)
    rewards = [round(r.reward, 3) for r in reply.results]
    assert all(r.status == OK for r in reply.results), [r.reason for r in reply.results]
    assert rewards == [1.0, 0.667, 0.333, 0.0, 0.0, 0.0]
