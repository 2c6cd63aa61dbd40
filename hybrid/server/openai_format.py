"""Response bodies and stream chunks in the OpenAI wire format (completions and chat completions).

Logprobs come from the sampler as TokenLogprob records (token id, logprob, top [(id, logprob)]) and are shaped
here: chat as choices[].logprobs.content[] ({token, logprob, bytes, top_logprobs[]}), completions as
choices[].logprobs {tokens, token_logprobs, top_logprobs, text_offset}. `piece(id) -> (text, bytes)` names the
tokens. A logprob that JSON cannot carry (-inf: a token the model rules out) is written as -9999.0, as OpenAI does.
"""

from __future__ import annotations

import json
import math
import time
import uuid

LOGPROB_FLOOR = -9999.0


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens: prompt tokens the prefix cache served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _logprob(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else LOGPROB_FLOOR  # NaN, -inf: not JSON


def chat_logprobs(records, piece) -> dict:
    """TokenLogprob records -> a chat choice's (or chunk's) logprobs object."""
    def item(token, lp):
        text, raw = piece(token)
        return {"token": text, "logprob": _logprob(lp), "bytes": list(raw)}

    content = [{**item(r.token, r.logprob), "top_logprobs": [item(t, lp) for t, lp in r.top]} for r in records]
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """Builds completions' logprobs objects for one choice, keeping text_offset running across stream chunks:
    offsets count the tokens' texts from the start of the choice's text (the echoed prompt, then the completion,
    which starts at the echoed text's length)."""

    def __init__(self, piece):
        self.piece = piece
        self.offset = 0

    def skip_to(self, offset: int) -> None:
        self.offset = offset

    def shape(self, records) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for r in records:
            text = self.piece(r.token)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(_logprob(r.logprob))
            if r.logprob is None:  # a prompt's first token: nothing predicts it
                out["top_logprobs"].append(None)
            else:  # the k most likely and, as OpenAI does, the chosen one (up to k + 1 entries)
                top = {self.piece(t)[0]: _logprob(lp) for t, lp in r.top}
                top.setdefault(text, _logprob(r.logprob))
                out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def full_response(chat: bool, rid: str, model: str, created: int, texts: list[str], reasons: list[str],
                  use: dict, logprobs: list | None = None) -> dict:
    """logprobs: one shaped logprobs object (or None) per choice."""
    logprobs = logprobs or [None] * len(texts)
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": lp,
                    "finish_reason": r} for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs))]
        obj = "chat.completion"
    else:
        choices = [{"index": i, "text": t, "logprobs": lp, "finish_reason": r}
                   for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs))]
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
            "choices": choices, "usage": use}


def chunk(chat: bool, rid: str, model: str, created: int, index: int, text: str | None,
          finish_reason: str | None = None, role: bool = False, with_usage_field: bool = False,
          logprobs: dict | None = None, delta: dict | None = None) -> dict:
    """One streamed choice delta. Chat: `delta` carries role (first chunk) and content, or is given whole (the
    parsed pieces: reasoning_content, tool_calls); logprobs: the shaped logprobs of this chunk's tokens."""
    if chat and delta is not None:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    elif chat:
        delta = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
           "choices": [choice]}
    if with_usage_field:
        out["usage"] = None  # OpenAI: null on every chunk but the last when include_usage is set
    return out


def usage_chunk(chat: bool, rid: str, model: str, created: int, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "system_fingerprint": None, "choices": [], "usage": use}


def sse(data) -> bytes:
    """One server-sent event; `data` is a dict (JSON) or the literal "[DONE]"."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def now() -> int:
    return int(time.time())
