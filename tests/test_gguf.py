"""GGUF checkpoints (hybrid.models.gguf) against transformers and gguf-py.

Each tiny family of tiny_models.FAMILIES that llama.cpp has an architecture for is written to a GGUF file the
way llama.cpp's convert_hf_to_gguf.py writes it (its metadata keys, tensor names, the llama q/k row permutation,
the split MLA kv_b, stacked experts; bench.hf_to_gguf), loaded with load_gguf and compared with transformers:
F32 files within 1e-4 (as test_model_equality), Q8_0 experts against transformers run on gguf-py's
de-quantization of the same bytes. The de-quantizers are compared bit for bit with gguf.quants.dequantize; the
tokenizer with a byte-level BPE trained here; refusals are one-line ModelLoadErrors.
"""

from __future__ import annotations

import copy
import json
import unicodedata

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from bench.hf_to_gguf import ARCH, gguf_tensors, set_expert_stacks, write_gguf  # noqa: E402
from hybrid.models.errors import ModelLoadError  # noqa: E402
from hybrid.models.gguf import dequantize, load_gguf, open_gguf  # noqa: E402
from tiny_models import FAMILIES, DEEPSEEK_VARIANTS, VOCAB, hf_logits, make_checkpoint, single_logits  # noqa: E402

# What GGUF cannot say, set to what it means: llama.cpp reads one YaRN mscale for DeepSeek (mscale_all_dim,
# taking mscale equal, as the published configs have them) and has fixed gpt-oss SwiGLU constants.
OVERRIDES = {
    "deepseek_v3": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 64, "mscale": 0.707,
                                         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
    "gpt_oss": dict(swiglu_limit=7.0, swiglu_alpha=1.702),
}
PROMPT = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(5)).tolist()

_MODELS: dict = {}


def hf_model(model_type: str, tmp_path_factory, **overrides):
    """(transformers model, its safetensors directory), built once per module and variant."""
    key = (model_type, repr(sorted(overrides.items())))
    if key not in _MODELS:
        extra = {"e_score_correction_bias": 0.5} if model_type in ("deepseek_v3", "glm4_moe") else \
            {"sinks": 1.0} if model_type == "gpt_oss" else None
        path = tmp_path_factory.mktemp(model_type)
        hf = make_checkpoint(model_type, path, seed=1, extra=extra, **{**OVERRIDES.get(model_type, {}), **overrides})
        _MODELS[key] = hf, path
    return _MODELS[key]


@pytest.fixture(scope="module", params=sorted(ARCH))
def tiny(request, tmp_path_factory):
    return request.param, hf_model(request.param, tmp_path_factory)[0]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return hf_model("qwen3_moe", tmp_path_factory)


def ours(path, **kw) -> torch.Tensor:
    return single_logits(load_gguf(path, progress=False, **kw), PROMPT)


def test_f32_gguf_logits_match_transformers(tiny, tmp_path):
    model_type, hf = tiny
    write_gguf(tmp_path / "m.gguf", model_type, hf)
    assert (ours(tmp_path / "m.gguf") - hf_logits(hf, PROMPT)).abs().max().item() <= 1e-4


def test_q8_0_experts_match_transformers_on_their_dequantized_values(tiny, tmp_path):
    """Experts stored Q8_0 (gguf-py's quantizer); transformers runs on gguf-py's de-quantization of those bytes."""
    model_type, hf = tiny
    written = write_gguf(tmp_path / "q.gguf", model_type, hf, expert_type=Q.Q8_0)
    assert written
    ref = copy.deepcopy(hf)
    layers = sorted({int(n.split(".")[1]) for n in written})
    for i in layers:
        stacks = {n: torch.from_numpy(gguf.quants.dequantize(q, Q.Q8_0)) for n, q in written.items()
                  if n.startswith(f"blk.{i}.")}
        set_expert_stacks(model_type, ref, i, stacks)
    diff = (ours(tmp_path / "q.gguf") - hf_logits(ref, PROMPT)).abs().max().item()
    assert diff <= 1e-4
    assert (hf_logits(ref, PROMPT) - hf_logits(hf, PROMPT)).abs().max().item() > 1e-4  # Q8_0 really changed them


