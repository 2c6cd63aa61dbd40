"""Reasoning split from the answer: a thinking model's generated text -> (reasoning_content, content).

Two formats, chosen from the model's chat template (`reasoning_format_for`):

- "think": `<think>...</think>` then the answer (Qwen3, DeepSeek-R1 / V3.1, GLM-4.5, Kimi-K2-Thinking).
  Reasoning is only where the output starts: a `<think>` first (after whitespace) opens it, or the prompt
  already opened it (templates that prefill `<think>` in the generation prompt: Qwen3 thinking models,
  DeepSeek-R1 and V3.1 with thinking on; see `prompt_opens_reasoning`). A `<think>` later in the answer
  is text. Newlines around the reasoning and at the start of the answer are dropped, as the templates
  drop them when they render the turn again.
- "harmony" (gpt-oss): messages `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>
  final<|message|>...`. analysis -> reasoning, final and commentary without a recipient -> content,
  commentary to=functions.NAME -> a tool call (handed on whole: hybrid.server.tool_calls reads it). The
  stop token (`<|return|>`, `<|call|>`) is not in the text: the last message ends with the text.

Both are streaming splitters (`feed(delta)` -> Split of new text, `finish()` at the end) that hold back
text that may still turn into a marker, so a marker is never half-streamed; `split_reasoning(text, ...)` is
the same splitter fed the whole text, so a streamed answer reassembles to exactly the unstreamed one.
The server must decode with special tokens kept where the markers are special tokens (gpt-oss, GLM-4.5).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

THINK_START, THINK_END = "<think>", "</think>"
HARMONY_FAMILIES = ("gpt_oss",)
HEADER_MAX_CHARS = 256  # a harmony header longer than this without <|message|> is not a header: text


@dataclass
class Split:
    """New text since the last call, in order: events ("reasoning" | "content", text) and, for harmony,
    ("call", (recipient, body)): a whole message to a function. Order is kept, so that what a consumer
    builds from the events does not depend on how the text was cut into deltas."""

    events: list = field(default_factory=list)

    def put(self, kind: str, value) -> None:
        if not value:
            return
        if kind != "call" and self.events and self.events[-1][0] == kind:
            self.events[-1] = (kind, self.events[-1][1] + value)
        else:
            self.events.append((kind, value))

    def add(self, other: Split) -> Split:
        for kind, value in other.events:
            self.put(kind, value)
        return self

    @property
    def reasoning(self) -> str:
        return "".join(v for k, v in self.events if k == "reasoning")

    @property
    def content(self) -> str:
        return "".join(v for k, v in self.events if k == "content")

    @property
    def calls(self) -> list:
        return [v for k, v in self.events if k == "call"]


def reasoning_format_for(family: str | None, chat_template: str | None) -> str | None:
    """'harmony' for gpt-oss, 'think' for a template that writes <think>...</think>, else None (no split)."""
    template = chat_template or ""
    if family in HARMONY_FAMILIES or "<|channel|>" in template:
        return "harmony"
    if THINK_END in template:
        return "think"
    return None


def prompt_opens_reasoning(prompt_tail: str, fmt: str | None = "think") -> bool:
    """Whether the prompt ends inside a think block: its generation prompt ends with `<think>` (then only
    whitespace), so the output starts in the reasoning. `prompt_tail` is the end of the prompt text with
    special tokens kept (its last few tokens decoded suffice); client text cannot end the prompt, since
    the template writes the assistant's header after it."""
    return fmt == "think" and prompt_tail.rstrip().endswith(THINK_START)


