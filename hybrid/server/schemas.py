"""Validation of /v1/completions and /v1/chat/completions bodies into plain dataclasses.

Everything a client can get wrong is caught here and becomes a 400 naming the parameter, so the
engine thread only ever sees well-formed requests. Unknown fields are ignored (clients send vendor
extras), but known OpenAI features this server does not implement (logprobs, tools, penalties, ...)
are refused rather than silently ignored: a client relying on them would get wrong answers otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybrid.runtime.sampling import SamplingParams
from hybrid.server.errors import bad_request

MAX_STOP_STRINGS = 16
MAX_SEED = (1 << 64) - 1
CHAT_ROLES = ("system", "developer", "user", "assistant")


# OpenAI's defaults, which parse_request passes explicitly (the runtime's SamplingParams defaults are the CLI's)
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0


@dataclass
class GenerationRequest:
    chat: bool
    model: str | None
    prompts: list = field(default_factory=list)  # completions: str or list[int] each
    messages: list = field(default_factory=list)  # chat: [{"role", "content": str}]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None  # None = completions: 16, chat: whatever fits in the context
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=DEFAULT_TEMPERATURE))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true must not pass as 1


def _int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad_request(f"'{name}' must be an integer, got {type(v).__name__}", param=name)
    if lo is not None and v < lo:
        raise bad_request(f"'{name}' must be >= {lo}, got {v}", param=name)
    if hi is not None and v > hi:
        raise bad_request(f"'{name}' must be <= {hi}, got {v}", param=name)
    return v


def _float(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_request(f"'{name}' must be a finite number, got {v!r}", param=name)
    if v < lo or (lo_open and v == lo) or v > hi:
        lo_txt = f"> {lo}" if lo_open else f">= {lo}"
        raise bad_request(f"'{name}' must be {lo_txt} and <= {hi}, got {v}", param=name)
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean, got {v!r}", param=name)
    return v


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """400 for features a client may rely on that this server does not implement."""
    def off(name, allowed=(None, False, 0, 0.0, {}, [])):
        v = body.get(name)
        if any(v is a or (type(v) is type(a) and v == a) for a in allowed):
            return
        raise bad_request(f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")

    for name in ("logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "echo", "suffix"):
        off(name)
    if chat:
        for name in ("tools", "functions", "tool_choice", "function_call", "audio", "prediction"):
            off(name, allowed=(None, [], "none"))
        rf = body.get("response_format")
        if rf is not None and rf != {"type": "text"}:
            raise bad_request("only response_format {'type': 'text'} is supported", param="response_format",
                              code="unsupported_parameter")
        modalities = body.get("modalities")
        if modalities not in (None, ["text"]):
            raise bad_request("only text output is supported", param="modalities", code="unsupported_parameter")


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request("'stop' must be a string or a list of strings", param="stop")
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' has {len(items)} strings; at most {MAX_STOP_STRINGS}", param="stop")
    if any(s == "" for s in items):
        raise bad_request("'stop' strings must not be empty", param="stop")
    return tuple(dict.fromkeys(items))  # drop duplicates, keep order


def _prompts(body: dict) -> list:
    """Completions `prompt`: a string, a list of strings, a token list, or a list of token lists."""
    v = body.get("prompt")
    msg = "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists"
    if v is None:
        raise bad_request("'prompt' is required", param="prompt")
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list) or not v:
        raise bad_request(msg + " (and not empty)", param="prompt")
    if all(isinstance(p, str) for p in v):
        return list(v)
    if all(_is_int(t) for t in v):
        return [list(v)]
    if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in v):
        return [list(p) for p in v]
    raise bad_request(msg, param="prompt")


def _content_text(content, i: int) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content: only text parts are supported",
                                  param=f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content")


def _messages(body: dict) -> list[dict]:
    v = body.get("messages")
    if not isinstance(v, list) or not v:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}",
                              param=f"messages[{i}].role")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        # "developer" is OpenAI's newer name for "system"; chat templates only know "system".
        out.append({"role": "system" if role == "developer" else role, "content": _content_text(content, i)})
    return out


def parse_request(body, chat: bool, max_choices: int) -> GenerationRequest:
    """Validate a decoded JSON body; raises ApiError(400) naming the first bad parameter."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    _refuse_unsupported(body, chat)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", param="stream_options")
        include_usage = _bool(options, "include_usage", False)
    max_tokens = _int(body, "max_tokens", None, lo=1)
    if chat:
        max_tokens = _int(body, "max_completion_tokens", max_tokens, lo=1)
    n = _int(body, "n", 1, lo=1, hi=max_choices)
    best_of = _int(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise bad_request("'best_of' other than n is not supported", param="best_of", code="unsupported_parameter")
    top_k = _int(body, "top_k", 0, lo=-1)
    sampling = SamplingParams(
        temperature=_float(body, "temperature", DEFAULT_TEMPERATURE, 0.0, 2.0),
        top_p=_float(body, "top_p", DEFAULT_TOP_P, 0.0, 1.0, lo_open=True),
        top_k=max(top_k, 0),  # 0 = off (an extension; OpenAI has no top_k); vLLM spells "off" as -1: both accepted
        seed=_int(body, "seed", None, lo=-(1 << 63), hi=MAX_SEED),
        stop=_stop(body),
    )
    req = GenerationRequest(chat=chat, model=model, n=n, stream=stream, include_usage=include_usage,
                            max_tokens=max_tokens, sampling=sampling)
    if chat:
        req.messages = _messages(body)
    else:
        req.prompts = _prompts(body)
        if len(req.prompts) * n > max_choices:
            raise bad_request(f"{len(req.prompts)} prompts x n={n} = {len(req.prompts) * n} choices; "
                              f"at most {max_choices} per request", param="prompt")
    return req
