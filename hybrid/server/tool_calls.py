"""Tool calls in a model's generated text -> OpenAI `tool_calls`, per family, streaming and not.

Formats (each family's published chat template writes its turns so; `tool_format_for` picks one from the
template's markers, else from the family):

- hermes (Qwen3, Qwen2-MoE): `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, several in a
  row for parallel calls; Qwen3-Coder's `<tool_call><function=N><parameter=K>V</parameter></function>`
  inside the same markers is read too.
- deepseek (V3, R1, V3.1): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜>...
  <｜tool▁calls▁end｜>`, a call being `function<｜tool▁sep｜>N\\n```json\\n{...}\\n```` (V3, R1) or
  `N<｜tool▁sep｜>{...}` (V3.1).
- kimi_k2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.N:I<|tool_call_argument_begin|>{...}
  <|tool_call_end|><|tool_calls_section_end|>`; the call's id is the model's own `functions.N:I` (its
  template prints ids back in that form).
- glm45: `<tool_call>N\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>`; a value is JSON-
  decoded unless the tool's schema says the parameter is a string (or it is not JSON).
- harmony (gpt-oss): a message `<|channel|>commentary to=functions.N <|constrain|>json<|message|>{...}`
  (hybrid.server.reasoning splits the channels).

A call is handed out once it is complete (its end marker, or the end of the text): a name delta, then its
arguments, so that a call whose JSON turns out bad becomes content in the stream exactly as it does
unstreamed (never a half-sent call). Content streams as it comes, except text that may be the start of a
marker (held back, like stop strings) and whitespace next to calls (dropped). `parse_output(text, ...)` is
the streaming parser fed the whole text: streamed deltas reassemble to the unstreamed result exactly.

Per request (`plan_tools`): `tools` and `tool_choice` are checked (ToolRequestError: a 400 naming the
parameter), the tools to render are chosen, and the calls to keep: "none" renders no tools and parses
none; "auto" both; "required" both, and the decode is held to calls by a grammar of the model's format
(hybrid.server.tool_grammar; where a model cannot be forced, or a cut ends the call, a text without a call
is returned as it is: `ChatOutput.missing_call`); a named function renders that tool only, is forced to
it and keeps only its calls; parallel_tool_calls=false keeps the first call (and forces exactly one).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Callable

from hybrid.server.reasoning import first_marker, new_splitter, partial_suffix

# model_type -> the format its published templates use (a template's own markers win: tool_format_for)
FAMILY_FORMATS = {"qwen3_moe": "hermes", "qwen2_moe": "hermes", "deepseek_v3": "deepseek",
                  "kimi_k2": "kimi_k2", "kimi_k25": "kimi_k2", "glm4_moe": "glm45", "gpt_oss": "harmony"}
# markers that identify each format in a chat template, most specific first
TEMPLATE_MARKERS = (("harmony", "<|channel|>"), ("kimi_k2", "<|tool_call_begin|>"),
                    ("deepseek", "<｜tool▁call▁begin｜>"), ("glm45", "<arg_key>"), ("hermes", "<tool_call>"))
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.:/-]{1,256}$")  # (OpenAI allows [A-Za-z0-9_-]{1,64}; MCP clients send more)
CHOICES = ("none", "auto", "required")


class ToolRequestError(ValueError):
    """tools / tool_choice the server cannot serve as asked: the server's 400, naming `param`."""

    def __init__(self, message: str, param: str = "tools"):
        super().__init__(message)
        self.param = param


# --- results ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def to_openai(self) -> dict:
        """An entry of the response message's `tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of a streamed call: the first carries id and name, the next its arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        """An entry of a chunk's `delta.tool_calls`."""
        if self.name is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass
