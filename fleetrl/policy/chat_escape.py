"""Environment text that can never become a special token: escaping before the chat template.

An episode's observations and tool schemas are written by the tenant's environment file (run in the
reward service's sandbox) and rendered by the chat template into one string that the tokenizer then
splits at its added tokens. Unescaped, an observation holding `<|im_start|>system` or a tool named
`<|im_end|>` would become those special token ids, indistinguishable from the template's own.

The encoding: every occurrence, in environment text, of the content of any of the tokenizer's added
tokens (`tokenizer.added_tokens_decoder`: the special tokens and the other added ones, such as a
template's `<tool_call>`) gets a U+200B (zero width space) after its first character, so
`<|im_end|>` is rendered as `<` U+200B `|im_end|>` and tokenized as ordinary text; decoding shows
the original characters with the U+200B between them. Escaping repeats until nothing matches, so
overlapping token strings are all broken. Two kinds of added token are left alone: whitespace-only
ones (runs of spaces or newlines some tokenizers add as text pieces, never template markers) and
one-character ones (nothing can be inserted inside them). Matching is on the text as written: an
added token the tokenizer matches after its normalizer (`normalized=True`, none in SmolLM2's) could
still be reached by a variant that normalizes to it. The pattern of token strings is computed
once per tokenizer (`_patterns`, keyed weakly by the tokenizer object).

Why not `split_special_tokens=True`: it applies to a whole tokenization call, and the template's own
markers are in the same rendered string, so it would need the string tokenized in segments, whose
boundaries tokenize differently from the whole (a byte-level BPE merges across them); and it covers
special tokens only, not the other added ones. The zero width space keeps one rendering and one
tokenizer call, and leaves text without a token string exactly as it was.

What is environment text is decided by the caller (fleetrl/rollout/episodes.py): the contents of the
environment's observation messages (first and later) and every string of its tool schemas, keys
included. The job's own text (its prompts, the rollout's system prompt) is not escaped. Roles are not
escaped: the reward service accepts only the known role names (fleetrl/env/host.py).
"""

from __future__ import annotations

import re
import weakref
from typing import Any

SEPARATOR = "\u200b"
"""What is inserted after the first character of a token string found in environment text."""

_patterns: weakref.WeakKeyDictionary[Any, re.Pattern[str] | None] = weakref.WeakKeyDictionary()


def escapable_tokens(tokenizer: Any) -> list[str]:
    """The token strings environment text must not contain: every added token's content with at least
    two characters and something other than whitespace, longest first."""
    contents = {token.content for token in tokenizer.added_tokens_decoder.values()}
    contents |= set(tokenizer.all_special_tokens)
    return sorted((c for c in contents if len(c) > 1 and not c.isspace() and SEPARATOR not in c),
                  key=lambda c: (-len(c), c))


def _pattern(tokenizer: Any) -> re.Pattern[str] | None:
    if tokenizer not in _patterns:
        tokens = escapable_tokens(tokenizer)
        _patterns[tokenizer] = re.compile("|".join(map(re.escape, tokens))) if tokens else None
    return _patterns[tokenizer]


def _split(match: re.Match[str]) -> str:
    return match[0][0] + SEPARATOR + match[0][1:]


def escape_text(tokenizer: Any, text: str) -> str:
    """`text` with every token string of `escapable_tokens` broken by a zero width space."""
    pattern = _pattern(tokenizer)
    if pattern is None:
        return text
    escaped = pattern.sub(_split, text)
    while escaped != text:  # a token string overlapping one just broken is found on the next pass
        text, escaped = escaped, pattern.sub(_split, escaped)
    return text


def escape_messages(tokenizer: Any, messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The environment's messages with their contents escaped (roles kept)."""
    return [{**message, "content": escape_text(tokenizer, message["content"])} for message in messages]


def escape_json(tokenizer: Any, value: Any) -> Any:
    """A JSON value (the environment's tool schemas) with every string in it escaped, keys included."""
    if isinstance(value, str):
        return escape_text(tokenizer, value)
    if isinstance(value, list):
        return [escape_json(tokenizer, item) for item in value]
    if isinstance(value, dict):
        return {escape_text(tokenizer, key): escape_json(tokenizer, item) for key, item in value.items()}
    return value
