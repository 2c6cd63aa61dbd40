"""Tokenizer from a checkpoint directory: tokenizer.json (the `tokenizers` library) plus
tokenizer_config.json (special tokens, chat template rendered with jinja2 as transformers does).

A chat template is a program shipped with the model, and it runs on text clients send. Rendering it is
bounded, so that no template (hostile, or merely fed a hostile message) can take the process down:

- size: every value the template builds is measured (jinja's sandbox hooks: operators, calls, filters,
  `~`, namespace attributes, macro output and each output chunk), before it is built where its size can be
  known (string or list repetition, `replace`, `join`, widths, format strings, ...). A value or the prompt
  past the limit (RENDER_MAX_CHARS plus RENDER_INPUT_FACTOR times the size of the messages), or values
  adding up past RENDER_BUILD_FACTOR times it, stop the render: memory stays bounded, and the tokenizer
  never sees a giant prompt;
- time: the template is compiled with a check at the start of every block (each loop iteration, macro
  call, branch), which stops the render once its thread has used RENDER_CPU_S seconds of CPU time. An
  endless loop is stopped where it runs (a deadline on a worker thread would leave the thread spinning);
  jinja has no loop without a block, and the work between two checks is bounded by the size limit;
- recursion: Python's recursion limit, raised as RecursionError.

Inputs reach the template as transformers passes them: `messages`, `add_generation_prompt`, `tools` and
`documents` (None unless given), bos/eos tokens and any other keyword (`enable_thinking`, `thinking`,
`reasoning_effort`, ...), with transformers' `tojson` (ensure_ascii, indent, separators, sort_keys) and
`strftime_now`. Tool-call arguments sent as a JSON string (the OpenAI wire form) become ToolArguments: a
dict for templates that walk them (`.items()`, `tojson`), the JSON text for those that concatenate them.

Every failure of a template (a syntax error, an undefined value used, raise_exception, a sandbox
violation, recursion, a limit, any exception in its code) is a ChatTemplateError: one line naming the
template file and the cause. It is a ValueError (the server answers 400) and a UsageError (the CLI prints
one line and exits with 2).
"""

from __future__ import annotations

import json
import re
import threading
import time
from functools import wraps
from pathlib import Path

from hybrid.errors import UsageError
from hybrid.models.errors import ModelLoadError

RENDER_MAX_CHARS = 4 * 2**20  # characters a rendered prompt (or any value in the render) may have ...
RENDER_INPUT_FACTOR = 4  # ... plus this many times the characters of the messages and other inputs
RENDER_BUILD_FACTOR = 8  # all the values a render builds together: this many times that limit
RENDER_CPU_S = 1.0  # CPU seconds (of the rendering thread) a render may take; real templates need ~1 ms
_CHECK_EVERY = 256  # blocks entered between two reads of the thread's CPU clock


class ChatTemplateError(UsageError, ValueError):
    """A chat template that cannot render these messages; the message names the template file and the cause."""


class _LimitExceeded(BaseException):
    """A render stopped by a limit. BaseException, so that no `except Exception` in jinja's or a
    filter's code swallows it and lets the render go on."""


class _TemplateRaised(Exception):
    """raise_exception(message) called by the template: it refuses the messages."""


def _token_text(value, name: str, origin: Path) -> str | None:
    """bos_token/eos_token: a string or {"content": "<|im_end|>", ...} (older tokenizer_config files)."""
    if isinstance(value, dict):
        value = value.get("content")
        if not isinstance(value, str):
            raise ModelLoadError(f"{origin}: {name} must be a string or an object with a string \"content\"")
    if value is not None and not isinstance(value, str):
        raise ModelLoadError(f"{origin}: {name} must be a string, got {type(value).__name__} {_short(value)}")
    return value