def partial_suffix(text: str, markers) -> int:
    """Length of the longest end of `text` that is the beginning of one of `markers` (held back: the next
    delta may complete the marker)."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def first_marker(text: str, markers, start: int = 0) -> tuple[int, str | None]:
    """(position, marker) of the earliest of `markers` in text[start:]; (-1, None) when none is there."""
    best, found = -1, None
    for m in markers:
        i = text.find(m, start)
        if i >= 0 and (best < 0 or i < best or (i == best and len(m) > len(found))):
            best, found = i, m
    return best, found


class ThinkSplitter:
    """Streaming split of `<think>reasoning</think>answer`."""

    def __init__(self, in_reasoning: bool = False):
        self.state = "reasoning" if in_reasoning else "start"
        self.buf = ""  # text held back
        self.lead = True  # newlines at the start of the current part are dropped

    def feed(self, text: str) -> Split:
        self.buf += text
        out = Split()
        while self.buf:
            if self.state == "start":
                if not self._leave_start(out):
                    break
            elif self.state == "reasoning":
                if not self._read_reasoning(out):
                    break
            else:
                self._emit_content(self.buf, out)
                self.buf = ""
        return out

    def finish(self) -> Split:
        """The text ended: whatever was held back is what it looked like."""
        out = Split()
        if self.state == "reasoning":
            out.put("reasoning", self._lstrip(self.buf))
        elif self.state == "start":
            out.put("content", self.buf)  # whitespace, or the start of a <think> that never came
        else:
            self._emit_content(self.buf, out)
        self.buf = ""
        return out

    def _lstrip(self, text: str) -> str:
        if self.lead:
            text = text.lstrip("\n")
            self.lead = not text
        return text

    def _leave_start(self, out: Split) -> bool:
        """At the output's start: a <think> (after whitespace) opens reasoning, anything else is the
        answer. False: not decided yet (wait for more text)."""
        body = self.buf.lstrip()
        if body.startswith(THINK_START):
            self.state, self.buf, self.lead = "reasoning", body[len(THINK_START):], True
            return True
        if not body or THINK_START.startswith(body):
            return False
        self.state, self.lead = "content", False
        return True

    def _read_reasoning(self, out: Split) -> bool:
        i = self.buf.find(THINK_END)
        if i >= 0:
            out.put("reasoning", self._lstrip(self.buf[:i].rstrip("\n")))
            self.state, self.buf, self.lead = "content", self.buf[i + len(THINK_END):], True
            return True
        keep = partial_suffix(self.buf, (THINK_END,))
        ready = self.buf[: len(self.buf) - keep]
        tail = len(ready) - len(ready.rstrip("\n"))  # newlines that may turn out to end the reasoning
        out.put("reasoning", self._lstrip(ready[: len(ready) - tail]))
        self.buf = self.buf[len(ready) - tail:]
        return False

    def _emit_content(self, text: str, out: Split) -> None:
        out.put("content", self._lstrip(text) if self.lead else text)


# --- harmony (gpt-oss) ----------------------------------------------------------------------------------

H_START, H_CHANNEL, H_MESSAGE, H_CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
H_ENDS = ("<|end|>", "<|call|>", "<|return|>")
H_MARKERS = H_ENDS + (H_START, H_CHANNEL, H_MESSAGE, H_CONSTRAIN)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonySplitter:
    """Streaming split of harmony messages by channel. With `calls` off (no tools asked for), a message to
    a function is content."""

    def __init__(self, calls: bool = True):
        self.calls = calls
        self.state = "header"  # the output starts inside the header of the prompt's `<|start|>assistant`
        self.buf = ""
        self.kind = None  # the current message's kind: "reasoning", "content" or "call"
        self.recipient = None
        self.scan = 0  # where to look for the end of a call's body (it is searched once, not per delta)

    def feed(self, text: str) -> Split:
        self.buf += text
        out = Split()
        step = {"header": self._read_header, "body": self._read_body, "between": self._skip_between}
        while self.buf and step[self.state](out):
            pass
        return out

    def finish(self) -> Split:
        out = Split()
        if self.state == "body":
            self._end_message(self.buf, out)
        elif self.state == "between":
            out.put("content", self.buf.strip())
        elif not any(m in self.buf for m in H_MARKERS) and self.buf.strip():
            out.put("content", self.buf)  # text that never was a harmony message
        self.buf = ""
        return out

    def _read_header(self, out: Split) -> bool:  # (out: the uniform signature of the steps)
        i = self.buf.find(H_MESSAGE, 0, HEADER_MAX_CHARS + len(H_MESSAGE))
        if i < 0:
            if len(self.buf) >= HEADER_MAX_CHARS + len(H_MESSAGE):  # no header: the model wrote plain text
                self.state, self.kind, self.recipient = "body", "content", None
                return True
            return False
        self._open(self.buf[:i])
        self.state, self.buf, self.scan = "body", self.buf[i + len(H_MESSAGE):], 0
        return True

    def _open(self, header: str) -> None:
        """The kind of the message whose header (role, channel, recipient, content type) this is."""
        header = header.replace(H_CONSTRAIN, " ").replace(H_START, " ")
        channel = header.split(H_CHANNEL, 1)[1].split()[0] if H_CHANNEL in header and \
            header.split(H_CHANNEL, 1)[1].split() else None
        m = _RECIPIENT.search(header)
        self.recipient = m.group(1) if m else None
        if self.recipient and self.recipient.startswith("functions."):
            self.kind = "call" if self.calls else "content"
        elif channel == "analysis" or self.recipient:
            self.kind = "reasoning"  # thinking, or a call to a built-in tool (browser, python)
        else:
            self.kind = "content"  # final, and commentary without a recipient (a preamble for the user)

    def _read_body(self, out: Split) -> bool:
        i, end = first_marker(self.buf, H_ENDS + (H_START,), self.scan)
        if i >= 0:
            self._end_message(self.buf[:i], out)
            self.buf = self.buf[i + (len(end) if end != H_START else 0):]
            self.state = "between"
            return True
        if self.kind == "call":  # a call is handed on whole
            self.scan = max(0, len(self.buf) - max(map(len, H_ENDS + (H_START,))) + 1)
            return False
        keep = partial_suffix(self.buf, H_ENDS + (H_START,))
        self._text(self.buf[: len(self.buf) - keep], out)
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _skip_between(self, out: Split) -> bool:
        """Between messages: up to the next <|start|>. Text the model wrote there (held until that marker or
        the end) is content, trimmed."""
        i = self.buf.find(H_START)
        if i < 0:
            return False
        out.put("content", self.buf[:i].strip())
        self.state, self.buf = "header", self.buf[i + len(H_START):]
        return True

    def _text(self, text: str, out: Split) -> None:
        if self.kind == "reasoning":
            out.put("reasoning", text)
        else:
            out.put("content", text)

    def _end_message(self, body: str, out: Split) -> None:
        if self.kind == "call":
            out.put("call", (self.recipient, body))
        else:
            self._text(body, out)


def new_splitter(fmt: str | None, in_reasoning: bool = False, calls: bool = False):
    """The splitter for a reasoning format (None: everything is content)."""
    if fmt == "harmony":
        return HarmonySplitter(calls=calls)
    if fmt == "think":
        return ThinkSplitter(in_reasoning)
    return _PlainSplitter()


class _PlainSplitter:
    """No reasoning format: all text is content, passed on as it comes."""

    def feed(self, text: str) -> Split:
        out = Split()
        out.put("content", text)
        return out

    def finish(self) -> Split:
        return Split()


def split_reasoning(text: str, fmt: str | None = "think", in_reasoning: bool = False) -> tuple[str | None, str]:
    """(reasoning_content or None, content) of a whole generated text."""
    s = new_splitter(fmt, in_reasoning)
    out = s.feed(text).add(s.finish())
    return (out.reasoning or None), out.content