def test_deepseek_legacy_kv_b_without_q_lora_tied(tmp_path, tmp_path_factory):
    """The older deepseek2 layout (attn_kv_b whole, key/value_length per head), no q bottleneck, tied head."""
    hf, _ = hf_model("deepseek_v3", tmp_path_factory, **DEEPSEEK_VARIANTS["no_q_lora_tied"])
    write_gguf(tmp_path / "d.gguf", "deepseek_v3", hf, legacy_kv_b=True)
    ckpt = open_gguf(tmp_path / "d.gguf")
    assert ckpt.config.mla.q_lora_rank is None and ckpt.config.tie_word_embeddings
    assert (ours(ckpt) - hf_logits(hf, PROMPT)).abs().max().item() <= 1e-4
    # both forms in one file (some converters kept attn_kv_b beside the split): the split one is read (here the
    # whole one is made wrong, so reading it would show)
    wrong_kv_b = {n: 1 + t for n, t in gguf_tensors("deepseek_v3", hf, True).items() if n.endswith("attn_kv_b.weight")}
    write_gguf(tmp_path / "b.gguf", "deepseek_v3", hf, tensors=wrong_kv_b)
    assert (ours(tmp_path / "b.gguf") - hf_logits(hf, PROMPT)).abs().max().item() <= 1e-4


def test_multi_token_prediction_layer_is_skipped(tmp_path, tmp_path_factory, caplog):
    """GLM-4.5 files count their MTP layer in block_count (nextn_predict_layers); its tensors are not loaded."""
    hf, _ = hf_model("glm4_moe", tmp_path_factory)
    L = hf.config.num_hidden_layers
    mtp = {f"blk.{L}.nextn.eh_proj.weight": torch.randn(64, 128), f"blk.{L}.attn_norm.weight": torch.ones(64)}
    write_gguf(tmp_path / "g.gguf", "glm4_moe", hf, tensors=mtp, extra_layers=1)
    assert open_gguf(tmp_path / "g.gguf").config.num_layers == L
    with caplog.at_level("INFO", logger="hybrid.models"):
        logits = ours(tmp_path / "g.gguf")
    assert (logits - hf_logits(hf, PROMPT)).abs().max().item() <= 1e-4
    assert "skipping 2 tensor(s): multi-token-prediction layer" in caplog.text


def test_split_files_load_from_any_part(tmp_path, qwen3):
    hf, _ = qwen3
    write_gguf(tmp_path / "s.gguf", "qwen3_moe", hf, split_max_tensors=12)
    parts = sorted(tmp_path.glob("s-*-of-*.gguf"))
    assert len(parts) >= 3 and not (tmp_path / "s.gguf").exists()
    ckpt = open_gguf(parts[-1])
    assert ckpt.files == tuple(parts) and len({t.file for t in ckpt.tensors.values()}) == len(parts)
    assert (ours(parts[0]) - hf_logits(hf, PROMPT)).abs().max().item() <= 1e-4
    renamed = parts[0].rename(tmp_path / "renamed.gguf")
    with pytest.raises(ModelLoadError, match="part 1 of a GGUF split into"):
        open_gguf(renamed)
    renamed.rename(parts[0])
    parts[1].unlink()
    with pytest.raises(ModelLoadError, match=f"missing file: .*{parts[1].name}"):
        open_gguf(parts[0])


def test_factory_and_gpu_dtypes_as_load_model(tmp_path, qwen3):
    """The expert hook and quantized GPU matrices give what load_model gives on the safetensors checkpoint."""
    from hybrid.models import load_model
    from hybrid.models.moe import StackedExperts

    hf, st_dir = qwen3
    write_gguf(tmp_path / "m.gguf", "qwen3_moe", hf)
    calls = []

    def factory(i, g, u, d):
        calls.append((i, g.dtype, tuple(g.shape), tuple(d.shape)))
        return StackedExperts.from_weights(g, u, d)

    kw = dict(gpu_dtypes={"attention": "int8"}, expert_dtype=torch.bfloat16)
    got = single_logits(load_gguf(tmp_path / "m.gguf", experts_factory=factory, progress=False, **kw), PROMPT)
    want = single_logits(load_model(st_dir, progress=False, **kw), PROMPT)
    assert torch.equal(got, want)
    assert calls == [(i, torch.bfloat16, (8, 32, 64), (8, 64, 32)) for i in range(3)]