class OutputDelta:
    """What one streamed piece of generated text adds."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def openai_deltas(self) -> list[dict]:
        """The chunks' `delta` objects, one per piece, in OpenAI's shapes: {"reasoning_content": ...},
        {"content": ...}, {"tool_calls": [entry]}."""
        out = []
        if self.reasoning:
            out.append({"reasoning_content": self.reasoning})
        if self.content:
            out.append({"content": self.content})
        out += [{"tool_calls": [d.to_openai()]} for d in self.tool_calls]
        return out


@dataclass
class ChatOutput:
    """A whole choice: reasoning, content and the calls kept."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]
    missing_call: bool = False  # tool_choice required or named, and the text holds no (complete) call

    def message(self) -> dict:
        """The response's `message`: content null only beside calls (as OpenAI sends it), else a string."""
        content = self.content if self.content is not None or self.tool_calls else ""
        msg = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """"tool_calls" when calls are returned and the model ended its turn; "length" stays (a cut)."""
        return "tool_calls" if self.tool_calls and engine_reason == "stop" else engine_reason


# --- the request's plan -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolPlan:
    """How a request's tools are handled: `format` None means no calls are parsed."""

    format: str | None = None
    tools: tuple = ()  # the tools the template renders (OpenAI function schemas)
    choice: str = "none"  # "none" | "auto" | "required" | "function" (the named one)
    name: str | None = None  # tool_choice's function
    parallel: bool = True

    def template_kwargs(self) -> dict:
        """Keywords for the chat template (Tokenizer.apply_chat_template / encode_chat)."""
        return {"tools": list(self.tools)} if self.tools else {}

    @property
    def parses(self) -> bool:
        return self.format is not None

    @property
    def forces_call(self) -> bool:
        """tool_choice "required" or a named function: the decode is held to calls (hybrid.server.tool_grammar)."""
        return self.parses and self.choice in ("required", "function")


def tool_format_for(family: str | None, chat_template: str | None) -> str | None:
    """The call format of a model: the one whose markers its chat template writes, else its family's if the
    template renders `tools` at all; None: this model's calls cannot be parsed."""
    template = chat_template or ""
    for fmt, marker in TEMPLATE_MARKERS:
        if marker in template:
            return fmt
    if "tools" in template:
        return FAMILY_FORMATS.get(family or "")
    return None


def plan_tools(tools, tool_choice=None, *, family: str | None, chat_template: str | None,
               parallel_tool_calls=True) -> ToolPlan:
    """Check a request's `tools` / `tool_choice` (as sent: JSON values) and plan them for this model.
    ToolRequestError (400) for malformed values, a named function not in `tools`, or tools asked for a model
    whose calls cannot be parsed (tool_choice "none" is always accepted)."""
    tools, choice, name = checked_request(tools, tool_choice, parallel_tool_calls)
    if not tools or choice == "none":
        return ToolPlan()
    fmt = tool_format_for(family, chat_template)
    if fmt is None:
        raise ToolRequestError(
            f"this model ({family or 'unknown family'}) has no tool-call format the server can read (its chat "
            "template writes none it knows); send the request without 'tools' or with tool_choice \"none\"")
    if choice == "function":
        tools = [t for t in tools if t["function"]["name"] == name]
    return ToolPlan(fmt, tuple(tools), choice, name, parallel=parallel_tool_calls is not False)


