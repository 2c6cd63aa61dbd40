"""The request options that hold the output to a grammar, each compiled to one llguidance grammar.

Constrained decoding (hybrid.runtime.sampling): every sampled token keeps the text inside the grammar, and once
the grammar is complete only an end id may follow, so the choice ends there (finish_reason "stop"). The
spellings clients send, all compiled by llguidance:

- `response_format` (OpenAI's; on completions too, as vLLM takes it): `json_object` (any JSON object) or
  `json_schema` (the schema's).
- `json_schema` (llama.cpp's): a JSON schema object.
- `grammar` (llama.cpp's): a GBNF grammar (`root ::= ...`), or llguidance's Lark (one with a `start:` rule).
- vLLM's `structured_outputs` {"json" | "regex" | "choice" | "grammar" | "json_object"} (one of them), and its
  older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

A regex (Rust's regex syntax: no look-around, no back-references) must match the whole output; a choice is a
list of strings, the output exactly one of them. JSON is written compact (no free whitespace, as OpenAI's
strict mode writes it): a model that likes spaces cannot run out its max_tokens inside the object.

Each option is compiled when the request is parsed, so a bad schema, grammar or regex is a 400 naming its
parameter before the request is queued; a request holds one constraint at most (a second one is a 400
naming it). `check_for_model` then checks the grammar against the served model's vocabulary (the special
tokens a grammar may name). On a reasoning model's chat the grammar then holds the answer after its reasoning
(hybrid.server.reasoned_grammar).
"""

from __future__ import annotations

import json
import re

from hybrid.server.errors import bad_request

MAX_GRAMMAR_CHARS = 1 << 16  # a schema's JSON text, a grammar or a regex at most (compiling one is work per request)
MAX_CHOICES = 1024
# vLLM's structured_outputs keys that constrain the output (one of them per request)
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
COMPACT_JSON = {"whitespace_flexible": False}
_ECHO = re.compile(r"\d+ \|.*|\^+")  # the source line an llguidance error quotes, and its marks


def _matcher():
    from llguidance import LLMatcher  # (imported on first use: the server starts without paying for it)

    return LLMatcher


def _sized(text: str, param: str) -> str:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"'{param}' has {len(text)} characters; at most {MAX_GRAMMAR_CHARS}", param=param)
    return text


def _one_line(message: str) -> str:
    """llguidance's error on one line: its own lines joined, without the echo of the source under it
    (`  1 | start: ...` and the `^` marks)."""
    lines = [ln.strip() for ln in message.splitlines()]
    return " ".join(ln for ln in lines if ln and not _ECHO.match(ln))[:300]


def _checked(grammar: str, param: str, what: str, vocab=None) -> str:
    """The grammar, or a 400 naming `param` with llguidance's error (warnings pass: without a vocabulary,
    llguidance cannot check the special tokens a grammar names)."""
    is_error, messages = _matcher().validate_grammar_with_warnings(grammar, vocab)
    if is_error:
        raise bad_request(f"'{param}': the {what} cannot be used: {_one_line(messages[0])}", param=param)
    return grammar


def json_grammar(schema, param: str) -> str:
    """A JSON schema (an object, or its JSON text) -> the grammar of compact JSON that follows it."""
    if isinstance(schema, str):
        try:
            schema = json.loads(_sized(schema, param))
        except ValueError:
            raise bad_request(f"'{param}' must be a JSON schema (an object, or its JSON text)", param=param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"'{param}' must be a JSON schema object", param=param)
    _sized(json.dumps(schema), param)
    grammar = _matcher().grammar_from_json_schema(schema, overrides=COMPACT_JSON)
    return _checked(grammar, param, "schema")


def regex_grammar(regex, param: str) -> str:
    """A regex the whole output must match."""
    if not isinstance(regex, str):
        raise bad_request(f"'{param}' must be a regular expression (a string)", param=param)
    return _checked(_matcher().grammar_from_regex(_sized(regex, param)), param, "regex")