# -- refusals: one line each ----------------------------------------------------------------------------------
def _refused(path, match: str) -> str:
    with pytest.raises(ModelLoadError, match=match) as exc:
        load_gguf(path, progress=False)
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_unknown_architecture_is_refused_naming_the_supported(tmp_path, qwen3):
    write_gguf(tmp_path / "x.gguf", "qwen3_moe", qwen3[0], arch="mamba")
    msg = _refused(tmp_path / "x.gguf", "unsupported GGUF architecture 'mamba'")
    assert all(a in msg for a in ARCH.values())


def test_unsupported_tensor_type_is_refused_naming_tensor_and_type(tmp_path, qwen3):
    name = "blk.0.ffn_gate_exps.weight"  # F64 (the writer's type for float64 values): no de-quantizer
    write_gguf(tmp_path / "x.gguf", "qwen3_moe", qwen3[0],
               tensors={name: gguf_tensors("qwen3_moe", qwen3[0])[name].double()})
    _refused(tmp_path / "x.gguf", r"tensor 'blk\.0\.ffn_gate_exps\.weight' .*type F64 is not supported")


@pytest.mark.parametrize("t", [Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda t: t.name)
def test_fallback_types_load_as_their_dequantized_values(tmp_path, qwen3, t):
    """The 32-value types llama-quantize falls back to where a row is not whole 256-value blocks (a Q4_K_M file's
    128-column MLA attn_k_b is Q5_0) load as gguf-py de-quantizes them: a file whose attention matrices are of the
    type gives transformers' logits on those values (IQ4_NL, which gguf-py cannot quantize, is checked bit for bit
    above)."""
    hf = qwen3[0]
    ours_to_hf = {f"blk.{i}.attn_{g}.weight": f"model.layers.{i}.self_attn.{h}_proj.weight"
                  for i in range(hf.config.num_hidden_layers)
                  for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))}
    written = write_gguf(tmp_path / "x.gguf", "qwen3_moe", hf, types=dict.fromkeys(ours_to_hf, t))
    assert set(written) == set(ours_to_hf)
    ref = copy.deepcopy(hf)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, q in written.items():
            p = params[ours_to_hf[name]]
            p.copy_(torch.from_numpy(gguf.quants.dequantize(q, t)).reshape(p.shape))
    assert (ours(tmp_path / "x.gguf") - hf_logits(ref, PROMPT)).abs().max().item() <= 1e-4
    assert (hf_logits(ref, PROMPT) - hf_logits(hf, PROMPT)).abs().max().item() > 1e-4  # the type really changed them


@pytest.mark.parametrize("edit, match", [
    ({"blk.1.attn_q.weight": None}, r"missing tensor 'blk\.1\.attn_q\.weight'"),
    ({"blk.2.ffn_down_exps.weight": None}, r"missing tensor 'blk\.2\.ffn_down_exps\.weight'"),
    ({"blk.0.attn_k.weight": torch.zeros(16, 64)},
     r"tensor 'blk\.0\.attn_k\.weight'.*expected \[32, 64\], found \[16, 64\]"),
    ({"blk.0.mystery.weight": torch.zeros(4)}, r"unexpected tensor 'blk\.0\.mystery\.weight'"),
    ({"blk.3.attn_norm.weight": torch.ones(64)}, r"unexpected tensor 'blk\.3\.attn_norm\.weight'"),
    ({"blk.1.attn_norm.weight": torch.full((64,), float("nan"))}, r"'blk\.1\.attn_norm\.weight'.*64 NaN/Inf"),
])
def test_bad_tensors_are_refused(tmp_path, qwen3, edit, match):
    write_gguf(tmp_path / "x.gguf", "qwen3_moe", qwen3[0], tensors=edit)
    _refused(tmp_path / "x.gguf", match)


