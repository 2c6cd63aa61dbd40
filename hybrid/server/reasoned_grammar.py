"""A request's constraint (response_format, json_schema, grammar, guided_*, structured_outputs) held to the answer of a
reasoning model, not to its reasoning.

A reasoning model writes its thinking first: a "think" model `<think>...</think>` and then the answer (or only the end
of the block where the prompt opened it; nothing where the prompt closed it, as templates do when thinking is off),
a harmony model (gpt-oss) an analysis message and then its final one. A constraint applied from the first token
would force the answer into the reasoning's place: JSON where the model thinks, no thinking at all, and a parser
that reads the JSON as reasoning_content with an empty content. So the grammar is wrapped: the reasoning stays free
text (as the model writes it, its markers as the special tokens they are), and the request's own grammar holds what
follows, which hybrid.server.tool_calls then reads as the content. vLLM's structured outputs do the same with their
reasoning parsers (the constraint starts where the reasoning ends).

The wrap is llguidance's: one top-level grammar whose first grammar is the Lark wrapper, referring to the request's
grammar (kept as compiled, JSON schema, regex, Lark or GBNF alike) by name with `@name`. A model whose markers its
tokenizer can neither emit as a token nor spell as text keeps the plain constraint (logged once).
"""

from __future__ import annotations

import json
import logging

from hybrid.server.tool_grammar import _Lark, _special_token, _unspellable, thinking_state

log = logging.getLogger("hybrid.server")
INNER = "answer"  # the name the request's grammar gets inside the wrap
_logged: set[str] = set()


def grammar_list(grammar: str) -> list[dict]:
    """A compiled grammar's grammars (llguidance's top-level JSON, or a plain Lark / GBNF text: one grammar)."""
    text = grammar.lstrip()
    if text.startswith("{"):
        return [dict(g) for g in json.loads(text)["grammars"]]
    return [{"lark_grammar": grammar}]


def reasoning_prefix(g: _Lark, reasoning: str, thinking: str) -> str | None:
    """The Lark of the free reasoning before the answer, or None where none comes (a closed think block)."""
    if reasoning == "harmony":
        analysis = g.rule(f'{g.marker("<|channel|>")} "analysis" {g.marker("<|message|>")} {g.upto("<|end|>")} '
                          f'{g.marker("<|start|>")} "assistant"')
        return f'({analysis})? {g.marker("<|channel|>")} "final" {g.marker("<|message|>")}'
    if thinking == "open":
        return f'{g.upto("</think>")} /\\n{{0,2}}/'
    if thinking == "free":
        return f'({g.marker("<think>")} {g.upto("</think>")} /\\n{{0,2}}/)?'
    return None


def wrap(grammar: str, prefix_lark: str, rules: list[str]) -> str:
    """llguidance's top-level grammar: `start: PREFIX @answer` (rules: the wrapper's other Lark rules), then the
    request's grammars, its first one named `answer`."""
    inner = grammar_list(grammar)
    inner[0] = {**inner[0], "name": INNER}
    lark = "\n".join([f"start: {prefix_lark} @{INNER}", *rules])
    return json.dumps({"grammars": [{"name": "reasoned", "lark_grammar": lark}, *inner]})


def after_reasoning(runtime, grammar: str, reasoning: str | None, opened: bool, prompt: list[int]) -> str:
    """The request's grammar held to the answer of this reasoning model (module doc); unchanged for a model without
    reasoning, a prompt that closed the think block, or markers the tokenizer cannot write. Builds the llguidance
    tokenizer on first use: a worker thread's job."""
    if reasoning not in ("think", "harmony"):
        return grammar
    from llguidance import LLMatcher

    tail = runtime.decode(prompt[-16:], skip_special_tokens=False) if reasoning == "think" else ""
    ll_tokenizer = runtime.sampling.grammar_vocab()
    g = _Lark(_special_token(runtime, ll_tokenizer))
    prefix = reasoning_prefix(g, reasoning, thinking_state(reasoning, opened, tail))
    if prefix is None:
        return grammar
    missing = _unspellable(runtime, g.texts)
    if missing:
        if reasoning not in _logged:
            _logged.add(reasoning)
            log.warning("the constraint holds this model's whole output, reasoning included: its tokenizer cannot "
                        "write %r", missing[0])
        return grammar
    out = wrap(grammar, prefix, g.rules)
    error = LLMatcher.validate_grammar(out, ll_tokenizer)
    if error:  # the request's grammar was checked alone; the wrap adds only the markers above
        raise ValueError(f"the constraint cannot follow this model's reasoning: {error.splitlines()[0][:300]}")
    return out
