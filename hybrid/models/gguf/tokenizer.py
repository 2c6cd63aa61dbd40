"""The tokenizer a GGUF file carries (tokenizer.* metadata) as a `tokenizers.Tokenizer` plus a
tokenizer_config-like dict, and write_tokenizer_files, which saves both where hybrid.runtime.tokenizer.Tokenizer
reads them (tokenizer.json, tokenizer_config.json).

Supported: tokenizer.ggml.model "llama" (SentencePiece BPE: Llama 2, Mistral, Mixtral; tokens, .scores and
.token_type, byte-fallback tokens; rebuilt by the spm module as the published tokenizer.json has it, BOS added
unless tokenizer.ggml.add_bos_token says otherwise), and "gpt2" (byte-level BPE: tokenizer.ggml.tokens in id
order, .merges as "a b" strings, .token_type) with these tokenizer.ggml.pre values, each rebuilt as the Hugging
Face tokenizer.json of the models that use it publishes it (the regexes are the ones llama.cpp's llama-vocab.cpp
quotes as "original regex from tokenizer.json"; Kimi-K2's is the tiktoken pat_str of its tokenization_kimi.py):

    qwen2, deepseek-r1-qwen     Qwen2 / Qwen3 (split on letters, single digits; NFC-normalised)
    llama-bpe, llama3, llama-v3 Llama 3 (digits in groups of up to three; whole words in the vocabulary kept)
    glm4, chatglm-bpe           GLM-4 / GLM-4.5 (Llama 3's split)
    deepseek-v3                 DeepSeek-V3 / R1 (digits, CJK runs, then words and punctuation)
    kimi-k2                     Kimi-K2 (Han runs, then o200k-like words without Han; whole words kept)
    gpt-4o                      gpt-oss (o200k: case-aware word split)
    gpt-2                       GPT-2's byte-level split

Anything else (other models such as "t5", other pre-tokenizers) is refused in one line. Token types: CONTROL
tokens (and a SentencePiece vocabulary's UNKNOWN one, as llama.cpp matches it) become special added tokens
(matched whole in text, skipped when decoding with skip_special_tokens), USER_DEFINED tokens plain added tokens
(matched whole, kept when decoding).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybrid.models.errors import ModelLoadError

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # gguf.TokenType
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
DEEPSEEK3 = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
             r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
             r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Oniguruma (the tokenizers library's regex engine) reads the class intersections `&&` as tiktoken's Rust
# regex does: letters and marks other than Han.
KIMI_K2 = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])


class Pre:
    """A pre-tokenizer: regexes split in order (None: GPT-2's own byte-level regex), NFC normalisation, whether
    a word found whole in the vocabulary skips the merges (ignore_merges), whether a BOS is added by default."""

    def __init__(self, splits: tuple[str, ...] | None, nfc: bool = False, ignore_merges: bool = False,
                 add_bos: bool = False):
        self.splits, self.nfc, self.ignore_merges, self.add_bos = splits, nfc, ignore_merges, add_bos


_QWEN2, _LLAMA3 = Pre((QWEN2,), nfc=True), Pre((LLAMA3,), ignore_merges=True, add_bos=True)
PRE_TOKENIZERS = {
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3,
    "glm4": Pre((LLAMA3,)), "chatglm-bpe": Pre((LLAMA3,)),
    "deepseek-v3": Pre(DEEPSEEK3),
    "kimi-k2": Pre((KIMI_K2,), ignore_merges=True),  # tiktoken takes a piece found whole in the vocabulary
    "gpt-4o": Pre((GPT4O,)),
    "gpt-2": Pre(None),
}


def _key(metadata: dict, key: str, origin: str, kind: type | tuple, required: bool = False):
    value = metadata.get(key)
    if value is None:
        if required:
            raise ModelLoadError(f"{origin}: no tokenizer: missing metadata key {key!r}")
        return None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise ModelLoadError(f"{origin}: metadata key {key!r} has a wrong type ({type(value).__name__})")
    return value


def _merges(merges: list, origin: str) -> list[tuple[str, str]]:
    """'a b' strings -> pairs, split at the first space after the first character (llama.cpp's rule)."""
    out = []
    for m in merges:
        cut = m.find(" ", 1) if isinstance(m, str) else -1
        if cut < 0:
            raise ModelLoadError(f"{origin}: tokenizer.ggml.merges entry {m!r} is not two tokens separated by a space")
        out.append((m[:cut], m[cut + 1:]))
    return out


def _pre_tokenizer(pre: Pre):
    from tokenizers import Regex, pre_tokenizers

    if pre.splits is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])


def _template(bos: tuple[str, int] | None, eos: tuple[str, int] | None):
    """The post-processor adding BOS before / EOS after a sequence (add_bos_token / add_eos_token)."""
    from tokenizers import processors

    specials = [t for t in (bos, eos) if t is not None]
    if not specials:
        return None

    def sequence(var: str, type_id: int) -> str:
        head, tail = [f"{bos[0]}:{type_id}"] if bos else [], [f"{eos[0]}:{type_id}"] if eos else []
        return " ".join(head + [f"${var}:{type_id}"] + tail)

    return processors.TemplateProcessing(single=sequence("A", 0), pair=f"{sequence('A', 0)} {sequence('B', 1)}",
                                         special_tokens=specials)