def test_not_a_gguf_file_is_refused(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGUF" + bytes(range(40)))
    _refused(tmp_path / "x.gguf", "not a readable GGUF file")
    _refused(tmp_path / "absent.gguf", "GGUF file not found")


# -- de-quantizers: bit for bit against gguf-py -----------------------------------------------------------------
BLOCK_TYPES = (Q.Q8_0, Q.Q4_0, Q.MXFP4, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ2_XXS, Q.IQ3_XXS, Q.IQ1_S,
               Q.IQ2_XS, Q.IQ2_S, Q.IQ3_S, Q.TQ1_0, Q.TQ2_0,
               Q.IQ1_M, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL)
FP16_AT = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_XS: (0,),
           Q.IQ2_XS: (0,), Q.IQ2_S: (0,), Q.IQ3_S: (0,), Q.TQ1_0: (52,), Q.TQ2_0: (64,),  # TQ: d last
           Q.IQ2_XXS: (0,), Q.IQ3_XXS: (0,), Q.IQ1_S: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.IQ4_NL: (0,)}


def valid_blocks(t, n: int, rng) -> np.ndarray:
    """n blocks of type t: gguf-py's quantization of random values where it has a quantizer, else random
    bytes (every code and scale pattern) with the fp16 scale fields set to finite values (IQ1_M: its d, which has no
    field of its own, as the top nibbles of its 4 scales words, word w's bits 4 w .. 4 w + 3 of d)."""
    block, size = gguf.GGML_QUANT_SIZES[t]
    if t == Q.IQ1_M:
        b = rng.integers(0, 256, (n, size), dtype=np.uint8)
        d = rng.uniform(-2, 2, n).astype(np.float16).view(np.uint16)[:, None]
        sc = b[:, 48:56].copy().view(np.uint16)
        sc = (sc & 0x0FFF) | (((d >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 0xF) << 12)
        b[:, 48:56] = sc.astype(np.uint16).view(np.uint8)
        return b
    if t not in FP16_AT:
        return gguf.quants.quantize(rng.standard_normal((n, block)).astype(np.float32) * 3, t).reshape(n, size)
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at in FP16_AT[t]:
        b[:, at:at + 2] = rng.uniform(-2, 2, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return b


@pytest.mark.parametrize("t", BLOCK_TYPES + (Q.F32, Q.F16, Q.BF16), ids=lambda t: t.name)
def test_dequantize_is_bit_exact_with_gguf_py(t, monkeypatch):
    from hybrid.models.gguf import dequant

    rng = np.random.default_rng(int(t))
    block, size = gguf.GGML_QUANT_SIZES[t]
    shape = (3, 2, 4 * block) if t in BLOCK_TYPES else (3, 2, 96)
    if t in BLOCK_TYPES:
        raw = valid_blocks(t, 24, rng).reshape(3, 2, 4 * size)
    else:
        x = rng.standard_normal(shape).astype(np.float32)
        stored = gguf.quants.quantize(x, t) if t == Q.BF16 else x.astype(np.float16 if t == Q.F16 else np.float32)
        raw = stored.view(np.uint8)
    want = torch.from_numpy(gguf.quants.dequantize(raw, t).reshape(shape).copy())
    got = dequantize(torch.from_numpy(raw.copy()), t, shape)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.isfinite(want).all() and want.abs().sum() > 0
    monkeypatch.setattr(dequant, "CHUNK_VALUES", 2 * shape[-1])  # several slices of the leading dim
    out = torch.empty(shape)
    seen = []
    dequant.dequantize_into(out, torch.from_numpy(raw.copy()), t, check=lambda v: seen.append(v.shape[0]))
    assert torch.equal(out, want) and seen == [1, 1, 1]


def test_dequantize_refuses_wrong_sizes():
    with pytest.raises(ValueError, match="needs 68 bytes"):
        dequantize(torch.zeros(67, dtype=torch.uint8), Q.Q8_0, (2, 32))
    with pytest.raises(ValueError, match="not whole Q8_0 blocks"):
        dequantize(torch.zeros(34, dtype=torch.uint8), Q.Q8_0, (1, 33))


# -- tokenizer --------------------------------------------------------------------------------------------------
# The Split regexes of the published tokenizer.json files' pre-tokenizers, as that JSON spells them (Qwen2/3,
# Llama 3 and GLM-4.5, DeepSeek-V3, gpt-oss), written independently of hybrid.models.gguf.tokenizer's.
PUBLISHED = json.loads(r"""{
 "qwen2": ["(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"],
 "llama-bpe": ["(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"],
 "deepseek-v3": ["\\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
   "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"],
 "gpt-4o": ["[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"]
}""")
PUBLISHED["glm4"] = PUBLISHED["llama-bpe"]
CORPUS = ["The quick brown fox jumps over the lazy dog. It's 2024; we've 12345 apples & 67 pears!",
          "  Indented   text\twith tabs\nand new lines\r\n\n  The CamelCase HTTPServer isn't they'll.",
          "naïve café façade — Ünïcödé, 数学和日本語のテキスト, 東京タワー, emoji 🙂🚀 and ٣٤٥ digits.",
          "def f(x):\n    return x**2 + 3.14159  # comment\n<|im_start|>user\nhello<|im_end|>"] * 8
TEXTS = ["Hello world, it's 2024! they'll CamelCaseHTTPServer 数学和 1234567 x/y",
         "  leading spaces\n\nand 1234567 digits", "naïve café 数学 🙂", "CamelCaseHTTPServer they'll WE'RE", "<|im_start|>user\nhi<|im_end|>\n<think>ok</think>", "tabs\t\tand\r\n",
         "cafe\u0301 decomposed (NFD)"]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


_TRAINED: list = []
# Strings that some pre-tokenizers keep in one piece and others split (contractions, case changes, a space before
# CJK, digit runs, a slash): the vocabulary gets each as one token, merged first, so that a wrong split shows.
CROSSING = [" they'll", "CamelCaseHTTPServer", " 数学和", "1234567", " x/y"]


def _byte_level(text: str) -> str:
    from tokenizers import pre_tokenizers

    pieces = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    return "".join(p for p, _ in pieces)


def trained_bpe():
    """(vocab, merges) of a byte-level BPE trained on CORPUS, with merges that build each CROSSING string whole
    ranked first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if not _TRAINED:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIALS, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(CORPUS, trainer)
        model = json.loads(tok.to_str())["model"]
        vocab = dict(model["vocab"])
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]
        first = []
        for word in map(_byte_level, CROSSING):
            for k in range(2, len(word) + 1):
                if (word[:k - 1], word[k - 1]) not in first:
                    first.append((word[:k - 1], word[k - 1]))
                vocab.setdefault(word[:k], len(vocab))
        _TRAINED.append((vocab, first + [m for m in merges if m not in first]))
    return _TRAINED[0]


def trained_reference(pre: str):
    """The trained vocabulary and merges under the published pre-tokenizer of `pre` (NFC for Qwen2, whole words
    kept for Llama 3), with special tokens and a non-special added token (<think>) as Qwen3 has: the original
    tokenizer a GGUF's vocabulary comes from."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab, merges = trained_bpe()
    tok = Tokenizer(models.BPE(vocab=dict(vocab), merges=list(merges), ignore_merges=pre == "llama-bpe"))
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in PUBLISHED.get(pre, [])]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre == "gpt-2")])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    return tok


