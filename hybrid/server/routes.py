"""HTTP handlers: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

A generation request is validated, refused early if its prompt cannot fit the context by its length
(prompt_limits.py), tokenized (in a small worker pool: a long prompt must not stall the event loop),
checked against the context, split into one scheduler Sequence per choice, and submitted
all-or-nothing (429 when the queue is full). The handler then only awaits events from the engine thread.
If the handler ends early for any reason (client gone: aiohttp cancels the handler; a write fails; an
error), `finally` cancels the sequences, and the engine frees their slots at its next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import math
import logging
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace

from aiohttp import web

from hybrid.server import openai_format as fmt
from hybrid.server.config import ServerConfig
from hybrid.server.errors import ApiError, bad_request, queue_full, unavailable
from hybrid.server.metrics import Metrics
from hybrid.server.prompt_limits import PromptTooLong, check_prefixes, check_sizes
from hybrid.server.scheduler import Event, QueueFull, Scheduler, Sequence
from hybrid.server.schemas import GenerationRequest, parse_request

log = logging.getLogger("hybrid.server")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class ServerState:
    config: ServerConfig
    runtime: object  # hybrid.server.adapter.Runtime
    scheduler: Scheduler
    metrics: Metrics
    model_name: str
    tokenize_pool: Executor | None = None  # None: the loop's default executor
    created: int = field(default_factory=fmt.now)


# aiohttp >= 3.9 wants typed keys (and warns on strings); older ones only have strings.
STATE = web.AppKey("state", ServerState) if hasattr(web, "AppKey") else "hybrid_state"


def _json_constant(name):
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: web.Request, timeout_s: float):
    try:
        # aiohttp raises 413 past client_max_size; the error middleware formats it
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"The request body did not arrive within {timeout_s:g} s.", code="request_timeout",
                       close=True) from None
    try:
        return json.loads(raw, parse_constant=_json_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


def _texts(req: GenerationRequest) -> list[list[str]]:
    """Per prompt, the client's texts in it (chat: the message contents)."""
    if req.chat:
        return [[m["content"] for m in req.messages]]
    return [[p] if isinstance(p, str) else [] for p in req.prompts]


def _too_long(req: GenerationRequest, context: int, at_least: int) -> ApiError:
    what = "messages" if req.chat else "prompt"
    return bad_request(
        f"This model's maximum context length is {context} tokens. However, your {what} has at least "
        f"{at_least} tokens (refused before tokenizing all of it). Please shorten the {what}.",
        param=what, code="context_length_exceeded")


def _tokenize(runtime, req: GenerationRequest) -> list[list[int]]:
    for texts in _texts(req):  # bounded work for prompts that cannot fit (prompt_limits.py)
        check_prefixes(runtime.encode, texts, runtime.max_context)
    if req.chat:
        return [runtime.encode_chat(req.messages)]
    out = []
    for p in req.prompts:
        if isinstance(p, str):
            out.append(runtime.encode(p))
        else:
            bad = [t for t in p if not 0 <= t < runtime.vocab_size]
            if bad:
                raise bad_request(f"token id {bad[0]} is outside the vocabulary (0..{runtime.vocab_size - 1})",
                                  param="prompt")
            out.append(list(p))
    return out


def _max_tokens(req: GenerationRequest, prompt_len: int, context: int) -> int:
    """Completion budget; 400 naming the context limit when prompt (+ requested completion) can't fit."""
    what = "messages" if req.chat else "prompt"
    if prompt_len == 0:
        raise bad_request(f"the {what} is empty after tokenization", param=what)
    if prompt_len >= context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, your {what} has "
            f"{prompt_len} tokens, which leaves no room for a completion. Please shorten the {what}.",
            param=what, code="context_length_exceeded")
    room = context - prompt_len
    if req.max_tokens is None:
        return room if req.chat else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
    if req.max_tokens > room:
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_len + req.max_tokens} tokens ({prompt_len} in the {what}, {req.max_tokens} for the "
            f"completion). Please reduce the length of the {what} or the completion.",
            param="max_tokens", code="context_length_exceeded")
    return req.max_tokens


async def generate(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request, state.config.read_timeout_s)
    req = parse_request(body, chat=chat, max_choices=state.config.max_choices)
    if req.model is not None and req.model != state.model_name:
        raise ApiError(404, f"The model '{req.model}' does not exist; this server serves '{state.model_name}'.",
                       param="model", code="model_not_found")
    choices = req.n * (1 if chat else len(req.prompts))
    if choices > state.config.max_queue:  # all choices are queued together: this one could never be
        raise bad_request(f"{choices} choices (n x prompts) can never be queued: this server queues at most "
                          f"{state.config.max_queue} sequences (--max-queue)", param="n")
    context = state.runtime.max_context
    try:
        for texts in _texts(req):  # lengths alone, before any tokenizer work
            check_sizes(texts, context, state.runtime.max_token_chars)
    except PromptTooLong as exc:
        raise _too_long(req, context, exc.at_least) from None
    loop = asyncio.get_running_loop()
    try:
        prompts = await loop.run_in_executor(state.tokenize_pool, _tokenize, state.runtime, req)
    except ApiError:
        raise
    except PromptTooLong as exc:
        raise _too_long(req, context, exc.at_least) from None
    except Exception as exc:  # e.g. a chat template that rejects the message order
        raise bad_request(f"could not build the prompt: {exc}", param="messages" if chat else "prompt") from None
    budgets = [_max_tokens(req, len(p), state.runtime.max_context) for p in prompts]

    events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    def sink_for(index: int):
        def sink(ev: Event) -> None:  # called on the engine thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, (index, ev))
            except RuntimeError:  # the loop has closed: server shutdown, nobody is listening
                pass
        return sink

    seqs = []
    for p_idx, (ids, budget) in enumerate(zip(prompts, budgets)):
        for j in range(req.n):
            index = p_idx * req.n + j
            params = req.sampling
            if params.seed is not None and req.n > 1:
                params = replace(params, seed=params.seed + j)  # n seeded choices must differ
            seqs.append(Sequence(ids, budget, params, sink_for(index)))
    sched = state.scheduler
    if not sched.alive:
        raise unavailable("the engine is not running")
    try:
        sched.submit(seqs)
    except QueueFull:
        raise queue_full(retry_after_s=_retry_after(state)) from None
    except RuntimeError as exc:
        raise unavailable(str(exc)) from None

    try:
        if req.stream:
            return await _stream(request, state, req, seqs, events)
        return await _collect(state, req, seqs, events)
    finally:
        sched.cancel([s for s in seqs if not s.finished])