def _byte_level(tokens: list[str], merges: list[tuple[str, str]], pre: Pre, origin: str):
    """The byte-level BPE of a "gpt2" vocabulary under the pre-tokenizer `pre` (no added tokens yet)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    try:
        model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges, fuse_unk=False,
                           byte_fallback=False)
    except Exception as exc:  # the tokenizers library raises bare Exceptions (a merge of an unknown token)
        raise ModelLoadError(f"{origin}: tokenizer.ggml.merges and .tokens do not make a BPE tokenizer "
                             f"({(str(exc).splitlines() or [type(exc).__name__])[0][:200]})") from None
    tok = Tokenizer(model)
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _add_tokens(tok, tokens: list[str], types: list[int] | None, special: tuple[int, ...]) -> None:
    """Tokens of the types in `special` as special added tokens, USER_DEFINED ones as plain added tokens."""
    from tokenizers import AddedToken

    types = types or []
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, ty in enumerate(types) if ty in special])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, ty in enumerate(types) if ty == USER_DEFINED])


def _sentencepiece(metadata: dict, tokens: list[str], origin: str):
    """The tokenizer of a "llama" (SentencePiece BPE) vocabulary: hybrid.models.gguf.spm."""
    from hybrid.models.gguf.spm import check_scores, spm_tokenizer

    scores = check_scores(_key(metadata, "tokenizer.ggml.scores", origin, list, required=True), tokens, origin)
    unk = _token(tokens, metadata, "unknown", origin)
    if unk is None and "<unk>" in tokens:
        unk = "<unk>"
    prefix = _key(metadata, "tokenizer.ggml.add_space_prefix", origin, bool)
    return spm_tokenizer(tokens, scores, unk, prefix is not False, origin)


def _special(tokens: list[str], metadata: dict, which: str, origin: str) -> tuple[str, int] | None:
    """(text, id) of tokenizer.ggml.<which>_token_id, or None."""
    i = _key(metadata, f"tokenizer.ggml.{which}_token_id", origin, int)
    if i is None:
        return None
    if not 0 <= i < len(tokens):
        raise ModelLoadError(f"{origin}: tokenizer.ggml.{which}_token_id {i} is outside the vocabulary "
                             f"({len(tokens)} tokens)")
    return tokens[i], i


def _token(tokens: list[str], metadata: dict, which: str, origin: str) -> str | None:
    special = _special(tokens, metadata, which, origin)
    return None if special is None else special[0]


def tokenizer_from_metadata(metadata: dict[str, Any], origin: str = "GGUF file"):
    """(tokenizers.Tokenizer, tokenizer_config dict) of the tokenizer in a GGUF file's metadata; see the module
    docstring for what is supported. The config has chat_template, bos_token, eos_token, pad_token, unk_token,
    add_bos_token and add_eos_token, as a tokenizer_config.json would."""
    model = _key(metadata, "tokenizer.ggml.model", origin, str, required=True)
    if model not in ("gpt2", "llama"):
        raise ModelLoadError(f"{origin}: tokenizer.ggml.model {model!r} is not supported (supported: gpt2, "
                             "byte-level BPE; llama, SentencePiece BPE)")
    pre = None
    if model == "gpt2":
        pre_name = _key(metadata, "tokenizer.ggml.pre", origin, str) or "default"
        if pre_name not in PRE_TOKENIZERS:
            raise ModelLoadError(f"{origin}: tokenizer.ggml.pre {pre_name!r} is not supported (supported: "
                                 f"{', '.join(PRE_TOKENIZERS)})")
        pre = PRE_TOKENIZERS[pre_name]
    tokens = _key(metadata, "tokenizer.ggml.tokens", origin, list, required=True)
    types = _key(metadata, "tokenizer.ggml.token_type", origin, list)
    if types is not None and len(types) != len(tokens):
        raise ModelLoadError(f"{origin}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    if pre is None:  # SentencePiece: llama.cpp and transformers add BOS unless the file says otherwise
        tok, special, default_bos = _sentencepiece(metadata, tokens, origin), (CONTROL, UNKNOWN), True
    else:
        merges = _merges(_key(metadata, "tokenizer.ggml.merges", origin, list, required=True), origin)
        tok, special, default_bos = _byte_level(tokens, merges, pre, origin), (CONTROL,), pre.add_bos
    _add_tokens(tok, tokens, types, special)
    add_bos = _key(metadata, "tokenizer.ggml.add_bos_token", origin, bool)
    add_bos = default_bos if add_bos is None else add_bos
    add_eos = bool(_key(metadata, "tokenizer.ggml.add_eos_token", origin, bool))
    bos, eos = _special(tokens, metadata, "bos", origin), _special(tokens, metadata, "eos", origin)
    template = _template(bos if add_bos else None, eos if add_eos else None)
    if template is not None:
        tok.post_processor = template
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": _key(metadata, "tokenizer.chat_template", origin, str),
        "bos_token": None if bos is None else bos[0],
        "eos_token": None if eos is None else eos[0],
        "pad_token": _token(tokens, metadata, "padding", origin),
        "unk_token": _token(tokens, metadata, "unknown", origin),
        "add_bos_token": bool(add_bos),
        "add_eos_token": add_eos,
    }
    return tok, config


def write_tokenizer_files(ckpt, out_dir: str | Path) -> Path:
    """Writes tokenizer.json and tokenizer_config.json of `ckpt`'s (a GgufCheckpoint's) tokenizer into
    `out_dir` (created if needed), for hybrid.runtime.tokenizer.Tokenizer(out_dir); returns out_dir."""
    out = Path(out_dir)
    tok, config = tokenizer_from_metadata(ckpt.metadata, str(ckpt.path))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))
    return out
