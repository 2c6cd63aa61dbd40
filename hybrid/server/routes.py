"""HTTP handlers: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

A generation request is validated, refused early if its prompt cannot fit the context by its length
(prompt_limits.py), tokenized (in a small worker pool: a long prompt must not stall the event loop),
checked against the context, split into one scheduler Sequence per choice, and submitted
all-or-nothing (429 when the queue is full). The handler then only awaits events from the engine thread.
If the handler ends early for any reason (client gone: aiohttp cancels the handler; a write fails; an
error), `finally` cancels the sequences, and the engine frees their slots at its next step boundary.

Every generation request is tracked (InFlight) from its first line: a shutdown refuses new ones, waits
a grace period for the others, then ends those still running with a 503 error event in their queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import logging
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace

from aiohttp import web

from hybrid.server import openai_format as fmt
from hybrid.server import grammars, reasoned_grammar, reasoning, tool_calls, tool_grammar
from hybrid.server.config import ServerConfig
from hybrid.server.errors import SHUTTING_DOWN, ApiError, bad_request, queue_full, shutting_down, unavailable
from hybrid.server.metrics import Metrics
from hybrid.server.prompt_limits import PromptTooLong, check_prefixes, check_sizes
from hybrid.server.scheduler import Event, QueueFull, Scheduler, Sequence
from hybrid.server.schemas import GenerationRequest, parse_messages, parse_request


log = logging.getLogger("hybrid.server")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class InFlight:
    """The generation requests being answered, each by its event queue, so that a shutdown can wait for
    them and then end those still running: each gets a 503 error event, which its handler answers like
    any engine error (a JSON 503, or an error event that closes the stream) without the engine's help
    (the engine thread may be in the middle of a long step)."""

    def __init__(self):
        self._queues: set[asyncio.Queue] = set()
        self.closing = False  # set once a shutdown began: new generation requests get 503
        self._idle: asyncio.Event | None = None  # made by drain(), on the running loop

    @contextlib.contextmanager
    def track(self, events: asyncio.Queue):
        self._queues.add(events)
        try:
            yield
        finally:
            self._queues.discard(events)
            if not self._queues and self._idle is not None:
                self._idle.set()

    async def drain(self, grace_s: float) -> int:
        """Refuse new requests, give in-flight ones up to `grace_s` to finish, end the rest; -> how many
        were ended."""
        self.closing = True
        if self._queues:
            self._idle = asyncio.Event()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace_s)
        for events in self._queues:
            events.put_nowait((0, Event("error", error=f"{SHUTTING_DOWN}; the request was ended before it "
                                        "completed.", status=503)))
        return len(self._queues)


@dataclass
class ServerState:
    config: ServerConfig
    runtime: object  # hybrid.server.adapter.Runtime
    scheduler: Scheduler
    metrics: Metrics
    model_name: str
    tokenize_pool: Executor | None = None  # None: the loop's default executor
    inflight: InFlight = field(default_factory=InFlight)
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
    """Per prompt, the client's texts in it (chat: the message contents, reasoning, tool calls' names and
    arguments, tool_call_ids, and the tool schemas and template inputs as JSON: templates print them all)."""
    if req.chat:
        return [[t for m in req.messages for t in _message_texts(m)] + _input_texts(req)]
    return [[p] if isinstance(p, str) else [] for p in req.prompts]


def _message_texts(m: dict) -> list[str]:
    out = [m.get("content") or "", m.get("reasoning_content") or "", m.get("tool_call_id") or ""]
    for c in m.get("tool_calls") or ():
        args = c["function"]["arguments"]
        out += [c["id"], c["function"]["name"], args if isinstance(args, str) else json.dumps(args)]
    return [t for t in out if t]


def _input_texts(req: GenerationRequest) -> list[str]:
    """The template's other inputs as the JSON a template prints them as (a bound on their size)."""
    inputs = [v for v in (req.tools, req.template_kwargs) if v]
    return [json.dumps(v, ensure_ascii=False) for v in inputs]


