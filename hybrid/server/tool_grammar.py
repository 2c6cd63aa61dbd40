"""Forced tool calls: with tool_choice "required" or a named function the decode runs under an llguidance
grammar that admits nothing but calls in the model's own format, the text hybrid.server.tool_calls reads.

The calls, per format (the request's tools; a named function: that one only; parallel_tool_calls false:
exactly one call, else one or more):

- hermes (Qwen3, Qwen2-MoE): `<tool_call>\\n{"name": "N", "arguments": ARGS}\\n</tool_call>`, joined by "\\n";
  templates that write Qwen3-Coder's form (`<function=`): `<tool_call>\\n<function=N>\\n<parameter=K>\\nV\\n
  </parameter>\\n...</function>\\n</tool_call>`.
- deepseek: `<｜tool▁calls▁begin｜>CALLS<｜tool▁calls▁end｜>`, a call `<｜tool▁call▁begin｜>N<｜tool▁sep｜>ARGS
  <｜tool▁call▁end｜>` (V3.1), or `<｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\nARGS\\n```
  <｜tool▁call▁end｜>` joined by "\\n" where the template writes ```json (V3, R1).
- kimi_k2: `<|tool_calls_section_begin|>CALLS<|tool_calls_section_end|>`, a call `<|tool_call_begin|>
  functions.N:I<|tool_call_argument_begin|>ARGS<|tool_call_end|>`.
- glm45: `<tool_call>N\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>`, joined by "\\n".
- harmony (gpt-oss): `<|channel|>commentary to=functions.N <|constrain|>json<|message|>ARGS`, one call (the
  model's <|call|>, an end id, ends the turn).

ARGS is the tool's `parameters` schema as llguidance compiles it (no free whitespace; ", " and ": " between
items, as the templates' tojson writes them); a function without `parameters` takes `{}`. Where arguments are
written as text pairs (GLM-4.5, Qwen3-Coder), each property is one pair, in the schema's order, required ones
always, the others optional: a value is the property's JSON, except for a string property, whose text is
one of its enum / const values, or any text without "<" and without whitespace at its ends (the readers trim
it) within minLength / maxLength; a string property with a `pattern` or `format` cannot be forced that way
(a 400 naming 'tools').

A marker that is a single token llguidance counts as special (every added token) is emitted as that token,
`<[id]>`, the way the model writes it; any other marker as its text. Reasoning stays free: a "think" model
may first think (`<think>...</think>`, or only its end where the prompt opened it; nothing where the prompt
closed it, as templates do when thinking is off); a harmony model may first write an analysis message.
Once the calls are complete only an end id can follow.

`forced_grammar` is the server's entry; a model whose markers its tokenizer can neither emit as a token nor
spell as text gets no grammar (its calls are only checked afterwards, as before), with a log line once
per format.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from hybrid.server.tool_calls import ToolPlan, ToolRequestError

log = logging.getLogger("hybrid.server")

# what llguidance's JSON compiler writes between items and keys and values (json.dumps' separators, which the
# templates' tojson writes), with no other whitespace: a model cannot idle in spaces inside a call
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_TEXT = r"/(.|\n)*/"
# a string value written as text (GLM-4.5, Qwen3-Coder): no "<" (it would end the value), no whitespace at
# its ends (the readers strip it, which would change the value)
TEXT_VALUE = r"/[^<]{%s}/ & /([^<\s]([^<]*[^<\s])?)?/"
KIMI_INDEX = r"/0|[1-9][0-9]{0,3}/"
NL = "\n"
_NOT_FORCEABLE = ("pattern", "format")  # string keywords a text value cannot be held to
_logged: set[tuple[str, str]] = set()


class _Lark:
    """A grammar being written in llguidance's Lark: rules, and markers as special tokens or text."""

    def __init__(self, special: Callable[[str], int | None]):
        self.special = special
        self.rules: list[str] = []
        self.texts: set[str] = set()  # markers written as text (the tokenizer must be able to spell them)

    def marker(self, text: str) -> str:
        token = self.special(text)
        if token is not None:
            return f"<[{token}]>"
        self.texts.add(text)
        return json.dumps(text)

    def rule(self, body: str, options: str = "") -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{options}: {body}")
        return name

    def terminal(self, body: str) -> str:
        """A named terminal (a lexeme: the only place llguidance allows `&` between regexes)."""
        name = f"T{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def upto(self, marker: str) -> str:
        """Any text, then `marker` (its first occurrence, where the marker is text)."""
        token = self.special(marker)
        if token is not None:
            return f"{ANY_TEXT} <[{token}]>"
        self.texts.add(marker)
        return self.rule(ANY_TEXT, f"[suffix={json.dumps(marker)}]")

    def text(self, start: str) -> str:
        return "\n".join([f"start: {start}", *self.rules])


def _lit(text: str) -> str:
    return json.dumps(text)


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def _arguments(tool: dict) -> dict:
    """The tool's parameters schema; none given: the function takes no arguments."""
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}, "additionalProperties": False}


