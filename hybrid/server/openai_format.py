"""Response bodies and stream chunks in the OpenAI wire format (completions and chat completions)."""

from __future__ import annotations

import json
import time
import uuid


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def full_response(chat: bool, rid: str, model: str, created: int, texts: list[str], reasons: list[str],
                  use: dict) -> dict:
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                    "finish_reason": r} for i, (t, r) in enumerate(zip(texts, reasons))]
        obj = "chat.completion"
    else:
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
            "choices": choices, "usage": use}


def chunk(chat: bool, rid: str, model: str, created: int, index: int, text: str | None,
          finish_reason: str | None = None, role: bool = False, with_usage_field: bool = False) -> dict:
    """One streamed choice delta. Chat: `delta` carries role (first chunk) and content."""
    if chat:
        delta = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
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
