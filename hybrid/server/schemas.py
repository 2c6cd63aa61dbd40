"""Validation of /v1/completions and /v1/chat/completions bodies into plain dataclasses.

Everything a client can get wrong is caught here and becomes a 400 naming the parameter, so the
engine thread only ever sees well-formed requests. No option is ever silently ignored: every key of a
body is either implemented (IMPLEMENTED, validated below), or a known OpenAI / vLLM feature this server
does not implement (REFUSED: a 400 naming it, unless its value means "off"), or unknown (a 400 naming it,
as OpenAI answers unrecognized arguments). README.md's parameter table lists the same three sets.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from hybrid.runtime.sampling import SamplingParams
from hybrid.server.errors import bad_request
from hybrid.server.grammars import request_grammar
from hybrid.server.tool_calls import ToolRequestError, checked_request

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # entries (OpenAI's limit)
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI chat's limit; vLLM's default)
MAX_SEED = (1 << 64) - 1
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
# chat_template_kwargs keys the server sets itself (from messages, tools): a client's would contradict them
TEMPLATE_KEYS_OWNED = ("messages", "tools", "add_generation_prompt")


# OpenAI's defaults, which parse_request passes explicitly (the runtime's SamplingParams defaults are the CLI's)
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0


# Keys with an effect this server implements, per endpoint.
IMPLEMENTED_COMMON = ("model", "n", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k",
                      "min_p", "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty",
                      "logit_bias", "stop_token_ids", "ignore_eos", "min_tokens", "logprobs", "best_of",
                      # constrained decoding (hybrid.server.grammars): llama.cpp's and vLLM's spellings
                      "response_format", "grammar", "json_schema", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar", "structured_outputs")
IMPLEMENTED_COMPLETIONS = ("prompt", "echo")
IMPLEMENTED_CHAT = ("messages", "max_completion_tokens", "top_logprobs", "modalities", "tools",
                    "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "reasoning_effort")
# Keys that only label a request (no effect on the output, by their definition): accepted as strings.
LABELS = ("user", "safety_identifier", "prompt_cache_key")
# Known OpenAI / vLLM / llama.cpp options this server does not implement -> the values that mean "off" (accepted:
# nothing to do). Any other value is refused with a 400 naming the option.
REFUSED_COMMON = {
    "prompt_logprobs": (None,), "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "add_special_tokens": (None,), "truncate_prompt_tokens": (None,), "allowed_token_ids": (None,),
    "bad_words": (None, []), "length_penalty": (None, 1, 1.0), "use_beam_search": (None, False),
    "logits_processors": (None, []), "return_tokens_as_token_ids": (None, False), "priority": (None, 0),
    "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,),
    "typical_p": (None, 1, 1.0), "mirostat": (None, 0),
    "metadata": (None, {}), "store": (None, False), "service_tier": (None, "auto", "default"),
    "kv_transfer_params": (None,), "cache_salt": (None,), "mm_processor_kwargs": (None,),
}
REFUSED_CHAT = {
    "functions": (None, []), "function_call": (None, "none"),
    "audio": (None,), "prediction": (None,),
    "web_search_options": (None,), "verbosity": (None,), "echo": (None, False), "chat_template": (None,),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "documents": (None,),
}
REFUSED_COMPLETIONS = {"suffix": (None, "")}
_TOKEN_KEY = re.compile(r"(0|[1-9][0-9]{0,9})")


@dataclass
class GenerationRequest:
    chat: bool
    model: str | None
    prompts: list = field(default_factory=list)  # completions: str or list[int] each
    messages: list = field(default_factory=list)  # chat: [{"role", "content": str | None, ...}]
    tools: object = None  # chat: `tools`, `tool_choice`, `parallel_tool_calls` as sent (tool_calls.plan_tools checks them)
    tool_choice: object = None
    parallel_tool_calls: object = None
    template_kwargs: dict = field(default_factory=dict)  # chat: chat_template_kwargs (+ reasoning_effort)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False  # completions: the prompt's text (and, with logprobs, its tokens' logprobs) comes first
    max_tokens: int | None = None  # None = completions: 16, chat: whatever fits in the context
    constraint: str | None = None  # the parameter whose grammar is sampling.grammar (hybrid.server.grammars)
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


def _is_off(v, allowed) -> bool:
    """Whether v is one of the values that mean "off" (same type: JSON true must not pass for 1)."""
    return any(v is a or (type(v) is type(a) and v == a) for a in allowed)


def _check_keys(body: dict, chat: bool) -> None:
    """400 naming the first key that is refused (a known option, not implemented, set to something other than
    "off") or unknown (OpenAI answers those 400 too)."""
    implemented = IMPLEMENTED_COMMON + (IMPLEMENTED_CHAT if chat else IMPLEMENTED_COMPLETIONS)
    refused = {**REFUSED_COMMON, **(REFUSED_CHAT if chat else REFUSED_COMPLETIONS)}
    for name, v in body.items():
        if name in implemented:
            continue
        if name in LABELS:
            if v is not None and not isinstance(v, str):
                raise bad_request(f"'{name}' must be a string", param=name)
        elif name in refused:
            if not _is_off(v, refused[name]):
                raise bad_request(f"'{name}' is not supported by this server; leave it out", param=name,
                                  code="unsupported_parameter")
        else:
            where = "/v1/chat/completions" if chat else "/v1/completions"
            raise bad_request(f"Unrecognized request argument supplied: '{name}' (not a parameter of {where} "
                              "on this server; README.md lists them)", param=name, code="unknown_parameter")


def _check_chat_formats(body: dict) -> None:
    if body.get("modalities") not in (None, ["text"]):
        raise bad_request("only text output is supported", param="modalities", code="unsupported_parameter")


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """{"token id": bias in [-100, 100]} -> ((id, bias), ...); ids are checked against the vocabulary later."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids (strings) to biases", param="logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' has {len(v)} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias")
    out = []
    for key, bias in v.items():
        if not _TOKEN_KEY.fullmatch(key):
            raise bad_request(f"'logit_bias' keys must be token ids written in decimal, got {key!r}",
                              param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad_request(f"'logit_bias' values must be numbers in [-100, 100], got {bias!r} for {key}",
                              param="logit_bias")
        out.append((int(key), float(bias)))
    return tuple(out)


def _stop_token_ids(body: dict) -> tuple[int, ...]:
    v = body.get("stop_token_ids")
    if v is None:
        return ()
    if not isinstance(v, list) or not all(_is_int(t) and t >= 0 for t in v):
        raise bad_request("'stop_token_ids' must be a list of token ids (integers >= 0)", param="stop_token_ids")
    if len(v) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"'stop_token_ids' has {len(v)} ids; at most {MAX_STOP_TOKEN_IDS}", param="stop_token_ids")
    return tuple(dict.fromkeys(v))


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many top logprobs per token (None: no logprobs). Chat: logprobs true/false + top_logprobs 0..20;
    completions: logprobs 0..20."""
    if not chat:
        return _int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    on = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not on:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if on else None


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


def _string(m: dict, key: str, i: int) -> str:
    v = m.get(key)
    if not isinstance(v, str):
        raise bad_request(f"messages[{i}].{key} must be a string", param=f"messages[{i}].{key}")
    return v


def _tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's `tool_calls` as OpenAI sends them back: [{"id", "type": "function",
    "function": {"name", "arguments": JSON text (or an object)}}]."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be a list", param=where)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("arguments", ""), (str, dict)) or not isinstance(c.get("id", ""), str):
            raise bad_request(f"{where}[{j}] must be {{\"id\": str, \"type\": \"function\", \"function\": "
                              "{\"name\": str, \"arguments\": str}}", param=f"{where}[{j}]")
        out.append({"id": c.get("id", ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", "")}})
    return out


def _message(m, i: int) -> dict:
    """One message as the chat template gets it: role and content, plus an assistant's tool_calls and
    reasoning_content and a tool result's tool_call_id. An assistant's null (or missing) content is "", beside
    calls too, as vLLM passes it: templates that test for none write the same text for "" (DeepSeek, Qwen3,
    Kimi), GLM-4.5's would print none as "None", and gpt-oss's looks for its markers `in` the content."""
    if not isinstance(m, dict):
        raise bad_request(f"messages[{i}] must be an object", param=f"messages[{i}]")
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise bad_request(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}",
                          param=f"messages[{i}].role")
    content = m.get("content")
    calls = _tool_calls(m["tool_calls"], i) if role == "assistant" and m.get("tool_calls") is not None else []
    if content is None and role == "assistant":
        content = ""
    else:
        content = _content_text(content, i)
    # "developer" is OpenAI's newer name for "system"; chat templates only know "system".
    out = {"role": "system" if role == "developer" else role, "content": content}
    if calls:
        out["tool_calls"] = calls
    if role == "assistant" and m.get("reasoning_content") is not None:
        out["reasoning_content"] = _string(m, "reasoning_content", i)
    if role == "tool":
        out["tool_call_id"] = _string(m, "tool_call_id", i)
    return out


def parse_messages(body: dict) -> list[dict]:
    v = body.get("messages")
    if not isinstance(v, list) or not v:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    return [_message(m, i) for i, m in enumerate(v)]


def _template_kwargs(body: dict) -> dict:
    """chat_template_kwargs (an object; not the keys the server sets) plus reasoning_effort, which
    templates read under that name (gpt-oss)."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        kw = {}
    if not isinstance(kw, dict):
        raise bad_request("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    owned = [k for k in TEMPLATE_KEYS_OWNED if k in kw]
    if owned:
        raise bad_request(f"'chat_template_kwargs' must not set {owned[0]!r} (the server sets it from the request; "
                          f"send it as its own parameter)", param="chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}; got {effort!r}",
                              param="reasoning_effort")
        kw = {**kw, "reasoning_effort": effort}
    return dict(kw)


def parse_request(body, chat: bool, max_choices: int) -> GenerationRequest:
    """Validate a decoded JSON body; raises ApiError(400) naming the first bad parameter."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    _check_keys(body, chat)
    if chat:
        _check_chat_formats(body)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", param="stream_options")
        include_usage = _bool(options, "include_usage", False)
        for key in options:
            if key != "include_usage":
                raise bad_request(f"'stream_options.{key}' is not supported; only include_usage is",
                                  param="stream_options", code="unsupported_parameter")
    max_tokens = _int(body, "max_tokens", None, lo=1)
    if chat:
        max_tokens = _int(body, "max_completion_tokens", max_tokens, lo=1)
    n = _int(body, "n", 1, lo=1, hi=max_choices)
    best_of = _int(body, "best_of", None, lo=1)
    if best_of is not None and best_of != 1:
        raise bad_request("'best_of' > 1 is not supported (use n for several choices)", param="best_of",
                          code="unsupported_parameter")
    top_k = _int(body, "top_k", 0, lo=-1)
    min_tokens = _int(body, "min_tokens", 0, lo=0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens")
    logprobs = _logprobs(body, chat)
    echo = False if chat else _bool(body, "echo", False)
    constraint, grammar = request_grammar(body) or (None, None)
    sampling = SamplingParams(
        temperature=_float(body, "temperature", DEFAULT_TEMPERATURE, 0.0, 2.0),
        top_p=_float(body, "top_p", DEFAULT_TOP_P, 0.0, 1.0, lo_open=True),
        top_k=max(top_k, 0),  # 0 = off (an extension; OpenAI has no top_k); vLLM spells "off" as -1: both accepted
        seed=_int(body, "seed", None, lo=-(1 << 63), hi=MAX_SEED),
        stop=_stop(body),
        min_p=_float(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_float(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_float(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_float(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True),
        logit_bias=_logit_bias(body),
        stop_token_ids=_stop_token_ids(body),
        ignore_eos=_bool(body, "ignore_eos", False),
        min_tokens=min_tokens,
        logprobs=logprobs,
        prompt_logprobs=logprobs if echo else None,  # echo with logprobs scores the prompt too
        grammar=grammar,
    )
    req = GenerationRequest(chat=chat, model=model, n=n, stream=stream, include_usage=include_usage,
                            echo=echo, max_tokens=max_tokens, sampling=sampling, constraint=constraint)
    if chat:
        req.messages = parse_messages(body)
        req.tools, req.tool_choice = body.get("tools"), body.get("tool_choice")
        req.parallel_tool_calls = body.get("parallel_tool_calls")
        try:  # the shape of tools and tool_choice (whether this model can serve them: the route's plan_tools)
            _, choice, _ = checked_request(req.tools, req.tool_choice, req.parallel_tool_calls)
        except ToolRequestError as exc:
            raise bad_request(str(exc), param=exc.param) from None
        if constraint is not None and choice in ("required", "function"):
            raise bad_request(f"'{constraint}' and tool_choice \"required\" or a named function (held to a call by "
                              "a grammar) cannot both constrain the output; send one of them", param="tool_choice")
        req.template_kwargs = _template_kwargs(body)
    else:
        req.prompts = _prompts(body)
        if len(req.prompts) * n > max_choices:
            raise bad_request(f"{len(req.prompts)} prompts x n={n} = {len(req.prompts) * n} choices; "
                              f"at most {max_choices} per request", param="prompt")
    return req