def choice_grammar(choices, param: str) -> str:
    """A list of strings: the output is one of them, exactly (an alternation of their literals)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise bad_request(f"'{param}' must be a non-empty list of strings", param=param)
    if len(choices) > MAX_CHOICES:
        raise bad_request(f"'{param}' has {len(choices)} strings; at most {MAX_CHOICES}", param=param)
    lark = "start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
    return _checked(_matcher().grammar_from_lark(_sized(lark, param)), param, "choice")


def text_grammar(text, param: str) -> str:
    """A GBNF grammar (llama.cpp's, `root ::= ...`) or llguidance's Lark (a `start:` rule or `%llguidance`)."""
    import llguidance

    if not isinstance(text, str) or not text.strip():
        raise bad_request(f"'{param}' must be a grammar (GBNF with a root rule, or Lark with a start rule)",
                          param=param)
    try:
        grammar = llguidance.grammar_from("grammar", _sized(text, param))
    except ValueError as exc:
        raise bad_request(f"'{param}': the grammar cannot be read: {_one_line(str(exc))}", param=param) from None
    return _checked(grammar, param, "grammar")


def _response_format(rf, param: str) -> str | None:
    """OpenAI's response_format -> a grammar (None for text)."""
    if rf is None or rf == {"type": "text"}:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("response_format must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                          param=param)
    if rf["type"] == "json_object":
        return json_grammar({"type": "object"}, param)
    if rf["type"] == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                              param=param)
        return json_grammar(schema, param)
    return None


def _structured(spec, param: str) -> str | None:
    """vLLM's structured_outputs object -> the grammar of its one constraint (None: none set)."""
    if not isinstance(spec, dict):
        raise bad_request(f"'{param}' must be an object with one of {', '.join(STRUCTURED_KEYS)}", param=param)
    for key, v in spec.items():
        if key not in STRUCTURED_KEYS and v not in (None, False):
            raise bad_request(f"'{param}.{key}' is not supported; only {', '.join(STRUCTURED_KEYS)}", param=param,
                              code="unsupported_parameter")
    set_ = [k for k in STRUCTURED_KEYS if spec.get(k) not in (None, False)]
    if len(set_) > 1:
        raise bad_request(f"'{param}' sets {set_[0]} and {set_[1]}; send one of them", param=param)
    if not set_:
        return None
    key = set_[0]
    if key == "json_object":
        if spec[key] is not True:
            raise bad_request(f"'{param}.json_object' must be true or false", param=param)
        return json_grammar({"type": "object"}, param)
    return BUILDERS[key](spec[key], param)


BUILDERS = {"json": json_grammar, "regex": regex_grammar, "choice": choice_grammar, "grammar": text_grammar}
# request key -> its grammar (None: the option is off)
COMPILERS = {
    "response_format": _response_format, "json_schema": json_grammar, "grammar": text_grammar,
    "guided_json": json_grammar, "guided_regex": regex_grammar, "guided_choice": choice_grammar,
    "guided_grammar": text_grammar, "structured_outputs": _structured,
}


def request_grammar(body: dict) -> tuple[str, str] | None:
    """The request's one constraint -> (its parameter, its llguidance grammar), or None. 400 naming the option
    that cannot be compiled, or the second of two options set. (The endpoint's keys are checked before.)"""
    found = None
    for name, v in body.items():  # the body's order: the second one set is the one named
        if name not in COMPILERS or v is None:
            continue
        grammar = COMPILERS[name](v, name)
        if grammar is None:
            continue
        if found is not None:
            raise bad_request(f"'{found[0]}' and '{name}' both constrain the output; send one of them", param=name)
        found = (name, grammar)
    return found


def check_for_model(runtime, grammar: str, param: str) -> None:
    """400 naming `param` where the served model cannot hold its output to `grammar`: a tokenizer llguidance cannot
    read, or special tokens (`<[id]>`, `<|name|>`) its vocabulary lacks. Builds the llguidance tokenizer on first
    use (seconds for a large vocabulary): a worker thread's job."""
    try:
        vocab = runtime.sampling.grammar_vocab()
    except ValueError as exc:
        raise bad_request(f"'{param}' cannot be served by this model: {exc}", param=param) from None
    _checked(grammar, param, "constraint (with this model's vocabulary)", vocab)
