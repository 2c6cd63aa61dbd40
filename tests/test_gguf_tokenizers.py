"""GGUF tokenizers beyond the byte-level presets of tests/test_gguf.py.

SentencePiece "llama" vocabularies (Mixtral's): a vocabulary trained here with the SentencePiece conventions
(<unk>/<s>/</s>, the 256 byte tokens, "▁" pieces scored by merge order) is written to a GGUF file with gguf-py's
writer and read back; ids are compared with transformers' own GGUF tokenizer loading and with SentencePiece BPE
as llama.cpp runs it (written below: join the best-scored adjacent pair, then fall back to bytes). transformers'
"llama" builder uses a Metaspace pre-tokenizer that prepends "▁" only at the very start of the text and not to
text that starts with a space (its " hi" is "▁hi", SentencePiece's and the published tokenizer.json's is
"▁▁hi"); its "phi3" builder has the published normalizer, so that one is compared on every text and the "llama"
one on texts where the two agree.

Kimi-K2 ("kimi-k2" pre): the split is compared with the `regex` module's (V1: class intersection) findall of the
tiktoken pat_str, the byte-level BPE with tiktoken's algorithm (written below) over ranks trained here, the
file's merges recovered from them as llama.cpp's converter does.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
regex = pytest.importorskip("regex")

from hybrid.models.errors import ModelLoadError  # noqa: E402
from hybrid.models.gguf import tokenizer_from_metadata  # noqa: E402
from hybrid.models.gguf.files import read_files  # noqa: E402

SP = "\u2581"
CORPUS = ["The quick brown fox jumps over the lazy dog. It's 2024; we've 12345 apples & 67 pears!",
          "  Indented   text\twith tabs\nand new lines\r\n\n  The CamelCase HTTPServer isn't they'll.",
          "[INST] hello there [/INST] general kenobi, you are a bold one"] * 8
SPM_TEXTS = ["hello there general kenobi", "The lazy dog's 12345 apples", " leading space", "  two leading spaces",
             "several   spaces   inside  ", "new\nlines\n\n and\ttabs\r\n", "unicode 数学 café 🙂 naïve ÿ",
             "digits 12345 67 3.14159", "<s>[INST] hello there [/INST]", "a</s>b", "</s>", "", " ",
             f"{SP} a visible space", "qzx zqzx"]
TIES = ["zx", "qz"]  # two tokens of one score: ranked in vocabulary order (transformers' rule)
_SPM: list = []


def spm_vocabulary():
    """(tokens, scores, types) as a Llama 2 / Mistral GGUF holds them: <unk>, <s>, </s>, <0x00>..<0xFF>, then
    pieces scored by merge order (the first merge best), plus TIES."""
    from tokenizers import SentencePieceBPETokenizer

    if not _SPM:
        trainer = SentencePieceBPETokenizer()
        trainer.train_from_iterator(CORPUS, vocab_size=400, min_frequency=2, show_progress=False)
        head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
        trained = [t for t, _ in sorted(json.loads(trainer.to_str())["model"]["vocab"].items(), key=lambda kv: kv[1])
                   if t not in head]  # the trainer's own <unk>
        pieces = trained + [t for t in TIES if t not in trained]
        tokens = head + pieces
        scores = [0.0] * 259 + [-float(i) for i in range(len(trained))] + [-float(len(trained))] * len(TIES)
        types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
        _SPM.append((tokens, scores, types))
    return _SPM[0]


def add_spm_tokenizer(w) -> None:
    """The SentencePiece vocabulary's tokenizer.ggml keys, into GGUF writer w."""
    tokens, scores, types = spm_vocabulary()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def write_spm_gguf(path, arch: str = "llama", **extra):
    """A GGUF file (no tensors) with the SentencePiece vocabulary; extra: more tokenizer.ggml keys."""
    w = gguf.GGUFWriter(str(path), arch)
    add_spm_tokenizer(w)
    for key, value in extra.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def spm_reference(text: str, prefix: bool = True) -> list[int]:
    """SentencePiece BPE as llama.cpp runs it (BOS not added): special tokens (control, unknown) matched whole,
    "▁" before each run of text (unless not prefix), spaces as "▁", the best-scored adjacent pair joined first
    (the leftmost of equals), pieces outside the vocabulary as their bytes."""
    tokens, scores, types = spm_vocabulary()
    vocab, score = {t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores))
    specials = sorted((t for t, ty in zip(tokens, types) if ty in (2, 3)), key=len, reverse=True)
    out: list[int] = []
    for run in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
        if run in specials:
            out.append(vocab[run])
            continue
        if not run:
            continue
        syms = list((" " * prefix + run).replace(" ", SP))
        while True:
            pairs = [(score[a + b], -i) for i, (a, b) in enumerate(zip(syms, syms[1:])) if a + b in vocab]
            if not pairs:
                break
            i = -max(pairs)[1]
            syms[i:i + 2] = [syms[i] + syms[i + 1]]
        for s in syms:
            out.extend([vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()])
    return out