def _retry_after(state: ServerState) -> int:
    """Seconds until the queue has likely drained: queued batches x the mean sequence duration so far."""
    st = state.scheduler.stats()
    hist = state.metrics.sequence_duration
    mean_s = hist.sum / hist.count if hist.count else 1.0
    return max(1, min(60, math.ceil(mean_s * st["waiting"] / max(1, st["max_batch"]))))


async def _collect(state: ServerState, req: GenerationRequest, seqs, events) -> web.Response:
    k = len(seqs)
    texts, reasons = [[] for _ in range(k)], [None] * k
    completion_tokens = 0
    left = k
    while left:
        i, ev = await events.get()
        if ev.kind == "text":
            texts[i].append(ev.text)
        elif ev.kind == "done":
            reasons[i] = ev.finish_reason
            completion_tokens += ev.completion_tokens
            left -= 1
        else:
            raise ApiError(ev.status, ev.error, type="server_error")
    prompt_tokens = _prompt_tokens(req, seqs)
    body = fmt.full_response(req.chat, fmt.new_id(req.chat), state.model_name, fmt.now(),
                             ["".join(t) for t in texts], reasons, fmt.usage(prompt_tokens, completion_tokens))
    return web.json_response(body)


def _prompt_tokens(req: GenerationRequest, seqs) -> int:
    """Prompt tokens count once per prompt, not once per choice (as OpenAI bills them)."""
    return sum(len(s.prompt_ids) for s in seqs[:: req.n])


async def _stream(request: web.Request, state: ServerState, req: GenerationRequest, seqs, events):
    chat, model, rid, created = req.chat, state.model_name, fmt.new_id(req.chat), fmt.now()
    uf = req.include_usage
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    try:
        if chat:  # the first chunk of each choice announces the role, as OpenAI does
            await resp.write(b"".join(fmt.sse(fmt.chunk(chat, rid, model, created, i, "", role=True,
                                                        with_usage_field=uf)) for i in range(len(seqs))))
        completion_tokens, left, failed = 0, len(seqs), False
        while left and not failed:
            # Everything that arrived since the last write goes out in one write (fewer syscalls
            # when the engine outpaces the network); each event is still its own SSE message.
            batch = [await events.get()]
            while not events.empty():
                batch.append(events.get_nowait())
            out = []
            for i, ev in batch:
                if ev.kind == "text":
                    out.append(fmt.sse(fmt.chunk(chat, rid, model, created, i, ev.text, with_usage_field=uf)))
                elif ev.kind == "done":
                    completion_tokens += ev.completion_tokens
                    left -= 1
                    out.append(fmt.sse(fmt.chunk(chat, rid, model, created, i, None if chat else "",
                                                 finish_reason=ev.finish_reason, with_usage_field=uf)))
                else:
                    # The status line is gone already: report in-band (as vLLM does), then end the stream.
                    out.append(fmt.sse(ApiError(ev.status, ev.error, type="server_error").body()))
                    failed = True
                    break
            await resp.write(b"".join(out))
        if uf and not failed:
            prompt_tokens = _prompt_tokens(req, seqs)
            await resp.write(fmt.sse(fmt.usage_chunk(chat, rid, model, created,
                                                     fmt.usage(prompt_tokens, completion_tokens))))
        await resp.write(fmt.sse("[DONE]"))
        await resp.write_eof()
    except ConnectionResetError:  # the client left; generate()'s finally cancels its sequences
        pass
    return resp


async def completions(request: web.Request):
    return await generate(request, chat=False)


async def chat_completions(request: web.Request):
    return await generate(request, chat=True)


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "hybrid",
            "max_model_len": state.runtime.max_context}


async def list_models(request: web.Request):
    return web.json_response({"object": "list", "data": [_model_card(request.app[STATE])]})


async def get_model(request: web.Request):
    state = request.app[STATE]
    if request.match_info["model"] != state.model_name:
        raise ApiError(404, f"The model '{request.match_info['model']}' does not exist", param="model",
                       code="model_not_found")
    return web.json_response(_model_card(state))


async def health(request: web.Request):
    state = request.app[STATE]
    ok = state.scheduler.alive
    body = {"status": "ok" if ok else "engine_down", "model": state.model_name, **state.scheduler.stats()}
    return web.json_response(body, status=200 if ok else 503)


async def metrics(request: web.Request):
    state = request.app[STATE]
    st = state.scheduler.stats()
    gauges = {
        "hybrid_queue_depth": ("Sequences waiting for a KV cache slot.", st["waiting"]),
        "hybrid_running_sequences": ("Sequences holding a KV cache slot.", st["running"]),
        "hybrid_kv_slots_free": ("Free KV cache slots.", st["free_slots"]),
        "hybrid_kv_slots_total": ("KV cache slots (max batch).", st["max_batch"]),
    }
    text = state.metrics.render(gauges)
    return web.Response(body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