def checked_request(tools, tool_choice=None, parallel_tool_calls=None) -> tuple[list[dict], str, str | None]:
    """The checks of plan_tools that need no model (the request schema runs them: a malformed request is a
    400 whatever the model) -> (tools, choice, tool_choice's function name)."""
    tools = _checked_tools(tools)
    choice, name = _checked_choice(tool_choice, tools)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolRequestError("'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    return tools, choice, name


def _checked_tools(tools) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolRequestError(f"'tools' must be a list of {{\"type\": \"function\", \"function\": {{...}}}}, "
                               f"got {type(tools).__name__}")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolRequestError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise ToolRequestError(f"{where}.function.name must be 1 to 256 letters, digits or '_', '-', '.', ':', "
                                   f"'/', got {str(name)[:80]!r}")
        if name in names:
            raise ToolRequestError(f"{where}: the function name {name!r} is given twice")
        names.add(name)
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise ToolRequestError(f"{where}.function.parameters must be a JSON Schema object")
        if "description" in fn and not isinstance(fn["description"], (str, type(None))):
            raise ToolRequestError(f"{where}.function.description must be a string")
    return tools


def _checked_choice(tool_choice, tools: list[dict]) -> tuple[str, str | None]:
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ToolRequestError(f"'tool_choice' must be one of {', '.join(CHOICES)} or "
                                   f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {tool_choice[:40]!r}",
                                   param="tool_choice")
        if tool_choice == "required" and not tools:
            raise ToolRequestError("tool_choice \"required\" needs 'tools'", param="tool_choice")
        return tool_choice, None
    named = isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
    fn = tool_choice.get("function") if named else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ToolRequestError("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                               "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise ToolRequestError(f"tool_choice names the function {name[:80]!r}, which is not in 'tools'",
                               param="tool_choice")
    return "function", name


# --- reading one call's text ----------------------------------------------------------------------------------

def _param_types(tools) -> dict[str, dict[str, str]]:
    """function name -> {parameter: JSON Schema type} (for values written as text: GLM, Qwen3-Coder)."""
    out = {}
    for t in tools:
        props = (t["function"].get("parameters") or {}).get("properties")
        if isinstance(props, dict):
            out[t["function"]["name"]] = {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
    return out


def _value(text: str, schema_type) -> object:
    """A parameter written as text: a string if its schema says so (or it is not JSON), else its JSON."""
    if schema_type == "string" or (isinstance(schema_type, list) and "string" in schema_type):
        return text
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _object(text: str) -> dict | None:
    """A JSON object, or None (bad JSON, or not an object)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


_XML_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_DSV3_CALL = re.compile(r"^\s*function\s*<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*)\n```\s*$", re.S)
_DSV31_CALL = re.compile(r"^\s*([^<\n]+?)\s*<｜tool▁sep｜>(.*)$", re.S)
_KIMI_CALL = re.compile(r"^\s*([^<\s]+)\s*<\|tool_call_argument_begin\|>(.*)$", re.S)


def _read_hermes(body: str, types) -> tuple | None:
    m = _XML_FUNCTION.match(body)
    if m:
        return _read_pairs(m.group(1).strip(), m.group(2), _XML_PARAM, types, strip_newlines=True)
    call = _object(body)
    if call is None or not isinstance(call.get("name"), str) or not FUNCTION_NAME.match(call["name"]):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):
        args = _object(args)
    return (call["name"], args, None) if isinstance(args, dict) else None


def _read_pairs(name: str, rest: str, pattern, types, strip_newlines: bool = False) -> tuple | None:
    """NAME then key/value pairs (GLM-4.5, Qwen3-Coder); None if anything else is left between them."""
    if not FUNCTION_NAME.match(name) or pattern.sub("", rest).strip():
        return None
    kinds = types.get(name, {})
    args = {}
    for key, raw in pattern.findall(rest):
        key = key.strip()
        raw = raw.strip("\n") if strip_newlines else raw.strip()
        args[key] = _value(raw, kinds.get(key))
    return name, args, None


def _read_glm(body: str, types) -> tuple | None:
    head, sep, rest = body.partition("<arg_key>")
    return _read_pairs(head.strip(), sep + rest, _GLM_PAIR, types)


def _read_deepseek(body: str, types) -> tuple | None:
    m = _DSV3_CALL.match(body) or _DSV31_CALL.match(body)
    if not m:
        return None
    args = _object(m.group(2))
    name = m.group(1).strip()
    return (name, args, None) if args is not None and FUNCTION_NAME.match(name) else None


def _read_kimi(body: str, types) -> tuple | None:
    m = _KIMI_CALL.match(body)
    if not m:
        return None
    call_id, args = m.group(1), _object(m.group(2))
    name = call_id.rsplit(":", 1)[0] if re.search(r":\d+$", call_id) else call_id
    name = name[len("functions."):] if name.startswith("functions.") else name
    return (name, args, call_id) if args is not None and FUNCTION_NAME.match(name) else None


@dataclass(frozen=True)
class Markup:
    """Where a format's calls are: optional section markers around them, the call markers, and a reader
    of one call's text -> (name, arguments dict, the model's own id or None), None when malformed."""

    call_begin: tuple
    call_end: str
    read: Callable
    section_begin: tuple = ()
    section_end: tuple = ()


MARKUPS = {
    "hermes": Markup(("<tool_call>",), "</tool_call>", _read_hermes),
    "glm45": Markup(("<tool_call>",), "</tool_call>", _read_glm),
    "deepseek": Markup(("<｜tool▁call▁begin｜>",), "<｜tool▁call▁end｜>", _read_deepseek,
                       ("<｜tool▁calls▁begin｜>",), ("<｜tool▁calls▁end｜>",)),
    "kimi_k2": Markup(("<|tool_call_begin|>",), "<|tool_call_end|>", _read_kimi,
                      ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>"),
                      ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")),
}


# --- streaming ------------------------------------------------------------------------------------------------

def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class _MarkupReader:
    """Streaming reader of one markup format: content text and complete calls (name, args, id) in order."""

    def __init__(self, markup: Markup, types: dict):
        self.m, self.types = markup, types
        self.state = "out"  # "out" | "section" | "call"
        self.in_section = False
        self.buf = ""
        self.opener = ""  # the marker that opened the current call (for a malformed call's text)
        self.scan = 0  # where to look for the current call's end (its body is searched once, not per delta)

    def feed(self, text: str, sink) -> None:
        self.buf += text
        step = {"out": self._read_out, "section": self._read_section, "call": self._read_call}
        while self.buf and step[self.state](sink, final=False):
            pass

    def finish(self, sink) -> None:
        step = {"out": self._read_out, "section": self._read_section, "call": self._read_call}
        while step[self.state](sink, final=True):
            pass

    def _read_out(self, sink, final: bool) -> bool:
        openers = self.m.section_begin + self.m.call_begin
        i, marker = first_marker(self.buf, openers)
        if i < 0:
            keep = 0 if final else partial_suffix(self.buf, openers)
            sink.text(self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        sink.text(self.buf[:i])
        sink.call_starts()
        self.in_section = marker in self.m.section_begin
        self.state = "section" if self.in_section else "call"
        self.opener, self.buf, self.scan = marker, self.buf[i + len(marker):], 0
        return True

    def _read_section(self, sink, final: bool) -> bool:
        """Between calls in a section: whitespace is dropped; other text (no call) is content, handed on
        at the next marker or the end, trimmed."""
        i, marker = first_marker(self.buf, self.m.call_begin + self.m.section_end)
        if i < 0:
            if final and self.buf.strip():
                sink.text(self.buf.strip())
            return False
        if self.buf[:i].strip():
            sink.text(self.buf[:i].strip())
        self.buf = self.buf[i + len(marker):]
        if marker in self.m.section_end:
            self.state, self.in_section = "out", False
        else:
            self.state, self.opener, self.scan = "call", marker, 0
        return True

    def _read_call(self, sink, final: bool) -> bool:
        # a call ends at its end marker; a section's end or the next call's start also ends one that lacks it
        ends = (self.m.call_end,) + self.m.section_end + self.m.call_begin
        i, marker = first_marker(self.buf, ends, self.scan)
        if i < 0 and not final:
            self.scan = max(0, len(self.buf) - max(map(len, ends)) + 1)
            return False
        body = self.buf if i < 0 else self.buf[:i]
        closed = marker == self.m.call_end
        call = self.m.read(body, self.types)
        if call is None:
            sink.bad_call(self.opener + body + (marker if closed else ""))
        else:
            sink.call(*call)
        self.buf = "" if i < 0 else self.buf[i + (len(marker) if closed else 0):]
        self.state = "section" if self.in_section else "out"
        return i >= 0


class OutputParser:
    """One choice's generated text, streamed: feed(delta) -> OutputDelta, then finish() -> OutputDelta;
    result() -> ChatOutput of everything so far. `plan` None or not parsing: no calls are read;
    `reasoning` a hybrid.server.reasoning format (None: no split); `in_reasoning`: the prompt opened the
    reasoning (reasoning.prompt_opens_reasoning)."""

    def __init__(self, plan: ToolPlan | None = None, reasoning: str | None = None, in_reasoning: bool = False,
                 make_id: Callable[[], str] = new_call_id):
        self.plan = plan if plan is not None and plan.parses else None
        fmt = self.plan.format if self.plan else None
        if fmt == "harmony":
            reasoning = "harmony"
        self.splitter = new_splitter(reasoning, in_reasoning, calls=fmt == "harmony")
        self.reader = _MarkupReader(MARKUPS[fmt], _param_types(self.plan.tools)) if fmt in MARKUPS else None
        self.make_id = make_id
        self.calls: list[ToolCall] = []
        self._reasoning: list[str] = []  # (lists: a long answer is not copied once per delta)
        self._content: list[str] = []
        self._delta = OutputDelta()
        self._held_space = ""  # whitespace at the end of the content: dropped if a call follows
        self._dropped = ""  # ... and given back if that call proves malformed
        self._after_call = False  # whitespace at the start of the content after a call is dropped
        self._finished = False

    # the reader's sink --------------------------------------------------------------------------------------
    def text(self, text: str) -> None:
        if self.reader is None:
            self._put_content(text)
            return
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body):]
        self._put_content(body)

    def call_starts(self) -> None:
        self._dropped, self._held_space = self._held_space, ""

    def bad_call(self, text: str) -> None:
        """A call that is not one (bad JSON, no name): its text is content, as the model wrote it."""
        self.text(self._dropped + text)
        self._dropped = ""

    def call(self, name: str, args: dict, model_id: str | None) -> None:
        plan = self.plan
        self._after_call, self._dropped = True, ""
        if (plan.choice == "function" and name != plan.name) or (not plan.parallel and self.calls):
            return
        call = ToolCall(model_id or self.make_id(), name, json.dumps(args, ensure_ascii=False))
        index = len(self.calls)
        self.calls.append(call)
        self._delta.tool_calls += [ToolCallDelta(index, call.id, name), ToolCallDelta(index, arguments=call.arguments)]

    def _put_content(self, text: str) -> None:
        self._content.append(text)
        self._delta.content += text

    # the stream -----------------------------------------------------------------------------------------------
    def feed(self, text: str) -> OutputDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._take(self.splitter.feed(text))
        return self._flush()

    def finish(self) -> OutputDelta:
        """The text ended (stop token, length, stop string): what was held back."""
        if not self._finished:
            self._finished = True
            self._take(self.splitter.finish())
            if self.reader is not None:
                self.reader.finish(self)
                self._put_content(self._held_space)
                self._held_space = ""
        return self._flush()

    def result(self) -> ChatOutput:
        wanted = self.plan is not None and self.plan.choice in ("required", "function")
        reasoning, content = "".join(self._reasoning), "".join(self._content)
        return ChatOutput(reasoning or None, content or None, list(self.calls),
                          missing_call=wanted and not self.calls)

    def _take(self, split) -> None:
        for kind, value in split.events:
            if kind == "reasoning":
                self._reasoning.append(value)
                self._delta.reasoning += value
            elif kind == "content":
                if self.reader is not None:
                    self.reader.feed(value, self)
                else:
                    self._put_content(value)
            else:
                self._harmony_call(*value)

    def _harmony_call(self, recipient: str, body: str) -> None:
        """A whole harmony message to functions.NAME: a call, or content if its arguments are no JSON object."""
        args, name = _object(body), recipient[len("functions."):]
        if args is None or not FUNCTION_NAME.match(name):
            self._put_content(body)
        else:
            self.call(name, args, None)

    def _flush(self) -> OutputDelta:
        out, self._delta = self._delta, OutputDelta()
        return out


def parse_output(text: str, plan: ToolPlan | None = None, reasoning: str | None = None,
                 in_reasoning: bool = False, make_id: Callable[[], str] = new_call_id) -> ChatOutput:
    """A whole choice's text -> ChatOutput (the streaming parser fed all of it)."""
    p = OutputParser(plan, reasoning, in_reasoning, make_id)
    p.feed(text)
    p.finish()
    return p.result()