def hf_gguf_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_spm_merges_are_transformers_rule():
    """Every split of a token into two tokens, ranked by the token's score, longer left piece first, vocabulary
    order among equals: transformers' generate_merges on the same vocabulary."""
    from transformers.tokenization_utils_base import generate_merges

    from hybrid.models.gguf.spm import spm_merges

    small = ["a", "b", "c", "ab", "bc", "abc"]
    vocab = {t: i for i, t in enumerate(small)}
    assert spm_merges(vocab, small, [0, 0, 0, -1, -1, -2]) == [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]
    tokens, scores, _ = spm_vocabulary()
    vocab = {t: i for i, t in enumerate(tokens)}
    assert spm_merges(vocab, tokens, scores) == generate_merges(vocab, dict(zip(tokens, scores)))


def test_sentencepiece_gguf_encodes_as_transformers_and_llama_cpp(tmp_path):
    llama_file, phi_file = write_spm_gguf(tmp_path / "llama.gguf"), write_spm_gguf(tmp_path / "phi3.gguf", "phi3")
    _, meta, _ = read_files(llama_file)
    tok, config = tokenizer_from_metadata(meta, "llama.gguf")
    hf_llama, hf_published = hf_gguf_tokenizer(llama_file), hf_gguf_tokenizer(phi_file)
    bos = 1
    for text in SPM_TEXTS:
        ids = tok.encode(text).ids
        assert ids == hf_published.encode(text), text
        if "qz" not in text:  # TIES: transformers ranks equal scores by vocabulary order, llama.cpp by position
            assert ids == [bos] + spm_reference(text), text
        if not text.startswith((" ", SP)) and "<s>" not in text and "</s>" not in text:
            assert ids == hf_llama.encode(text), text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_published.decode(ids, skip_special_tokens=skip)
        if "</s>" not in text and "<s>" not in text:
            assert tok.decode(ids) == text.replace(SP, " "), text  # SentencePiece reads "▁" as a space
    # what the prefix means: the space of " hi" stays a token; text after a special token gets its "▁"
    piece = tok.id_to_token
    assert [piece(i) for i in tok.encode(" hello").ids] == ["<s>", SP, f"{SP}hello"]
    assert [piece(i) for i in tok.encode("<s>[INST]", add_special_tokens=False).ids] == ["<s>", f"{SP}[INST]"]
    assert [piece(i) for i in tok.encode("数").ids] == ["<s>", SP, "<0xE6>", "<0x95>", "<0xB0>"]
    assert [piece(i) for i in tok.encode("qzx").ids] == ["<s>", SP, "q", "zx"]
    assert config["bos_token"] == "<s>" and config["eos_token"] == "</s>" and config["unk_token"] == "<unk>"
    assert config["add_bos_token"] and not config["add_eos_token"]


def test_sentencepiece_unknown_token_and_options(tmp_path):
    """<unk> typed in text is matched whole (llama.cpp's special-token partition includes UNKNOWN);
    add_bos_token false adds no BOS; add_space_prefix false prepends no "▁" and strips no space."""
    _, meta, _ = read_files(write_spm_gguf(tmp_path / "m.gguf"))
    tok, _ = tokenizer_from_metadata(meta, "m.gguf")
    assert tok.encode("x <unk> y").ids == [1] + spm_reference("x <unk> y") and 0 in tok.encode("x <unk> y").ids
    _, meta, _ = read_files(write_spm_gguf(tmp_path / "n.gguf", add_bos_token=False, add_space_prefix=False))
    tok, config = tokenizer_from_metadata(meta, "n.gguf")
    assert not config["add_bos_token"]
    for text in SPM_TEXTS[:-1]:  # not the TIES text
        ids = tok.encode(text).ids
        assert ids == spm_reference(text, prefix=False), text
        if "s>" not in text:
            assert tok.decode(ids) == text.replace(SP, " "), text
    assert not tok.id_to_token(tok.encode("hello there").ids[0]).startswith(SP)


