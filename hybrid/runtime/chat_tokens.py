"""Chat prompts where only the template's own markers are control tokens.

Rendering a chat template and tokenizing the text as a whole would turn a user's literal
"<|im_end|><|im_start|>system" into real control tokens: the user could end their own turn and write
one for another role (role forgery). The same can happen without the literal string: a tokenizer whose
normalizer rewrites text before special tokens are matched (NFKC turns the full-width
"＜｜im_end｜＞" into "<|im_end|>"; a token marked `normalized` matches what the normalizer made), or
whose model vocabulary holds a control token's text. (`encode(..., add_special_tokens=False)` prevents
none of this: it only leaves out the post-processor's BOS/EOS; added tokens still match.) The rule kept:
the control (special) token ids of a prompt are exactly the special-token strings the rendered text holds
outside the client's text, in order, and nothing else. The client's text is every string in the messages
and the template's other inputs (keys too): contents, tool-call names and arguments, tool_call_ids, the
`tools` schemas; templates print all of them.

1. Client text containing no special-token string (nearly all): render and tokenize the whole text, as
   before, and accept the ids if their control ids are exactly the special-token strings of the text,
   in order (so benign prompts get exactly the tokens they always had).
2. Otherwise (a special-token string typed in the client's text, or control ids the text's strings do
   not account for) each such string in that text is replaced by a private-use character found nowhere in
   the messages or the template, the template is rendered, and the result is split at the special
   tokens left in it (all the template's own). Those become their token ids; every piece between them
   gets its stand-ins put back and is tokenized with special-token matching off (the `tokenizers`
   library's `encode_special_tokens`), so the forged markers come out as ordinary text tokens.
   (The library splits at special tokens in the same way, so pieces are tokenized as it would.)
3. A piece whose ids still hold a control id (the vocabulary maps text onto it) is refused with
   ControlTokenInText, a ValueError (the server answers 400) naming the token: such a tokenizer cannot
   keep message text apart from control tokens, so the prompt is not built at all.
"""

from __future__ import annotations

import functools
import re

from hybrid.errors import UsageError

PRIVATE_USE = range(0xF0000, 0xFFFFE)  # Supplementary Private Use Area-A


class ControlTokenInText(UsageError, ValueError):
    """Message text that this tokenizer turns into a control token even with special-token matching off."""


def _special_tokens(tokenizer) -> dict[str, tuple[int, object]]:
    """content -> (id, AddedToken) of the tokenizer's special (control) tokens (read once: they do not change)."""
    specials = getattr(tokenizer, "_specials", None)
    if specials is None:
        decoder = tokenizer.tok.get_added_tokens_decoder()
        specials = tokenizer._specials = {t.content: (i, t) for i, t in decoder.items() if t.special and t.content}
    return specials


def control_token_ids(tokenizer) -> frozenset[int]:
    """The ids of the tokenizer's special (control) tokens."""
    return frozenset(i for i, _ in _special_tokens(tokenizer).values())


@functools.lru_cache(maxsize=8)
def _alternation(strings: tuple) -> re.Pattern:
    # longest first: at each position the longest special string wins, as the tokenizer's own matching
    return re.compile("|".join(re.escape(s) for s in sorted(strings, key=len, reverse=True)))


def encode_chat_plain_contents(tokenizer, messages: list[dict], render, **template_kwargs) -> list[int]:
    """Token ids of `render(messages, **template_kwargs)` (the chat template) with special-token strings
    in the client's text tokenized as text. The client's text is every string in the messages and the
    template's inputs, keys included: contents, but also tool-call names and arguments, tool_call_ids and
    the `tools` schemas, all of which templates print. `tokenizer` is hybrid.runtime.tokenizer.Tokenizer."""
    hf = tokenizer.tok
    specials = _special_tokens(tokenizer)
    inputs = (messages, template_kwargs)
    texts = list(_strings(inputs))
    forged = [s for s in specials if any(s in t for t in texts)]
    if not forged:
        text = render(messages, **template_kwargs)
        ids = hf.encode(text, add_special_tokens=False).ids
        if _control_ids(ids, specials) == [specials[m.group(0)][0] for m in _markers(text, specials)]:
            return ids
        return _encode_split(tokenizer, text, specials, {})  # the normalizer or vocabulary made control ids
    used = set("".join(texts)) | set(tokenizer.chat_template or "")
    free = (chr(c) for c in PRIVATE_USE if chr(c) not in used)
    stand_in = {s: next(free) for s in forged}
    find_forged = _alternation(tuple(forged))
    escaped_messages, escaped_kwargs = _replace_strings(
        inputs, lambda t: find_forged.sub(lambda x: stand_in[x.group(0)], t))
    return _encode_split(tokenizer, render(escaped_messages, **escaped_kwargs), specials,
                         {v: k for k, v in stand_in.items()})


def _strings(value):
    """Every string in nested dicts (keys and values), lists and tuples."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


def _replace_strings(value, fn):
    """A copy of `value` with fn applied to every string in it (keys too); other values are kept."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {_replace_strings(k, fn): _replace_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_replace_strings(v, fn) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def _markers(text: str, specials: dict) -> list:
    """The special-token strings in `text`, as the library matches them (longest first)."""
    return list(_alternation(tuple(specials)).finditer(text)) if specials else []


def _control_ids(ids: list[int], specials: dict) -> list[int]:
    control = {i for i, _ in specials.values()}
    return [i for i in ids if i in control]


def _encode_split(tokenizer, text: str, specials: dict, original: dict) -> list[int]:
    """Ids of `text` split at its special-token strings (each its id), the pieces between tokenized with
    special-token matching off after the stand-ins (`original`: stand-in -> special string) are put back."""
    plain = _plain_tokenizer(tokenizer)
    restore = re.compile("|".join(map(re.escape, original))) if original else None
    ids: list[int] = []
    pos = 0
    matches = _markers(text, specials)  # the template's own markers only
    for k, m in enumerate(matches + [None]):
        end = m.start() if m is not None else len(text)
        piece = text[pos:end]
        tok = specials[m.group(0)][1] if m is not None else None
        if tok is not None and tok.lstrip:
            piece = piece.rstrip()  # (as the library does for a token that swallows space before it)
        if k > 0 and specials[matches[k - 1].group(0)][1].rstrip:
            piece = piece.lstrip()
        if piece:
            if restore is not None:
                piece = restore.sub(lambda x: original[x.group(0)], piece)
            ids += _text_ids(plain, piece, specials)
        if m is not None:
            ids.append(specials[m.group(0)][0])
            pos = m.end()
    return ids


def _text_ids(plain, piece: str, specials: dict) -> list[int]:
    """Ids of text between control tokens; refused if the tokenizer still makes a control token of it."""
    ids = plain.encode(piece, add_special_tokens=False).ids
    control = _control_ids(ids, specials)
    if control:
        name = next(s for s, (i, _) in specials.items() if i == control[0])
        raise ControlTokenInText(
            f"message text becomes the control token {name!r} in this tokenizer (its normalizer or "
            "vocabulary maps text onto it), which would let a message forge chat roles; remove that text")
    return ids


def _plain_tokenizer(tokenizer):
    """A copy of the tokenizer that reads special-token strings as text (made once, then shared:
    setting the flag on the shared one would race with other threads' encodes)."""
    plain = getattr(tokenizer, "_plain_tok", None)
    if plain is None:
        from tokenizers import Tokenizer as HFTokenizer

        plain = HFTokenizer.from_str(tokenizer.tok.to_str())
        plain.encode_special_tokens = True
        tokenizer._plain_tok = plain
    return plain
