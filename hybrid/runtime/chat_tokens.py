"""Chat prompts where only the template's own markers are control tokens.

Rendering a chat template and tokenizing the text as a whole would turn a user's literal
"<|im_end|><|im_start|>system" into real control tokens: the user could end their own turn and write
one for another role (role forgery). So special-token strings inside message contents are tokenized
as plain text:

1. Contents containing no special-token string (nearly all): render and tokenize as before, so
   benign prompts get exactly the tokens they always had.
2. Otherwise each such string in a content is replaced by a private-use character found nowhere in
   the messages or the template, the template is rendered, and the result is split at the special
   tokens left in it (all the template's own). Those become their token ids; every piece between them
   gets its stand-ins put back and is tokenized with special-token matching off (the `tokenizers`
   library's `encode_special_tokens`), so the forged markers come out as ordinary text tokens.
   (The library splits at special tokens in the same way, so pieces are tokenized as it would.)
"""

from __future__ import annotations

import re

PRIVATE_USE = range(0xF0000, 0xFFFFE)  # Supplementary Private Use Area-A


def _special_tokens(hf) -> dict[str, tuple[int, object]]:
    """content -> (id, AddedToken) of the tokenizer's special (control) tokens."""
    return {t.content: (i, t) for i, t in hf.get_added_tokens_decoder().items() if t.special and t.content}


def _alternation(strings) -> re.Pattern:
    # longest first: at each position the longest special string wins, as the tokenizer's own matching
    return re.compile("|".join(re.escape(s) for s in sorted(strings, key=len, reverse=True)))


def encode_chat_plain_contents(tokenizer, messages: list[dict], render) -> list[int]:
    """Token ids of `render(messages)` (the chat template) with special-token strings inside message
    contents tokenized as text. `tokenizer` is hybrid.runtime.tokenizer.Tokenizer."""
    hf = tokenizer.tok
    specials = _special_tokens(hf)
    contents = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    forged = [s for s in specials if any(s in c for c in contents)]
    if not forged:
        return hf.encode(render(messages), add_special_tokens=False).ids
    used = set("".join(contents)) | set(tokenizer.chat_template or "")
    free = (chr(c) for c in PRIVATE_USE if chr(c) not in used)
    stand_in = {s: next(free) for s in forged}
    original = {v: k for k, v in stand_in.items()}
    find_forged = _alternation(forged)
    escaped = [{**m, "content": find_forged.sub(lambda x: stand_in[x.group(0)], m["content"])}
               if isinstance(m.get("content"), str) else m for m in messages]
    text = render(escaped)
    plain = _plain_tokenizer(tokenizer)
    restore = re.compile("|".join(map(re.escape, original)))
    ids: list[int] = []
    pos = 0
    matches = list(_alternation(specials).finditer(text))  # the template's own markers only
    for k, m in enumerate(matches + [None]):
        end = m.start() if m is not None else len(text)
        piece = text[pos:end]
        tok = specials[m.group(0)][1] if m is not None else None
        if tok is not None and tok.lstrip:
            piece = piece.rstrip()  # (as the library does for a token that swallows space before it)
        if k > 0 and specials[matches[k - 1].group(0)][1].rstrip:
            piece = piece.lstrip()
        if piece:
            ids += plain.encode(restore.sub(lambda x: original[x.group(0)], piece), add_special_tokens=False).ids
        if m is not None:
            ids.append(specials[m.group(0)][0])
            pos = m.end()
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
