"""bench.hf_to_gguf.convert and bench.quality's gguf:TYPE settings on the built-in demo (a trained Qwen3-MoE): an
F32 file loads to the safetensors load's logits and carries a tokenizer that encodes as the checkpoint's; a Q8_0
file keeps the norms and routers F32 as llama.cpp's quantizer does; the quality bench measures Q8_0 within 1% of
the reference's perplexity and Q4_0 measurably off it, and refuses a file whose tokenizer disagrees."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from bench import quality  # noqa: E402
from bench.hf_to_gguf import convert, tensor_type  # noqa: E402
from hybrid.models.gguf import load_gguf  # noqa: E402
from hybrid.models.loader import load_model  # noqa: E402
from hybrid.runtime.demo import demo_checkpoint  # noqa: E402
from hybrid.runtime.tokenizer import Tokenizer  # noqa: E402
from tiny_models import single_logits  # noqa: E402

SENTENCES = ["The quick brown fox jumps over the lazy dog.",
             "To be, or not to be: that is the question.",
             "It's 2024; we've 12345 apples & 67 pears!\n  Indented\ttext.",
             "<|im_start|>user\nWhat is a mixture of experts?<|im_end|>\n"]
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """type -> the demo converted to a GGUF file of it."""
    out = tmp_path_factory.mktemp("demo-gguf")
    return {t: convert(demo_checkpoint(), out / f"demo-{t}.gguf", t) for t in ("f32", "q8_0")}


def test_f32_gguf_gives_the_safetensors_logits_and_token_ids(converted, tmp_path):
    demo = demo_checkpoint()
    ids = Tokenizer(str(demo)).encode(SENTENCES[1])
    want = single_logits(load_model(demo, progress=False), ids)
    got = single_logits(load_gguf(converted["f32"], progress=False), ids)
    assert want.dtype == got.dtype == torch.float32 and want.abs().max() > 1.0
    assert (got - want).abs().max().item() <= 1e-4
    encode = quality.gguf_encoder(converted["f32"], tmp_path / "tok")
    ref = Tokenizer(str(demo))
    for text in SENTENCES:
        assert encode(text) == ref.encode(text), text
    assert encode("<|im_end|>") == [2]


def test_quantized_file_keeps_norms_and_routers_f32(converted):
    reader = gguf.GGUFReader(str(converted["q8_0"]))
    types = {t.name: Q(int(t.tensor_type)) for t in reader.tensors}
    assert types["token_embd.weight"] == types["output.weight"] == types["blk.0.attn_q.weight"] == Q.Q8_0
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.3.ffn_down_exps.weight"] == Q.Q8_0
    for name in ("blk.0.ffn_gate_inp.weight", "blk.0.attn_norm.weight", "blk.0.attn_q_norm.weight",
                 "output_norm.weight"):
        assert types[name] == Q.F32, name
    field = reader.get_field("tokenizer.ggml.pre")
    assert bytes(field.parts[field.data[0]]).decode() == "gpt-2"
    assert tensor_type("blk.0.attn_q.weight", (64, 48), Q.Q4_0) == Q.F32  # rows not whole blocks of 32
    assert tensor_type("blk.0.ffn_gate_exps.bias", (4, 64), Q.Q4_0) == Q.F32


def test_quality_bench_measures_what_a_gguf_type_costs(tmp_path):
    out = tmp_path / "q.json"
    rc = quality.main(["--model", str(demo_checkpoint()), "--device", "cpu", "--settings", "gguf:q8_0,gguf:q4_0",
                       "--prompts", "4", "--new", "8", "--out", str(out)])
    assert rc == 0
    rows = {r["setting"]: r for r in json.loads(out.read_text())["rows"]}
    ref = rows["ref"]["perplexity"]
    assert abs(rows["gguf:q8_0"]["perplexity"] / ref - 1) < 0.01, rows
    assert rows["gguf:q4_0"]["perplexity"] != pytest.approx(ref, rel=1e-4), rows
    assert 0.0 <= rows["gguf:q4_0"]["same_tokens"] <= 1.0


def test_a_gguf_tokenizer_that_disagrees_fails_its_setting(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(quality, "gguf_encoder", lambda path, d: lambda text: [5] * 3)
    out = tmp_path / "q.json"
    rc = quality.main(["--model", str(demo_checkpoint()), "--device", "cpu", "--settings", "gguf:f32",
                       "--prompts", "2", "--new", "2", "--out", str(out)])
    assert rc == 1
    row = json.loads(out.read_text())["rows"][-1]
    assert row["setting"] == "gguf:f32" and "tokenizer encodes the text to other ids" in row["error"]


def test_unknown_gguf_type_is_a_usage_error():
    from hybrid.errors import UsageError

    assert quality.parse_setting("gguf:q4_0") == {"gguf": "q4_0"}
    with pytest.raises(UsageError, match="unknown setting 'gguf:q4_k'"):
        quality.parse_setting("gguf:q4_k")