def _short(value, n: int = 80) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _template_from_config(value, origin: Path) -> str | None:
    """chat_template: a string, or transformers' list of {"name": ..., "template": ...} (the one named
    "default", else the first)."""
    if value is None or isinstance(value, str):
        return value
    where = f"{origin}: chat_template"
    if not isinstance(value, list):
        raise ModelLoadError(f"{where} must be a string or a list of {{\"name\", \"template\"}} objects, "
                             f"got {type(value).__name__}")
    if not value:
        raise ModelLoadError(f"{where} is an empty list")
    for i, entry in enumerate(value):
        if not (isinstance(entry, dict) and isinstance(entry.get("template"), str)):
            raise ModelLoadError(f"{where}[{i}] must be an object with a string \"template\", got {_short(entry)}")
    named = {t.get("name"): t["template"] for t in value}
    return named.get("default", value[0]["template"])


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"missing file: {tok_file}")
        try:
            self.tok = HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the tokenizers library raises bare Exceptions for a corrupt file
            raise ModelLoadError(f"{tok_file}: not a readable tokenizer ({(str(exc).splitlines() or [type(exc).__name__])[0][:200]})") from None
        cfg_file = path / "tokenizer_config.json"
        from hybrid.models.checks import read_json_object, read_text

        self.config = read_json_object(cfg_file) if cfg_file.is_file() else {}
        template = _template_from_config(self.config.get("chat_template"), cfg_file)
        self.chat_template_source = f"{cfg_file} (chat_template)"
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = read_text(jinja_file)
            self.chat_template_source = str(jinja_file)
        self.chat_template = template
        self.bos_token = _token_text(self.config.get("bos_token"), "bos_token", cfg_file)
        self.eos_token = _token_text(self.config.get("eos_token"), "eos_token", cfg_file)
        self._compiled = None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.tok.token_to_id(text)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        t = self.token_id(self.eos_token)
        return () if t is None else (t,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def compile_chat_template(self):
        """The compiled template (compiled once); ChatTemplateError if it does not compile."""
        if self.chat_template is None:
            raise ModelLoadError("this tokenizer has no chat template (tokenizer_config.json: chat_template)")
        if self._compiled is None:
            env = _environment()
            self._compiled = _run_limited(lambda: env.compile_template(self.chat_template),
                                          self.chat_template_source)
        return self._compiled

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) to the prompt text, within the limits above.
        kwargs reach the template as variables: `tools` ([{"type": "function", "function": {...}}]), and
        template switches such as enable_thinking=False."""
        template = self.compile_chat_template()
        variables = dict(tools=None, documents=None, bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        variables.update(kwargs)
        variables.update(messages=template_messages(messages), add_generation_prompt=add_generation_prompt)
        return _run_limited(lambda: _render(template, variables), self.chat_template_source, variables)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        # The template already writes any BOS token, so no special tokens are added again. Only the
        # template's own markers become control tokens: "<|im_end|>" typed by a user stays text.
        from hybrid.runtime.chat_tokens import encode_chat_plain_contents

        return encode_chat_plain_contents(
            self, messages, lambda msgs, **kw: self.apply_chat_template(msgs, add_generation_prompt, **kw), **kwargs)


# --- template inputs ------------------------------------------------------------------------------------

class ToolArguments(dict):
    """A tool call's arguments as the templates of every family read them: a dict (GLM-4.5 walks
    `.items()`, gpt-oss and Qwen3 apply `tojson`), whose text is its JSON (DeepSeek concatenates
    `'...' + arguments`, Kimi prints it), so one value serves both kinds of template."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other):
        return str(self) + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other):
        return other + str(self) if isinstance(other, str) else NotImplemented


def _arguments(value):
    """Arguments sent as JSON text -> ToolArguments (a dict: ToolArguments too); anything else as it is."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value) if value.strip() else {}
        except (ValueError, RecursionError):
            return value  # not JSON: a template that needs a dict refuses it in one line
        return ToolArguments(parsed) if isinstance(parsed, dict) else value
    return ToolArguments(value) if isinstance(value, dict) and not isinstance(value, ToolArguments) else value


def _with_arguments(call):
    """One entry of an assistant message's tool_calls with its arguments made ToolArguments."""
    if not isinstance(call, dict):
        return call
    out = dict(call)
    fn = call.get("function")
    if isinstance(fn, dict) and "arguments" in fn:
        out["function"] = {**fn, "arguments": _arguments(fn["arguments"])}
    if "arguments" in call:  # (the flat {"name", "arguments"} spelling some clients send)
        out["arguments"] = _arguments(call["arguments"])
    return out


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as templates expect them (vLLM does the same): tool-call arguments as ToolArguments.
    Messages without tool_calls are passed as they are; the caller's dicts are not changed."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list) and calls:
            m = {**m, "tool_calls": [_with_arguments(c) for c in calls]}
        out.append(m)
    return out


# --- bounded rendering ----------------------------------------------------------------------------------