@dataclass(frozen=True)
class ChatParsing:
    """How a chat request's generated text is read: the tool plan (tool_calls.plan_tools), the model's
    reasoning format, and whether the prompt opened the reasoning. Off (`on` False): the text is the content,
    as it always was."""

    plan: tool_calls.ToolPlan = field(default_factory=tool_calls.ToolPlan)
    reasoning: str | None = None
    opened: bool = False

    @property
    def on(self) -> bool:
        return self.plan.parses or self.reasoning is not None

    def parser(self) -> tool_calls.OutputParser:
        return tool_calls.OutputParser(self.plan, self.reasoning, self.opened)


def _tool_plan(runtime, req: GenerationRequest) -> tool_calls.ToolPlan:
    """The request's tools planned for this model; 400 naming the parameter when they cannot be served."""
    try:
        return tool_calls.plan_tools(req.tools, req.tool_choice, family=runtime.model_type,
                                     chat_template=runtime.chat_template, parallel_tool_calls=req.parallel_tool_calls)
    except tool_calls.ToolRequestError as exc:
        raise bad_request(str(exc), param=exc.param) from None


def _chat_parsing(runtime, plan: tool_calls.ToolPlan, prompt: list[int]) -> ChatParsing:
    fmt_ = reasoning.reasoning_format_for(runtime.model_type, runtime.chat_template)
    opened = fmt_ is not None and reasoning.prompt_opens_reasoning(
        runtime.decode(prompt[-16:], skip_special_tokens=False), fmt_)
    return ChatParsing(plan, fmt_, opened)


async def _forcing_sampling(state: ServerState, req: GenerationRequest, parsing: ChatParsing, prompt: list[int]):
    """tool_choice "required" / named: the request's sampling with the grammar of the model's call format
    (tool_grammar.forced_grammar; unchanged where the model cannot be forced). A request that also carries a
    constraint of its own was refused when it was parsed (schemas.parse_request)."""
    job = functools.partial(tool_grammar.forced_grammar, state.runtime, parsing.plan, parsing.reasoning,
                            parsing.opened, prompt)
    try:
        grammar = await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, job)
    except tool_calls.ToolRequestError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    return req.sampling if grammar is None else replace(req.sampling, grammar=grammar)


async def _reasoned_sampling(state: ServerState, req: GenerationRequest, parsing: ChatParsing, prompt: list[int]):
    """A reasoning model's constraint held to its answer, its reasoning left free (reasoned_grammar)."""
    job = functools.partial(reasoned_grammar.after_reasoning, state.runtime, req.sampling.grammar, parsing.reasoning,
                            parsing.opened, prompt)
    try:
        grammar = await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, job)
    except ValueError as exc:
        raise bad_request(f"'{req.constraint}': {exc}", param=req.constraint) from None
    return replace(req.sampling, grammar=grammar)