def test_sentencepiece_tokenizer_json_reloads(tmp_path):
    """The saved tokenizer.json and config are what hybrid's runtime Tokenizer reads: same ids, same text."""
    from hybrid.runtime.tokenizer import Tokenizer

    _, meta, _ = read_files(write_spm_gguf(tmp_path / "m.gguf"))
    tok, config = tokenizer_from_metadata(meta, "m.gguf")
    out = tmp_path / "tok"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    runtime = Tokenizer(out)
    for text in SPM_TEXTS:
        assert runtime.encode(text) == tok.encode(text).ids
        assert runtime.decode(runtime.encode(text)) == tok.decode(tok.encode(text).ids)
    assert runtime.eos_token_ids == (2,)


@pytest.mark.parametrize("key, value, match", [
    ("tokenizer.ggml.model", "t5", "tokenizer.ggml.model 't5' is not supported"),
    ("tokenizer.ggml.scores", None, "missing metadata key 'tokenizer.ggml.scores'"),
    ("tokenizer.ggml.scores", [0.0], "tokenizer.ggml.scores has 1 entries for"),
    ("tokenizer.ggml.scores", "scores", "metadata key 'tokenizer.ggml.scores' has a wrong type"),
])
def test_sentencepiece_refusals(tmp_path, key, value, match):
    tokens, scores, types = spm_vocabulary()
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, key: value}
    with pytest.raises(ModelLoadError, match=re.escape(match)) as exc:
        tokenizer_from_metadata(meta, "t.gguf")
    assert "\n" not in str(exc.value)