def gguf_tokenizer_metadata(tok, pre: str) -> dict:
    """What the converter's _set_vocab_gpt2 writes for `tok`: tokens in id order, types (specials CONTROL,
    other added tokens USER_DEFINED), merges as 'a b' strings."""
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    added = {t.content: t.special for t in tok.get_added_tokens_decoder().values()}
    types = [3 if added.get(t) else 4 if t in added else 1 for t in tokens]
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"], "tokenizer.ggml.bos_token_id": vocab["<|endoftext|>"],
            "tokenizer.ggml.add_bos_token": False,
            "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                                       "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"}


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "glm4", "deepseek-v3", "gpt-4o", "gpt-2"])
def test_tokenizer_from_metadata_encodes_as_the_original(pre):
    from hybrid.models.gguf import tokenizer_from_metadata

    ref = trained_reference(pre)
    tok, config = tokenizer_from_metadata(gguf_tokenizer_metadata(ref, pre), "t.gguf")
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert ids == ref.encode(text).ids, (pre, text)
        assert tok.decode(ids, skip_special_tokens=False) == (unicodedata.normalize("NFC", text) if pre == "qwen2"
                                                              else text)
    assert config["eos_token"] == "<|im_end|>" and config["bos_token"] == "<|endoftext|>"
    # known merges: the first merge of letters gives its token, a special token is matched whole
    a, b = next((a, b) for a, b in trained_bpe()[1] if (a + b).isascii() and (a + b).isalpha() and len(a + b) > 2)
    assert tok.encode(a + b).ids == [trained_bpe()[0][a + b]]
    assert tok.encode("<|im_end|>").ids == [ref.token_to_id("<|im_end|>")]
    assert tok.decode(tok.encode("a<|im_end|>b").ids) == "ab"  # specials skipped when decoding, as HF