class _RenderState(threading.local):
    """The limit and the size memo of the render running in this thread."""

    limit = RENDER_MAX_CHARS
    built = 0  # characters of the values built so far
    memo: dict = {}
    deadline = 0.0  # time.thread_time() at which the render is stopped
    ticks = 0  # blocks entered (loop iterations, macro calls, branches)


_STATE = _RenderState()


def _run_limited(work, source: str, inputs=None):
    """work() under the size limit (RENDER_MAX_CHARS plus RENDER_INPUT_FACTOR times the size of `inputs`)
    and the CPU-time limit; every failure -> ChatTemplateError."""
    outer = (_STATE.limit, _STATE.built, _STATE.memo, _STATE.deadline, _STATE.ticks)
    _STATE.limit, _STATE.built, _STATE.memo = RENDER_MAX_CHARS, 0, {}
    _STATE.deadline, _STATE.ticks = time.thread_time() + RENDER_CPU_S, 0
    try:
        _STATE.limit += RENDER_INPUT_FACTOR * _weight(inputs, _STATE.memo)
        return work()
    except _LimitExceeded as exc:
        raise ChatTemplateError(f"chat template {source}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - whatever the template's code raises is the template's failure
        raise ChatTemplateError(f"chat template {source}: {_cause(exc)}") from None
    finally:
        _STATE.limit, _STATE.built, _STATE.memo, _STATE.deadline, _STATE.ticks = outer


def _cause(exc: Exception) -> str:
    from jinja2.exceptions import SecurityError, TemplateSyntaxError, UndefinedError

    if isinstance(exc, _TemplateRaised):
        text = f"refuses these messages: {exc}"
    elif isinstance(exc, TemplateSyntaxError):
        text = f"syntax error on line {exc.lineno}: {exc.message}"
    elif isinstance(exc, UndefinedError):
        text = f"uses an undefined value ({exc.message})"
    elif isinstance(exc, SecurityError):
        text = f"tried an operation the sandbox forbids ({exc})"
    elif isinstance(exc, RecursionError):
        text = "recurses too deeply (a macro or recursive loop that never ends?)"
    elif isinstance(exc, MemoryError):
        text = "ran out of memory"
    else:
        text = f"failed with {type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."


def _tick() -> None:
    """Called by the compiled template at the start of every block it enters (each loop iteration, macro
    call, branch taken): the render stops once its thread has used RENDER_CPU_S of CPU time."""
    _STATE.ticks += 1
    if _STATE.ticks % _CHECK_EVERY == 0 and time.thread_time() > _STATE.deadline:
        raise _LimitExceeded(f"took more than {RENDER_CPU_S:g} s of CPU time to render (an endless loop?)")


def _weight(value, memo: dict) -> int:
    """Characters `value` stands for when rendered: strings by length, containers by their items (shared
    items counted each time they occur, each container measured once per render: `memo`)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return value.bit_length() // 3  # (decimal digits, roughly)
    if _NAMESPACE is not None and isinstance(value, _NAMESPACE):
        value = object.__getattribute__(value, "_Namespace__attrs")
    if not isinstance(value, (list, tuple, dict)):
        return 1
    hit = memo.get(id(value))
    if hit is not None:
        return hit[1]
    items = (x for kv in value.items() for x in kv) if isinstance(value, dict) else value
    n = len(value) + sum(_weight(x, memo) for x in items)
    memo[id(value)] = (value, n)  # the value is kept, so its id is not reused during the render
    return n


def _ints(args) -> list[int]:
    return [a for a in args if isinstance(a, int) and not isinstance(a, bool)]


def _check_size(n: int, what: str) -> None:
    if n > _STATE.limit:
        raise _LimitExceeded(f"{what} would be {n} characters long, over the limit of {_STATE.limit} "
                             "(RENDER_MAX_CHARS plus RENDER_INPUT_FACTOR times the size of the messages)")


def _check(value, what: str) -> None:
    _check_size(_weight(value, _STATE.memo), what)


def _made(value, what: str) -> None:
    """A value the template has just built: within the limit, and counted against the budget of all the
    values built (kept in macro buffers or deep recursion, many values within the limit add up)."""
    n = _weight(value, _STATE.memo)
    _check_size(n, what)
    _STATE.built += n
    if _STATE.built > RENDER_BUILD_FACTOR * _STATE.limit:
        raise _LimitExceeded(f"the values it builds would be more than {RENDER_BUILD_FACTOR * _STATE.limit} "
                             "characters long in all (RENDER_BUILD_FACTOR times the limit)")


def _check_args(args, what: str) -> None:
    for a in args:
        _check(a, f"an argument of {what}")
    for n in _ints(args):
        _check_size(abs(n), f"a value sized by the number given to {what}")


_NUMBER = re.compile(r"\d+")


def _check_format(fmt: str, args, what: str) -> None:
    """A format string's widths, and its fields times the size of the arguments."""
    for digits in _NUMBER.findall(fmt):
        _check_size(int(digits) if len(digits) < 20 else 10**20, f"a field sized by a number in {what}")
    fields = fmt.count("{") + fmt.count("%")
    _check_size(len(fmt) + fields * sum(_weight(a, _STATE.memo) for a in args), f"the result of {what}")


def _estimate(name: str, subject, args) -> None:
    """Checks made before the calls whose result can be far larger than their arguments."""
    memo = _STATE.memo
    what = f"the result of {name}"
    if name == "replace" and isinstance(subject, str) and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        hits = len(subject) + 1 if not old else subject.count(old)
        _check_size(len(subject) + hits * max(len(new) - len(old), 0), what)
    elif name == "expandtabs" and isinstance(subject, str):
        tab = _ints(args)[0] if _ints(args) else 8
        _check_size(len(subject) + subject.count("\t") * abs(tab), what)
    elif name == "indent" and isinstance(subject, str):
        width = args[0] if args else 4
        width = len(width) if isinstance(width, str) else abs(width) if _ints([width]) else 4
        _check_size(len(subject) + (subject.count("\n") + 1) * width, what)
    elif name == "wordwrap" and isinstance(subject, str):
        sep = args[2] if len(args) > 2 and isinstance(args[2], str) else "\n"
        _check_size(len(subject) * (1 + len(sep)), what)
    elif name in ("format", "format_map", "%") and isinstance(subject, str):
        _check_format(subject, args, name)
    elif name == "translate" and isinstance(subject, str):
        _check_size(len(subject) * (1 + sum(_weight(a, memo) for a in args)), what)
    elif name == "join":
        sep, items = (subject, args[0] if args else ()) if isinstance(subject, str) else (
            args[0] if args and isinstance(args[0], str) else "", subject)
        if isinstance(items, (list, tuple, str)):
            _check_size(_weight(items, memo) + len(sep) * len(items), what)


def _raise_exception(message):
    raise _TemplateRaised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson: no HTML escaping, non-ASCII kept, and the json.dumps options templates pass
    (Kimi-K2 renders its tools with separators=(',', ':'); a different spelling is a prompt it never saw)."""
    if separators is not None:
        separators = tuple(separators)
    _check_size(_json_bound(x, indent, separators), "the result of the filter tojson")
    return json.dumps(x, ensure_ascii=bool(ensure_ascii), indent=indent, separators=separators,
                      sort_keys=bool(sort_keys))


def _json_bound(x, indent, separators) -> int:
    """About how many characters json.dumps(x, ...) makes, known before it runs: x's own characters, and
    per item its separators and, with an indent, a line indented at every level of nesting. (Escapes, at
    most a few characters per character of x, are measured on the result as every value is.)"""
    entries, depth = _json_shape(x)
    seps = sum(len(str(s)) for s in separators) if separators else 4
    lines = 0
    if indent is not None:
        width = abs(indent) if _ints([indent]) else len(str(indent))
        lines = (entries + 1) * (width * depth + 1)
    return _weight(x, _STATE.memo) + entries * seps + lines


def _json_shape(x, level: int = 0) -> tuple[int, int]:
    """(items in all of x's containers, how deeply they nest); strings are not walked."""
    if isinstance(x, dict):
        x = list(x.values())
    if not isinstance(x, (list, tuple)):
        return 0, level
    entries, depth = len(x), level + 1
    for v in x:
        if isinstance(v, (dict, list, tuple)):
            e, d = _json_shape(v, level + 1)
            entries, depth = entries + e, max(depth, d)
    return entries, depth


def _strftime_now(fmt: str) -> str:
    """transformers' strftime_now: today's date in templates that print it (gpt-oss, Llama)."""
    return time.strftime(fmt)


_ENVIRONMENT_CLASS = None
_NAMESPACE = None  # jinja2.utils.Namespace, once jinja2 is imported


def _environment():
    """A new bounded jinja environment (its class made once: jinja2 is imported on first use)."""
    global _ENVIRONMENT_CLASS
    if _ENVIRONMENT_CLASS is None:
        _ENVIRONMENT_CLASS = _make_environment_class()
    return _ENVIRONMENT_CLASS()


def _make_environment_class():
    global _NAMESPACE
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    _NAMESPACE = Namespace

    class TickingCodeGenerator(CodeGenerator):
        """Compiles every block (loop body, macro body, branch) to start with a call of _tick: each
        iteration of a loop, however empty, passes the CPU-time check."""

        def blockvisit(self, nodes, frame):
            self.writeline("environment.tick()")
            super().blockvisit(nodes, frame)

    class BoundedNamespace(Namespace):
        """namespace() whose attributes are measured when set: a loop doubling ns.text stops at the cap."""

        def __setitem__(self, name, value):
            _check(value, f"namespace attribute {name}")
            super().__setitem__(name, value)

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """transformers' environment (immutable sandbox, trim_blocks, lstrip_blocks, loop controls,
        raise_exception, tojson) with every operation that can build a large value measured."""

        intercepted_binops = frozenset(["*", "+", "**", "%"])
        code_generator_class = TickingCodeGenerator
        tick = staticmethod(_tick)

        def __init__(self):
            super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            self.filters["tojson"] = _tojson
            self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
            self.globals["raise_exception"] = _raise_exception
            self.globals["strftime_now"] = _strftime_now
            self.globals["namespace"] = BoundedNamespace

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                seq, n = (left, right) if _ints([right]) else (right, left)
                if _ints([n]) and isinstance(seq, (str, list, tuple)):
                    _check_size(_weight(seq, _STATE.memo) * max(n, 0), "a repeated value")
            elif operator == "+" and isinstance(left, (str, list, tuple)):
                _check_size(_weight(left, _STATE.memo) + _weight(right, _STATE.memo), "a concatenation")
            elif operator == "**" and _ints([left]) and _ints([right]) and right > 0:
                _check_size(right * abs(left).bit_length() // 3, "a power")
            elif operator == "%" and isinstance(left, str):
                _estimate("%", left, right if isinstance(right, tuple) else (right,))
            out = super().call_binop(context, operator, left, right)
            _made(out, "a value")
            return out

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
            name = getattr(__obj, "__name__", "") or "a call"
            _check_args(list(args) + list(kwargs.values()), f"{name}()")
            _estimate(name, getattr(__obj, "__self__", None), args)
            out = super().call(__context, __obj, *args, **kwargs)
            _made(out, f"the result of {name}()")
            return out

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            fmt = value.__self__

            @wraps(wrapped)
            def bounded(*args, **kwargs):
                _check_format(fmt, list(args) + list(kwargs.values()), "str.format")
                return wrapped(*args, **kwargs)

            return bounded

        def concat(self, parts):  # macro, call and block output (jinja's default: "".join)
            out = "".join(parts)
            _made(out, "a macro's or block's output")
            return out

        def compile_template(self, source: str):
            template = self.from_string(source)
            names = template.root_render_func.__globals__  # the compiled template's module
            names["str"] = _bounded_str  # output expressions: {{ x }} is yield str(x)
            names["str_join"] = names["markup_join"] = _bounded_join  # the ~ operator
            return template

    return BoundedSandbox


def _bounded_filter(name: str, f):
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # (context, eval context or environment)

    @wraps(f)  # (keeps jinja's pass_context/pass_environment mark)
    def bounded(*args, **kwargs):
        plain = args[skip:]
        _check_args(list(plain) + list(kwargs.values()), f"the filter {name}")
        if plain:
            _estimate(name, plain[0], plain[1:])
        out = f(*args, **kwargs)
        _made(out, f"the result of the filter {name}")
        return out

    return bounded


def _bounded_str(value) -> str:
    if isinstance(value, str):
        return value
    _check(value, "an output value")
    out = str(value)
    _made(out, "an output value")
    return out


def _bounded_join(seq) -> str:
    parts = [_bounded_str(p) for p in seq]
    _check_size(sum(map(len, parts)), "a concatenation (~)")
    out = "".join(parts)
    _made(out, "a concatenation (~)")
    return out


def _render(template, variables: dict) -> str:
    """The template's output, chunk by chunk, stopped as soon as it passes the limit."""
    parts, total = [], 0
    for chunk in template.generate(variables):
        total += len(chunk)
        _check_size(total, "the prompt")
        parts.append(chunk)
    return "".join(parts)