def _check_message_count(body, limit: int) -> None:
    """400 for a chat of more than `limit` messages, before any of them is looked at."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if isinstance(messages, list) and len(messages) > limit:
        raise bad_request(f"'messages' has {len(messages)} messages; this server accepts at most {limit} per "
                          "request (--max-messages). Send fewer messages, e.g. drop or merge old turns.",
                          param="messages", code="array_above_max_length")


def _engine_error(ev: Event) -> ApiError:
    """The HTTP error for an engine "error" event (503: shutting down or the engine stopped)."""
    return ApiError(ev.status, ev.error, type="server_error", code="unavailable" if ev.status == 503 else None)


def _too_long(req: GenerationRequest, context: int, at_least: int) -> ApiError:
    what = "messages" if req.chat else "prompt"
    return bad_request(
        f"This model's maximum context length is {context} tokens. However, your {what} has at least "
        f"{at_least} tokens (refused before tokenizing all of it). Please shorten the {what}.",
        param=what, code="context_length_exceeded")


def _tokenize(runtime, req: GenerationRequest, plan: tool_calls.ToolPlan | None = None) -> list[list[int]]:
    for texts in _texts(req):  # bounded work for prompts that cannot fit (prompt_limits.py)
        check_prefixes(runtime.encode, texts, runtime.max_context)
    if req.chat:
        kwargs = {**(plan.template_kwargs() if plan else {}), **req.template_kwargs}
        return [runtime.encode_chat(req.messages, **kwargs)]
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


def _check_token_options(req: GenerationRequest, vocab_size: int) -> None:
    """400 for a logit_bias or stop_token_ids entry outside the vocabulary (the schema cannot know its size)."""
    p = req.sampling
    for name, ids in (("logit_bias", [t for t, _ in p.logit_bias]), ("stop_token_ids", p.stop_token_ids)):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise bad_request(f"'{name}' names token id {bad[0]}, outside the vocabulary (0..{vocab_size - 1})",
                              param=name)


def _stop_ids(req: GenerationRequest, eos_ids) -> frozenset | None:
    """The ids that end a choice: EOS (unless ignore_eos) and stop_token_ids; None: the runtime's EOS ids."""
    p = req.sampling
    if not (p.ignore_eos or p.stop_token_ids):
        return None
    return (frozenset() if p.ignore_eos else frozenset(eos_ids)) | frozenset(p.stop_token_ids)


def _echo_texts(runtime, req: GenerationRequest, prompts: list[list[int]]) -> list[str]:
    """Per prompt, the text echo puts first: the prompt as sent, or its token ids decoded."""
    return [p if isinstance(p, str) else runtime.decode(ids) for p, ids in zip(req.prompts, prompts)]


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


def _check_min_tokens(req: GenerationRequest, budgets: list[int]) -> None:
    if req.sampling.min_tokens > min(budgets):
        raise bad_request(f"'min_tokens' ({req.sampling.min_tokens}) is more than the completion can hold "
                          f"({min(budgets)} tokens with this prompt and max_tokens)", param="min_tokens")