def test_bos_is_added_as_the_metadata_says():
    """tokenizer.ggml.add_bos_token; without it llama.cpp's default for the pre-tokenizer (Llama 3: add)."""
    from hybrid.models.gguf import tokenizer_from_metadata

    ref = trained_reference("llama-bpe")
    meta = gguf_tokenizer_metadata(ref, "llama-bpe")
    bos, want = meta["tokenizer.ggml.bos_token_id"], ref.encode("hi there").ids
    for add in (True, None):
        tok, config = tokenizer_from_metadata({**meta, "tokenizer.ggml.add_bos_token": add}, "t.gguf")
        assert tok.encode("hi there").ids == [bos] + want and config["add_bos_token"]
    tok, _ = tokenizer_from_metadata(meta, "t.gguf")  # add_bos_token: false
    assert tok.encode("hi there").ids == want


def test_write_tokenizer_files_for_the_runtime_tokenizer(tmp_path, tmp_path_factory):
    """A model file with its tokenizer: write_tokenizer_files -> hybrid's Tokenizer encodes, decodes, stops and
    renders the chat template as the original would."""
    from hybrid.models.gguf import write_tokenizer_files
    from hybrid.runtime.tokenizer import Tokenizer

    ref = trained_reference("qwen2")
    meta = gguf_tokenizer_metadata(ref, "qwen2")
    hf, _ = hf_model("qwen3_moe", tmp_path_factory, vocab_size=len(meta["tokenizer.ggml.tokens"]))

    def add_tokenizer(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(meta["tokenizer.ggml.tokens"])
        w.add_token_types(meta["tokenizer.ggml.token_type"])
        w.add_token_merges(meta["tokenizer.ggml.merges"])
        w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
        w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
        w.add_add_bos_token(False)
        w.add_chat_template(meta["tokenizer.chat_template"])

    write_gguf(tmp_path / "m.gguf", "qwen3_moe", hf, extra=add_tokenizer)
    ckpt = open_gguf(tmp_path / "m.gguf")
    assert ckpt.config.eos_token_ids == (ref.token_to_id("<|im_end|>"),)
    tok = Tokenizer(write_tokenizer_files(ckpt, tmp_path / "tok"))
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text).ids
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == unicodedata.normalize("NFC", text)
    assert tok.eos_token_ids == (ref.token_to_id("<|im_end|>"),)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(prompt)[:1] == [ref.token_to_id("<|im_start|>")]


@pytest.mark.parametrize("key, value, match", [
    ("tokenizer.ggml.pre", "foo", "tokenizer.ggml.pre 'foo' is not supported"),
    ("tokenizer.ggml.model", "t5", "tokenizer.ggml.model 't5' is not supported"),
    ("tokenizer.ggml.merges", ["ab"], "merges entry 'ab' is not two tokens"),
    ("tokenizer.ggml.merges", ["zz qq"], "merges and .tokens do not make a BPE tokenizer"),
])
def test_unsupported_tokenizers_are_refused(key, value, match):
    from hybrid.models.gguf import tokenizer_from_metadata

    meta = gguf_tokenizer_metadata(trained_reference("qwen2"), "qwen2")
    with pytest.raises(ModelLoadError, match=match) as exc:
        tokenizer_from_metadata({**meta, key: value}, "t.gguf")
    assert "\n" not in str(exc.value)


