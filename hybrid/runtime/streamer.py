"""The text of a generated sequence, streamed as it grows: incremental detokenization with stop strings.

One implementation for `hybrid generate`/`hybrid chat` (hybrid.runtime.generation) and the server.

Each new token re-decodes the sequence's generated ids (cheap next to a model step, and the only way
that is correct for byte-level and sentencepiece tokenizers alike) and hands out only text that is
final: nothing while the text ends in an incomplete UTF-8 sequence (U+FFFD), and never the tail that
could still turn into a stop string, so a stop string is never half-streamed and then taken back.
"""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()):
        self._decode = decode
        self._stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self.ids: list[int] = []
        self.text = ""  # the sequence's text so far; cut before the stop string once one is hit
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string was found

    def push(self, token_id: int) -> str:
        """Add a generated token; return the text that became final (maybe "")."""
        self.ids.append(token_id)
        text = self._decode(self.ids)
        if text.endswith(REPLACEMENT):
            return ""  # a multi-byte character is split across tokens; wait for the rest
        return self._advance(text, final=False)

    def finish(self) -> str:
        """The sequence ended (length, EOS, cancel): hand out everything still held back."""
        if self.stopped:
            return ""
        return self._advance(self._decode(self.ids), final=True)

    def _advance(self, text: str, final: bool) -> str:
        hold = 0
        if self._stop:
            start = max(0, self.emitted - self._max_stop + 1)
            hits = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                # Found: the text ends before the earliest stop string (OpenAI leaves it out).
                text = text[: max(min(hits), self.emitted)]
                self.stopped = True
                final = True
            elif not final:
                hold = self._held_suffix(text)
        self.text = text
        end = len(text) - hold
        out = text[self.emitted : end] if end > self.emitted else ""
        self.emitted += len(out)
        return out

    def _held_suffix(self, text: str) -> int:
        """Length of the longest unemitted suffix of `text` that is a proper prefix of a stop string."""
        for k in range(min(self._max_stop - 1, len(text) - self.emitted), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
