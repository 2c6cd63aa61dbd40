"""SentencePiece BPE vocabularies (tokenizer.ggml.model "llama": Llama 2, Mistral, Mixtral) as the
`tokenizers.Tokenizer` Hugging Face publishes for those models (tokenizer.json), rebuilt from the GGUF metadata:
tokenizer.ggml.tokens and .scores, no merges.

SentencePiece BPE keeps no merge list: it joins, again and again, the two adjacent pieces whose concatenation is
the best-scored piece of the vocabulary (llama.cpp's SPM tokenizer does the same). As a BPE merge list, every
split of a token into two tokens is a merge, ranked by that token's score, best first: the rule transformers'
converters use to write the published tokenizer.json files and to read GGUF files (spm_merges).

The text is prepared as SentencePiece does for these models: a "▁" prepended to each run of text (the start and
after every special token, as llama.cpp does and the published tokenizer.json's Prepend normalizer does), each
space written "▁"; characters outside the vocabulary fall back to their UTF-8 bytes (<0x00>..<0xFF> tokens).
Decoding undoes it: "▁" -> space, byte tokens -> text, one leading space dropped. tokenizer.ggml.add_space_prefix
false (a vocabulary trained without the dummy prefix) drops the prepended "▁" and the stripped space.
"""

from __future__ import annotations

from hybrid.models.errors import ModelLoadError

SPACE = "\u2581"  # SentencePiece's visible space


def spm_merges(vocab: dict[str, int], tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece vocabulary: each (left, right) pair of tokens that concatenates to a token,
    ranked by that token's score (higher first), then by longer left piece, longer right piece; equal keys keep
    the vocabulary's order (a token's own splits by the ids of their pieces)."""
    score_of: dict[str, float] = {}
    for token, score in zip(tokens, scores):
        score_of[token] = score  # a repeated token: its last score, its first place
    found = []
    for token, score in score_of.items():
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found.extend((score, left, right) for left, right in pairs)
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)  # stable: ties keep their order
    return [(left, right) for _, left, right in found]


def check_scores(scores: list, tokens: list[str], origin: str) -> list[float]:
    """tokenizer.ggml.scores: one number per token."""
    if len(scores) != len(tokens):
        raise ModelLoadError(f"{origin}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    bad = next((s for s in scores if not isinstance(s, (int, float)) or isinstance(s, bool)), None)
    if bad is not None:
        raise ModelLoadError(f"{origin}: tokenizer.ggml.scores entry {bad!r} is not a number")
    return scores


def spm_tokenizer(tokens: list[str], scores: list[float], unk: str | None, add_space_prefix: bool, origin: str):
    """The `tokenizers.Tokenizer` (model, normalizer, decoder; no added tokens) of a SentencePiece BPE
    vocabulary; unk: the unknown token (in the vocabulary) or None."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    try:
        model = models.BPE(vocab=vocab, merges=spm_merges(vocab, tokens, scores), unk_token=unk, fuse_unk=True,
                           byte_fallback=True)
    except Exception as exc:  # the tokenizers library raises bare Exceptions
        raise ModelLoadError(f"{origin}: tokenizer.ggml.tokens and .scores do not make a BPE tokenizer "
                             f"({(str(exc).splitlines() or [type(exc).__name__])[0][:200]})") from None
    tok = Tokenizer(model)
    prefix = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence(prefix + [normalizers.Replace(" ", SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()] + strip)
    return tok