def test_fused_gate_up_experts(tmp_path, qwen3):
    """Newer files may fuse a layer's gate and up stacks into ffn_gate_up_exps [E, 2F, D] (gate rows first)."""
    hf, _ = qwen3
    ts = gguf_tensors("qwen3_moe", hf)
    fused = {}
    for i in range(hf.config.num_hidden_layers):
        g, u = ts[f"blk.{i}.ffn_gate_exps.weight"], ts[f"blk.{i}.ffn_up_exps.weight"]
        fused |= {f"blk.{i}.ffn_gate_exps.weight": None, f"blk.{i}.ffn_up_exps.weight": None,
                  f"blk.{i}.ffn_gate_up_exps.weight": torch.cat([g, u], dim=1)}
    write_gguf(tmp_path / "f.gguf", "qwen3_moe", hf, tensors=fused)
    assert (ours(tmp_path / "f.gguf") - hf_logits(hf, PROMPT)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("edit, match", [
    ({"qwen3moe.embedding_length": None}, r"missing metadata key 'qwen3moe\.embedding_length'"),
    ({"qwen3moe.attention.head_count_kv": [2, 2, 4]}, r"head_count_kv differs between layers"),
    ({"qwen3moe.rope.scaling.type": "longrope"}, r"rope scaling 'longrope' is not supported"),
    ({"qwen3moe.rope.dimension_count": 8}, r"rope\.dimension_count 8 differs from the head dim 16"),
    ({"general.architecture": "llama", "llama.expert_count": 0}, r"without experts .* is dense"),
    ({"qwen3moe.expert_used_count": 9}, r"experts_per_token 9 > num_experts 8"),
])
def test_bad_metadata_is_refused_in_one_line(tmp_path, qwen3, edit, match):
    """The metadata -> config step, on a real file's metadata with one key changed (None: removed)."""
    from hybrid.models.gguf.checkpoint import config_from_metadata

    write_gguf(tmp_path / "m.gguf", "qwen3_moe", qwen3[0])
    ckpt = open_gguf(tmp_path / "m.gguf")
    meta = {k: v for k, v in {**ckpt.metadata, **edit}.items() if v is not None}
    if "llama.expert_count" in edit:
        meta = {k.replace("qwen3moe.", "llama."): v for k, v in meta.items()}
    with pytest.raises(ModelLoadError, match=match) as exc:
        config_from_metadata(meta, {n: t.shape for n, t in ckpt.tensors.items()}, "m.gguf")
    assert "\n" not in str(exc.value)


def test_one_gguf_file_through_the_commands(tmp_path, tmp_path_factory, monkeypatch, capsys):
    """`hybrid generate --model X.gguf` (plain and with the CPU executor), `hybrid plan --model X.gguf`: the file
    alone (its tokenizer from the metadata), the same greedy tokens as the safetensors copy of the weights."""
    import json as _json

    from hybrid.cli import main

    monkeypatch.setenv("HYBRID_CACHE", str(tmp_path / "cache"))
    ref = trained_reference("qwen2")
    meta = gguf_tokenizer_metadata(ref, "qwen2")
    hf, st_dir = hf_model("qwen3_moe", tmp_path_factory, vocab_size=len(meta["tokenizer.ggml.tokens"]))

    def add_tokenizer(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(meta["tokenizer.ggml.tokens"])
        w.add_token_types(meta["tokenizer.ggml.token_type"])
        w.add_token_merges(meta["tokenizer.ggml.merges"])
        w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
        w.add_add_bos_token(False)
        w.add_chat_template(meta["tokenizer.chat_template"])

    path = tmp_path / "m.gguf"
    write_gguf(path, "qwen3_moe", hf, extra=add_tokenizer)
    runs = {}
    for name, extra in (("plain", []), ("hybrid", ["--gpu-experts", "0", "--cpu-dtype", "bf16"])):
        assert main(["generate", "--model", str(path), "--prompt", "hello world", "-n", "4", "--json", *extra]) == 0
        runs[name] = _json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs["plain"]["generated_token_ids"] == runs["hybrid"]["generated_token_ids"]
    assert runs["plain"]["prompt_token_ids"] == ref.encode("hello world").ids
    with torch.no_grad():
        from hybrid.models import load_model

        ids = runs["plain"]["prompt_token_ids"]
        for t in runs["plain"]["generated_token_ids"]:  # the safetensors weights choose the same tokens
            logits = single_logits(load_model(st_dir, progress=False), ids)
            assert int(logits[-1].argmax()) == t
            ids = ids + [t]
    assert main(["plan", "--model", str(path), "--gpu-budget", "2GiB", "--cpu-budget", "1GiB",
                 "--profile", "ktransformers-paper-amx", "--json"]) == 0
    assert _json.loads(capsys.readouterr().out)["model"]["family"] == "qwen3_moe"
    assert main(["generate", "--model", str(path), "--cpu-dtype", "mxfp4", "-n", "1"]) == 2
    assert "de-quantized" in capsys.readouterr().err
