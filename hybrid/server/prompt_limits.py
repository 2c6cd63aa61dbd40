"""Refusing over-long prompts without paying for them: a prompt is checked against the context by
its length first, and by a bounded prefix next, before it is tokenized in full.

1. Size alone. If no token covers more than `max_token_chars` characters of text (the adapter knows
   this for tokenizers that cover every input byte), a text of C characters has at least
   C / max_token_chars tokens: one that long is refused without tokenizing any of it.
2. A bounded prefix. Otherwise a long text is tokenized in growing prefixes (4 characters per allowed
   token first, then doubling): once a prefix has `limit + SLACK` tokens the text is refused. So a
   refused prompt costs at most a few times the tokenization of a prompt that just fits, however long
   it is. (A prefix can tokenize differently from the same characters inside the full text only at
   its cut, by a few tokens; SLACK covers that, so a prompt that fits is never refused.)
A prompt that passes both is tokenized in full, exactly as before.
"""

from __future__ import annotations

from typing import Callable

SLACK = 16  # tokens a prefix may gain at its cut relative to the full text
FIRST_PREFIX_CHARS_PER_TOKEN = 4


class PromptTooLong(Exception):
    def __init__(self, at_least: int):
        super().__init__(at_least)
        self.at_least = at_least  # a lower bound on the prompt's tokens, >= the limit


def floor_by_size(chars: int, max_token_chars: int | None) -> int:
    """Fewest tokens a text of `chars` characters can have (0 if the tokenizer gives no such bound)."""
    return -(-chars // max_token_chars) if max_token_chars else 0


def check_sizes(texts: list[str], limit: int, max_token_chars: int | None) -> None:
    """Step 1 (cheap: lengths only): PromptTooLong if the texts together must have >= limit tokens."""
    floor = sum(floor_by_size(len(t), max_token_chars) for t in texts)
    if floor >= limit:
        raise PromptTooLong(floor)


def check_prefixes(encode: Callable[[str], list], texts: list[str], limit: int) -> None:
    """Step 2: PromptTooLong once prefixes of the texts together reach limit + SLACK tokens. Texts
    short enough to be cheap are left to the full tokenization that follows."""
    first = FIRST_PREFIX_CHARS_PER_TOKEN * limit
    floors = [0] * len(texts)
    for i, text in enumerate(texts):
        p = first
        while p < len(text):
            floors[i] = max(0, len(encode(text[:p])) - SLACK)
            if sum(floors) >= limit:
                raise PromptTooLong(sum(floors))
            p *= 2
