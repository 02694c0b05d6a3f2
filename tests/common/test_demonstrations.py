"""An sft job's spec and its demonstrations file: every bad line named with the field inside it, all at once
at submission; the learner's reader names the first; an sft spec refuses what only RL jobs use."""

from __future__ import annotations

import json

import pytest

from fleetrl.errors import ConfigError
from fleetrl.spec.config import parse_job_spec
from fleetrl.spec.demonstrations import demonstration_violations, read_demonstrations

GOOD = {"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}],
        "tools": [{"type": "function", "function": {"name": "calc"}}]}
BAD_LINES = [
    ("{not json", "", "not JSON"),
    ('["a list"]', "", "not a JSON object"),
    ('{"prompt": "a prompt file, not demonstrations"}', ".messages", "non-empty list of messages"),
    ('{"messages": []}', ".messages", "non-empty list of messages"),
    ('{"messages": ["hi"]}', ".messages[0]", "not a JSON object"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}', ".messages[1].role",
     "must be one of system, user, assistant, tool, not 'robot'"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": null}]}',
     ".messages[1].content", "must be a string"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]}', ".messages",
     "no assistant message"),
    ('{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}', ".messages[0]",
     "opens with the assistant"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "tools": "calc"}',
     ".tools", "list of JSON objects"),
    ("", "", "blank line"),
]


def test_every_bad_line_is_named_with_the_field_inside_it() -> None:
    data = "\n".join([json.dumps(GOOD), *(line for line, _, _ in BAD_LINES), json.dumps(GOOD)]).encode()
    found = demonstration_violations(data)
    assert [v.field for v in found] == [f"prompts[line {n}]{where}" for n, (_, where, _) in enumerate(BAD_LINES, 2)]
    for violation, (_, _, why) in zip(found, BAD_LINES, strict=True):
        assert why in violation.description, violation


def test_the_reader_keeps_good_lines_and_names_the_first_bad_one() -> None:
    demonstrations = read_demonstrations(f"{json.dumps(GOOD)}\n\n{json.dumps({'messages': GOOD['messages']})}\n"
                                         .encode())
    assert [(d.line, d.tools is not None) for d in demonstrations] == [(1, True), (3, False)]
    with pytest.raises(ConfigError) as caught:
        read_demonstrations(f"{json.dumps(GOOD)}\n{BAD_LINES[7][0]}\n".encode())
    assert [v.field for v in caught.value.violations] == ["prompts[line 2].messages"]
    assert [v.field for v in demonstration_violations(b"  \n")] == ["prompts"]
    assert [v.field for v in demonstration_violations(b"\xff\n")] == ["prompts"]


SFT = 'name = "warm"\nmodel = "tiny-llama"\nprompts = "demos.jsonl"\n[algorithm]\nname = "sft"\n'


def test_an_sft_spec_needs_no_reward_and_refuses_what_only_rl_uses() -> None:
    spec = parse_job_spec(SFT + "[sft]\nconversations_per_step = 2\nmax_seq_tokens = 512\n")
    assert not spec.rolls_out and spec.sft.conversations_per_step == 2 and spec.reward is None
    assert parse_job_spec(SFT.replace('"sft"', '"grpo"') + '[reward]\nbuiltin = "numeric_match"\n').rolls_out
    for extra, why in [('[reward]\nbuiltin = "numeric_match"\n', "remove the [reward] and [environment]"),
                       ('[environment]\nfile = "env.py"\n', "remove the [reward] and [environment]"),
                       ('[eval]\nprompts = "e.jsonl"\ninterval = 5\n', "eval.interval"),
                       ("[rollout]\ntemperature = 0.7\n", "rollout.temperature"),
                       ("[sft]\nmax_seq_tokens = 1\n", "greater than or equal to 2")]:
        with pytest.raises(ConfigError) as caught:
            parse_job_spec(SFT + extra)
        assert why in str(caught.value.violations), extra