async def generate(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    if state.inflight.closing:
        raise shutting_down()
    events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
    with state.inflight.track(events):
        return await _generate(request, state, chat, events)


async def _generate(request: web.Request, state: ServerState, chat: bool, events: asyncio.Queue):
    body = await read_json(request, state.config.read_timeout_s)
    if chat:
        _check_message_count(body, state.config.max_messages)
    req = parse_request(body, chat=chat, max_choices=state.config.max_choices)
    if req.model is not None and req.model != state.model_name:
        raise ApiError(404, f"The model '{req.model}' does not exist; this server serves '{state.model_name}'.",
                       param="model", code="model_not_found")
    _check_token_options(req, state.runtime.vocab_size)
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
    plan = _tool_plan(state.runtime, req) if chat else None
    loop = asyncio.get_running_loop()
    try:
        prompts = await loop.run_in_executor(state.tokenize_pool, _tokenize, state.runtime, req, plan)
    except ApiError:
        raise
    except PromptTooLong as exc:
        raise _too_long(req, context, exc.at_least) from None
    except Exception as exc:  # e.g. a chat template that rejects the message order
        raise bad_request(f"could not build the prompt: {exc}", param="messages" if chat else "prompt") from None
    budgets = [_max_tokens(req, len(p), state.runtime.max_context) for p in prompts]
    _check_min_tokens(req, budgets)
    if req.constraint is not None:  # its grammar against this model's vocabulary: a 400, not a failed start
        await loop.run_in_executor(state.tokenize_pool, grammars.check_for_model, state.runtime,
                                   req.sampling.grammar, req.constraint)
    echo_texts = [""] * len(prompts)
    if req.echo:  # token-id prompts are decoded: a worker's job, as tokenizing is
        echo_texts = await loop.run_in_executor(state.tokenize_pool, _echo_texts, state.runtime, req, prompts)
    stop_ids = _stop_ids(req, state.runtime.eos_token_ids)
    parsing = _chat_parsing(state.runtime, plan, prompts[0]) if chat else ChatParsing()
    if chat and parsing.plan.forces_call:
        req.sampling = await _forcing_sampling(state, req, parsing, prompts[0])
    elif chat and req.constraint is not None and parsing.reasoning is not None:
        req.sampling = await _reasoned_sampling(state, req, parsing, prompts[0])

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
            seq = Sequence(ids, budget, params, sink_for(index), stop_ids=stop_ids)
            seq.keep_special = parsing.on  # the parsers read markers that are control tokens (gpt-oss, GLM)
            seqs.append(seq)
    sched = state.scheduler
    if state.inflight.closing:  # the shutdown began while this request was read or tokenized
        raise shutting_down()
    if not sched.alive:
        raise unavailable("the engine is not running")
    try:
        sched.submit(seqs)
    except QueueFull:
        raise queue_full(retry_after_s=_retry_after(state)) from None
    except RuntimeError as exc:
        raise unavailable(str(exc)) from None

    try:
        echoes = [echo_texts[i // req.n] for i in range(len(seqs))]
        if req.stream:
            return await _stream(request, state, req, seqs, events, echoes, parsing)
        return await _collect(state, req, seqs, events, echoes, parsing)
    finally:
        sched.cancel([s for s in seqs if not s.finished])


def _retry_after(state: ServerState) -> int:
    """Seconds until the queue has likely drained: queued batches x the mean sequence duration so far."""
    st = state.scheduler.stats()
    hist = state.metrics.sequence_duration
    mean_s = hist.sum / hist.count if hist.count else 1.0
    return max(1, min(60, math.ceil(mean_s * st["waiting"] / max(1, st["max_batch"]))))


class _Logprobs:
    """One choice's logprob records shaped in its endpoint's format (None when the request asked for none)."""

    def __init__(self, req: GenerationRequest, piece):
        self.on = req.sampling.logprobs is not None
        self.chat, self.piece = req.chat, piece
        self.completion = None if req.chat else fmt.CompletionLogprobs(piece)

    def shape(self, records) -> dict | None:
        if not self.on or records is None:
            return None
        return fmt.chat_logprobs(records, self.piece) if self.chat else self.completion.shape(records)

    def echoed(self, prompt_records, echo_text: str) -> dict | None:
        """The echoed prompt's logprobs; the completion's offsets then start after the echoed text."""
        out = self.shape(prompt_records)
        if self.completion is not None:
            self.completion.skip_to(len(echo_text))
        return out


def _joined(a: dict | None, b: dict | None) -> dict | None:
    """Completions logprobs of the echoed prompt, then of the completion."""
    if a is None or b is None:
        return b if a is None else a
    return {k: a[k] + b[k] for k in a}


async def _collect(state: ServerState, req: GenerationRequest, seqs, events, echoes: list[str],
                   parsing: ChatParsing = ChatParsing()) -> web.Response:
    k = len(seqs)
    texts, reasons = [[] for _ in range(k)], [None] * k
    records, prompt_records = [[] for _ in range(k)], [[] for _ in range(k)]
    completion_tokens = 0
    left = k
    while left:
        i, ev = await events.get()
        if ev.kind == "prompt":
            prompt_records[i] = ev.logprobs
        elif ev.kind == "text":
            texts[i].append(ev.text)
            records[i].extend(ev.logprobs or ())
        elif ev.kind == "done":
            reasons[i] = ev.finish_reason
            records[i].extend(ev.logprobs or ())
            completion_tokens += ev.completion_tokens
            left -= 1
        else:
            raise _engine_error(ev)
    logprobs = None
    if req.sampling.logprobs is not None:
        logprobs = []
        for i in range(k):
            shaper = _Logprobs(req, state.runtime.token_piece)
            head = shaper.echoed(prompt_records[i], echoes[i]) if req.echo else None
            logprobs.append(_joined(head, shaper.shape(records[i])))
    prompt_tokens = _prompt_tokens(req, seqs)
    body = fmt.full_response(req.chat, fmt.new_id(req.chat), state.model_name, fmt.now(),
                             [e + "".join(t) for e, t in zip(echoes, texts)], reasons,
                             fmt.usage(prompt_tokens, completion_tokens, _cached_tokens(req, seqs)), logprobs)
    if parsing.on:
        for choice, parts, reason in zip(body["choices"], texts, reasons):
            _parse_choice(choice, parsing, "".join(parts), reason)
    return web.json_response(body)


def _parse_choice(choice: dict, parsing: ChatParsing, text: str, engine_reason: str | None) -> None:
    """A chat choice's message read by the parsers: reasoning_content, content, tool_calls."""
    out = tool_calls.parse_output(text, parsing.plan, parsing.reasoning, parsing.opened)
    _warn_missing_call(out)
    choice["message"], choice["finish_reason"] = out.message(), out.finish_reason(engine_reason)


def _warn_missing_call(out: tool_calls.ChatOutput) -> None:
    if out.missing_call:
        log.warning("tool_choice asked for a tool call and the model made none; the text is returned as it is")


def _prompt_tokens(req: GenerationRequest, seqs) -> int:
    """Prompt tokens count once per prompt, not once per choice (as OpenAI bills them)."""
    return sum(len(s.prompt_ids) for s in seqs[:: req.n])


def _cached_tokens(req: GenerationRequest, seqs) -> int:
    """Prompt tokens found in the prefix cache (not prefilled again), counted like _prompt_tokens."""
    return sum(s.cached for s in seqs[:: req.n])


async def _stream(request: web.Request, state: ServerState, req: GenerationRequest, seqs, events,
                  echoes: list[str], parsing: ChatParsing = ChatParsing()):
    chat, model, rid, created = req.chat, state.model_name, fmt.new_id(req.chat), fmt.now()
    shapers = [_Logprobs(req, state.runtime.token_piece) for _ in seqs]
    echoed = [not req.echo] * len(seqs)  # echo: a choice's first chunk is its prompt, once the engine began it
    uf = req.include_usage
    parsers = [parsing.parser() if parsing.on else None for _ in seqs]
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
                if not echoed[i] and ev.kind != "error":
                    echoed[i] = True
                    head = shapers[i].echoed(ev.logprobs if ev.kind == "prompt" else None, echoes[i])
                    out.append(fmt.sse(fmt.chunk(chat, rid, model, created, i, echoes[i], with_usage_field=uf,
                                                 logprobs=head)))
                if ev.kind == "prompt":
                    continue
                p = parsers[i]
                if ev.kind == "text" and p is not None:
                    out += _parsed_chunks(p.feed(ev.text).openai_deltas(), shapers[i].shape(ev.logprobs),
                                          rid, model, created, i, uf)
                elif ev.kind == "text":
                    out.append(fmt.sse(fmt.chunk(chat, rid, model, created, i, ev.text, with_usage_field=uf,
                                                 logprobs=shapers[i].shape(ev.logprobs))))
                elif ev.kind == "done":
                    completion_tokens += ev.completion_tokens
                    left -= 1
                    reason = ev.finish_reason
                    if p is not None:
                        out += _parsed_chunks(p.finish().openai_deltas(), None, rid, model, created, i, uf)
                        result = p.result()
                        _warn_missing_call(result)
                        reason = result.finish_reason(reason)
                    out.append(fmt.sse(fmt.chunk(chat, rid, model, created, i, None if chat else "",
                                                 finish_reason=reason, with_usage_field=uf,
                                                 logprobs=shapers[i].shape(ev.logprobs or None))))
                else:
                    # The status line is gone already: report in-band (as vLLM does), then end the stream.
                    out.append(fmt.sse(_engine_error(ev).body()))
                    failed = True
                    break
            await resp.write(b"".join(out))
        if uf and not failed:
            prompt_tokens = _prompt_tokens(req, seqs)
            await resp.write(fmt.sse(fmt.usage_chunk(chat, rid, model, created,
                                                     fmt.usage(prompt_tokens, completion_tokens,
                                                               _cached_tokens(req, seqs)))))
        await resp.write(fmt.sse("[DONE]"))
        await resp.write_eof()
    except ConnectionResetError:  # the client left; generate()'s finally cancels its sequences
        pass
    return resp


def _parsed_chunks(deltas: list[dict], logprobs: dict | None, rid: str, model: str, created: int, index: int,
                   with_usage: bool) -> list[bytes]:
    """One chat chunk per parsed delta (reasoning_content, content, a tool-call piece); the event's logprobs
    ride on its first chunk, or on an empty delta when the parser held all of its text back."""
    if not deltas and logprobs is None:
        return []
    return [fmt.sse(fmt.chunk(True, rid, model, created, index, None, with_usage_field=with_usage, delta=d,
                              logprobs=logprobs if j == 0 else None)) for j, d in enumerate(deltas or [{}])]


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


def _model_checked(state: ServerState, body) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != state.model_name:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{state.model_name}'.",
                       param="model", code="model_not_found")
    return body


def _only_keys(body: dict, allowed: tuple[str, ...]) -> None:
    extra = sorted(set(body) - set(allowed) - {"model"})
    if extra:
        raise bad_request(f"Unrecognized request argument supplied: '{extra[0]}' (this endpoint takes "
                          f"{', '.join(allowed)})", param=extra[0], code="unknown_parameter")


async def tokenize(request: web.Request):
    """vLLM's POST /tokenize: {"prompt": text} or {"messages": [...]} (rendered by the chat template, as the chat
    route would) -> {"tokens", "count", "max_model_len"}; no generation, so any length is counted."""
    state = request.app[STATE]
    body = _model_checked(state, await read_json(request, state.config.read_timeout_s))
    _only_keys(body, ("prompt", "messages"))
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("give exactly one of 'prompt' (text) or 'messages' (a chat)", param="prompt")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise bad_request("'prompt' must be a string", param="prompt")
        job = functools.partial(state.runtime.encode, body["prompt"])
    else:
        _check_message_count(body, state.config.max_messages)
        job = functools.partial(state.runtime.encode_chat, parse_messages(body))
    try:
        ids = await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, job)
    except ApiError:
        raise
    except Exception as exc:  # a chat template that rejects the messages
        raise bad_request(f"could not build the prompt: {exc}", param="messages") from None
    return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": state.runtime.max_context})


async def detokenize(request: web.Request):
    """vLLM's POST /detokenize: {"tokens": [ids]} -> {"prompt": text} (special tokens kept, as they are ids)."""
    state = request.app[STATE]
    body = _model_checked(state, await read_json(request, state.config.read_timeout_s))
    _only_keys(body, ("tokens",))
    ids = body.get("tokens")
    vocab = state.runtime.vocab_size
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request("'tokens' must be a list of token ids", param="tokens")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens")
    job = functools.partial(state.runtime.decode, ids, skip_special_tokens=False)
    text = await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, job)
    return web.json_response({"prompt": text})


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
        "hybrid_prefix_cache_lookups": ("Prompts that looked for a cached prefix (since the engine warmed up).",
                                        st["prefix_lookups"]),
        "hybrid_prefix_cache_hits": ("Prompts that continued a cached prefix.", st["prefix_hits"]),
        "hybrid_prefix_cache_tokens_reused": ("Prompt tokens not prefilled thanks to the prefix cache.",
                                              st["prefix_tokens_reused"]),
        "hybrid_prefix_cache_hit_rate": ("Hits per lookup.", st["prefix_hits"] / max(1, st["prefix_lookups"])),
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
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