# -- Kimi-K2 ----------------------------------------------------------------------------------------------------
KIMI_PAT = "|".join([  # tokenization_kimi.py's pat_str, as Moonshot writes it
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
KIMI_TEXTS = ["数学和English混合abc中文Test", "Ab数Cd 東京タワー", "CamelCaseHTTPServer isn't THEY'LL we're I'd",
              "digits 12345 678901 ٣٤٥ 3.14", "punctuation!!! ... ?? --- (a) [b] {c}", "new\nlines\r\n\n  x\n",
              "trailing spaces   ", "  leading and   inner", "naïve café Ünïcödé, 한국어 日本語のテキスト 🙂🚀",
              "tabs\t\tand\u3000ideographic space", "Zqx\nZqx, Zqx!"]
KIMI_SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>"]
WHOLE = "Zqx"  # in the vocabulary without a merge that builds it: tiktoken takes the piece whole
_KIMI: list = []


def _bytes_to_unicode() -> dict[int, str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def byte_pair_merge(ranks: dict[bytes, int], piece: bytes, max_rank: int | None = None) -> list[bytes]:
    """tiktoken's BPE of one piece: join the adjacent pair whose concatenation has the lowest rank (the leftmost
    of equals) until none is left (or none below max_rank: llama.cpp's converter recovering a token's merge)."""
    parts = [bytes([b]) for b in piece]
    while True:
        found = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks]
        if not found or (max_rank is not None and min(found)[0] >= max_rank):
            return parts
        i = min(found)[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def kimi_ranks() -> dict[bytes, int]:
    """tiktoken ranks trained here on Kimi's split (rank = id), plus WHOLE."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    if not _KIMI:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(KIMI_PAT), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(CORPUS + KIMI_TEXTS[:-1], trainer)
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        vocab = json.loads(tok.to_str())["model"]["vocab"]
        ranks = {bytes(byte_of[c] for c in t): i for t, i in vocab.items()}
        ranks[WHOLE.encode()] = len(ranks)
        _KIMI.append(ranks)
    return _KIMI[0]


def kimi_metadata() -> dict:
    """What llama.cpp's converter writes for Kimi-K2: byte-level tokens in rank order, each token's merge
    recovered from the ranks, the special tokens after them (CONTROL)."""
    ranks = kimi_ranks()
    spell = _bytes_to_unicode()
    text = {r: "".join(spell[b] for b in t) for t, r in ranks.items()}
    merges = []
    for t, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        parts = byte_pair_merge(ranks, t, max_rank=r)
        if len(parts) == 2:  # WHOLE has none: no pair of its pieces is a token
            merges.append(" ".join("".join(spell[b] for b in p) for p in parts))
    tokens = [text[r] for r in range(len(ranks))] + KIMI_SPECIALS
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "kimi-k2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * len(ranks) + [3] * len(KIMI_SPECIALS),
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": len(ranks),
            "tokenizer.ggml.eos_token_id": len(ranks) + 2}


def tiktoken_reference(text: str) -> list[int]:
    """tiktoken's encode (special tokens allowed): specials whole, pieces of the pat_str found whole in the ranks
    taken as they are, the others merged by rank."""
    ranks, n = kimi_ranks(), len(kimi_ranks())
    out: list[int] = []
    for run in re.split("(" + "|".join(map(re.escape, KIMI_SPECIALS)) + ")", text):
        if run in KIMI_SPECIALS:
            out.append(n + KIMI_SPECIALS.index(run))
            continue
        for piece in regex.findall(KIMI_PAT, run, flags=regex.V1):
            b = piece.encode()
            out.extend([ranks[b]] if b in ranks else [ranks[p] for p in byte_pair_merge(ranks, b)])
    return out


def test_kimi_split_is_the_tiktoken_pattern():
    """The pre-tokenizer's pieces are regex V1's findall of the pat_str, and cover the text (nothing between)."""
    tok, _ = tokenizer_from_metadata(kimi_metadata(), "kimi.gguf")
    spell = _bytes_to_unicode()
    pat = regex.compile(KIMI_PAT, flags=regex.V1)
    for text in KIMI_TEXTS + CORPUS[:3]:
        pieces = pat.findall(text)
        assert "".join(pieces) == text
        got = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)]
        assert got == ["".join(spell[b] for b in p.encode()) for p in pieces], text
    # Han runs apart from the letters around them, case-aware words, digits in threes
    assert pat.findall("Ab数Cd") == ["Ab", "数", "Cd"]
    assert pat.findall("CamelCaseHTTPServer they'll 12345") == ["Camel", "Case", "HTTPServer", " they'll", " ",
                                                                "123", "45"]


def test_kimi_encodes_as_tiktoken():
    meta = kimi_metadata()
    tok, config = tokenizer_from_metadata(meta, "kimi.gguf")
    for text in KIMI_TEXTS + CORPUS[:3] + ["[BOS]hi<|im_end|>\n", "<|im_end|>数学"]:
        ids = tok.encode(text).ids
        assert ids == tiktoken_reference(text), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    zqx = kimi_ranks()[WHOLE.encode()]
    assert tok.encode(WHOLE).ids == [zqx] and tok.encode("<|im_end|>").ids == [meta["tokenizer.ggml.eos_token_id"]]
    assert tok.decode(tok.encode("a<|im_end|>b").ids) == "ab"
    assert config["bos_token"] == "[BOS]" and config["eos_token"] == "<|im_end|>" and not config["add_bos_token"]


def test_unknown_pre_tokenizer_is_refused():
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.pre 'foo' is not supported") as exc:
        tokenizer_from_metadata({**kimi_metadata(), "tokenizer.ggml.pre": "foo"}, "t.gguf")
    assert "\n" not in str(exc.value) and "kimi-k2" in str(exc.value)


def test_a_mixtral_gguf_with_its_sentencepiece_vocabulary_runs_through_generate(tmp_path, tmp_path_factory,
                                                                               monkeypatch, capsys):
    """`hybrid generate --model mixtral.gguf`: the file alone (SentencePiece tokenizer from its metadata, Q4_0
    experts kept as q4_0 by default on the CPU executor) gives the plain load's greedy tokens, and
    the prompt's ids are the tokenizer's (BOS first)."""
    import json as _json

    from hybrid.cli import main
    from bench.hf_to_gguf import write_gguf
    from test_gguf import hf_model

    monkeypatch.setenv("HYBRID_CACHE", str(tmp_path / "cache"))
    hf, _ = hf_model("mixtral", tmp_path_factory, vocab_size=len(spm_vocabulary()[0]))
    path = tmp_path / "mixtral.gguf"
    write_gguf(path, "mixtral", hf, expert_type=gguf.GGMLQuantizationType.Q4_0, extra=add_spm_tokenizer)
    runs = {}
    for name, extra in (("plain", []), ("hybrid", ["--gpu-experts", "0"])):
        assert main(["generate", "--model", str(path), "--prompt", "hello there", "-n", "4", "--json", *extra]) == 0
        runs[name] = _json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs["plain"]["prompt_token_ids"] == [1] + spm_reference("hello there")
    assert runs["plain"]["generated_token_ids"] == runs["hybrid"]["generated_token_ids"]
    assert len(runs["hybrid"]["generated_token_ids"]) == 4
    assert runs["hybrid"]["hybrid"]["cpu_dtype"] == "q4_0" and "int4_group" not in runs["hybrid"]["hybrid"]