def _name(tool: dict) -> str:
    return tool["function"]["name"]


# --- arguments written as text pairs (GLM-4.5, Qwen3-Coder) ------------------------------------------------------

def _is_string(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _value(g: _Lark, schema: dict, where: str, defs: dict, close: str, close_text: str | None = None) -> str:
    """A property's value as the text-pair formats write it (see the module docstring), then `close` (what ends
    it). defs: the parameters' `$defs` / `definitions` (a property's JSON may refer to them). close_text: `close`
    as text where it may start with a character a text value holds (Qwen3-Coder's "\\n</parameter>"): a text
    value then ends at its first occurrence."""
    if not _is_string(schema):
        return f"{_json({**defs, **schema})} {close}"
    for word in _NOT_FORCEABLE:
        if word in schema:
            raise ToolRequestError(f"{where} has a '{word}', which this model's call format (arguments written as "
                                   "text) cannot be held to; use tool_choice \"auto\", or drop the keyword")
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if values is not None:
        kept = [v for v in values if isinstance(v, str) and "<" not in v and v == v.strip()]
        if not kept:
            raise ToolRequestError(f"{where} allows no value this model's call format can write")
        return "(" + " | ".join(_lit(v) for v in kept) + f") {close}"
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    text = g.terminal(TEXT_VALUE % f"{lo},{'' if hi is None else hi}")
    return g.rule(text, f"[suffix={json.dumps(close_text)}]") if close_text else f"{text} {close}"


def _pairs(g: _Lark, tool: dict, pair: Callable[[str, Callable[..., str]], str]) -> str:
    """Every property as pair(key, value) where value(close, close_text=None) is the grammar of its value and
    what closes it (_value): required properties always, the others optional."""
    schema = _arguments(tool)
    props = schema.get("properties") or {}
    required = [k for k in schema.get("required") or () if isinstance(k, str)]
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    parts = []
    for key, prop in props.items():
        where = f"tools: the parameter {key!r} of {_name(tool)!r}"
        prop = prop if isinstance(prop, dict) else {}
        item = pair(key, lambda close, close_text=None, prop=prop, where=where:
                    _value(g, prop, where, defs, close, close_text))
        parts.append(item if key in required else f"({item})?")
    parts += [pair(key, lambda close, close_text=None: f"{_json({})} {close}") for key in required if key not in props]
    return " ".join(parts) or '""'


# --- the formats ---------------------------------------------------------------------------------------------

def _hermes(g: _Lark, tool: dict, template: str) -> str:
    open_, close, name = g.marker("<tool_call>"), g.marker("</tool_call>"), _name(tool)
    if "<function=" in template:  # Qwen3-Coder
        end = NL + "</parameter>" + NL
        body = _pairs(g, tool, lambda k, value: f"{_lit(f'<parameter={k}>' + NL)} {value(_lit(end), end)}")
        return f"{open_} {_lit(f'{NL}<function={name}>{NL}')} {body} {_lit('</function>' + NL)} {close}"
    head = _lit(NL + '{"name": ' + json.dumps(name) + ', "arguments": ')
    return f"{open_} {head} {_json(_arguments(tool))} {_lit('}' + NL)} {close}"


def _deepseek(g: _Lark, tool: dict, template: str) -> str:
    begin, sep, end = g.marker("<｜tool▁call▁begin｜>"), g.marker("<｜tool▁sep｜>"), g.marker("<｜tool▁call▁end｜>")
    if "```json" in template:  # V3, R1
        fenced = f"{_lit(_name(tool) + NL + '```json' + NL)} {_json(_arguments(tool))} {_lit(NL + '```')}"
        return f'{begin} "function" {sep} {fenced} {end}'
    return f"{begin} {_lit(_name(tool))} {sep} {_json(_arguments(tool))} {end}"


def _kimi(g: _Lark, tool: dict, template: str) -> str:
    begin, args, end = (g.marker(m) for m in ("<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                                              "<|tool_call_end|>"))
    return f'{begin} {_lit("functions." + _name(tool) + ":")} {KIMI_INDEX} {args} {_json(_arguments(tool))} {end}'


def _glm(g: _Lark, tool: dict, template: str) -> str:
    key_open, key_close = g.marker("<arg_key>"), g.marker("</arg_key>")
    value_open, value_close = g.marker("<arg_value>"), g.marker("</arg_value>")
    body = _pairs(g, tool, lambda k, value: f"{key_open} {_lit(k)} {key_close} {_lit(NL)} {value_open} "
                                         f"{value(f'{value_close} {_lit(NL)}')}")
    return f'{g.marker("<tool_call>")} {_lit(_name(tool) + NL)} {body} {g.marker("</tool_call>")}'


def _harmony(g: _Lark, tool: dict, template: str) -> str:
    head = _lit(f"commentary to=functions.{_name(tool)} ")
    return f'{g.marker("<|channel|>")} {head} {g.marker("<|constrain|>")} "json" {g.marker("<|message|>")} ' \
           f"{_json(_arguments(tool))}"


# format -> (one call, what joins calls, what opens and closes them all)
FORMATS = {
    "hermes": (_hermes, '"\\n"', None),
    "deepseek": (_deepseek, None, ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")),
    "kimi_k2": (_kimi, None, ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")),
    "glm45": (_glm, '"\\n"', None),
    "harmony": (_harmony, None, None),
}


def call_grammar(plan: ToolPlan, special: Callable[[str], int | None], template: str = "",
                 reasoning: str | None = None, thinking: str = "free") -> tuple[str, set[str]]:
    """The Lark grammar of the forced calls of `plan` -> (grammar, the markers it writes as text).
    special(marker) -> the id of the special token that is the marker, or None; `template`: the chat template
    (which variant of a format); `reasoning` the model's reasoning format; `thinking` where the prompt left a
    "think" model: "open" (inside its reasoning), "closed" (after it) or "free"."""
    one, joiner, section = FORMATS[plan.format]
    g = _Lark(special)
    call = g.rule(" | ".join(one(g, tool, template) for tool in plan.tools))
    if plan.format == "deepseek" and "```json" in template:
        joiner = '"\\n"'
    calls = f"{call} ({joiner or ''} {call})*" if plan.parallel and plan.format != "harmony" else call
    if section:
        calls = f"{g.marker(section[0])} {calls} {g.marker(section[1])}"
    if plan.format == "glm45":
        calls = f'"\\n"? {calls}'
    if reasoning == "harmony":
        analysis = f'{g.marker("<|channel|>")} "analysis" {g.marker("<|message|>")} {g.upto("<|end|>")} ' \
                   f'{g.marker("<|start|>")} "assistant"'
        start = f"({g.rule(analysis)})? {calls}"
    elif reasoning == "think" and thinking == "open":
        start = f'{g.upto("</think>")} /\\n{{0,2}}/ {calls}'
    elif reasoning == "think" and thinking == "free":
        start = f'({g.marker("<think>")} {g.upto("</think>")} /\\n{{0,2}}/)? {calls}'
    else:
        start = calls
    return g.text(start), g.texts


# --- the server's entry ---------------------------------------------------------------------------------------

def thinking_state(reasoning: str | None, opened: bool, prompt_tail: str) -> str:
    """Where the prompt leaves a "think" model: "open", "closed" (the generation prompt ends with </think>,
    as templates write it when thinking is off) or "free" (the model may think first)."""
    if opened:
        return "open"
    return "closed" if reasoning == "think" and prompt_tail.rstrip().endswith("</think>") else "free"


def _special_token(runtime, ll_tokenizer) -> Callable[[str], int | None]:
    token_id = getattr(runtime.tokenizer, "token_id", None)

    def special(text: str) -> int | None:
        i = token_id(text) if token_id is not None else None
        ok = i is not None and 0 <= i < ll_tokenizer.vocab_size and ll_tokenizer.is_special_token(i)
        return i if ok else None

    return special


def _unspellable(runtime, texts) -> list[str]:
    """Markers the tokenizer cannot write as text (they would decode to something else)."""
    return [t for t in sorted(texts) if t not in (runtime.decode(runtime.encode(t)) or "")]


def _fallback(fmt: str, why: str) -> None:
    if (fmt, why) not in _logged:
        _logged.add((fmt, why))
        log.warning("tool_choice required / named cannot be forced for this model's %s calls (%s); its output is "
                    "only checked for a call afterwards", fmt, why)


def forced_grammar(runtime, plan: ToolPlan, reasoning: str | None, opened: bool, prompt: list[int]) -> str | None:
    """The llguidance grammar that forces the calls of `plan` (tool_choice "required" or named) for this model,
    or None (a plan that forces nothing, or a model that cannot be forced: logged once). ToolRequestError
    (a 400) for tools whose parameters cannot be forced. Builds the llguidance tokenizer on first use (seconds
    for a large vocabulary): a worker thread's job."""
    from llguidance import LLMatcher

    if plan.choice not in ("required", "function") or plan.format not in FORMATS:
        return None
    try:
        ll_tokenizer = runtime.sampling.grammar_vocab()
    except ValueError as exc:
        _fallback(plan.format, str(exc))
        return None
    tail = runtime.decode(prompt[-16:], skip_special_tokens=False) if reasoning == "think" else ""
    lark, texts = call_grammar(plan, _special_token(runtime, ll_tokenizer), runtime.chat_template or "", reasoning,
                               thinking_state(reasoning, opened, tail))
    missing = _unspellable(runtime, texts)
    if missing:
        _fallback(plan.format, f"its tokenizer has no token for {missing[0]!r} and cannot spell it")
        return None
    grammar = LLMatcher.grammar_from_lark(lark)
    error = LLMatcher.validate_grammar(grammar, ll_tokenizer)
    if error:
        raise ToolRequestError(f"tools: the parameter schemas cannot be forced (tool_choice): "
                               f"{error.splitlines()[0][:300]}")
    return grammar
