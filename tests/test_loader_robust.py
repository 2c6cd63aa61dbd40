"""Bad checkpoints end in one ModelLoadError line (CLI: one line on stderr, exit 2), sizes in config.json
are checked against the safetensors headers before anything is allocated, and what used to load silently
with wrong output (non-positive eps, negative window, NaN/Inf weights, shards outside the directory) is
refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hybrid.models.loader as loader
from hybrid.cli import main
from hybrid.models import ModelLoadError, load_model
from loader_cases import clone, edit_config, join, shards, split, write_tiny


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny1") / "m", single_file=True)


@pytest.fixture
def no_alloc(monkeypatch):
    """Fails the test if the loader gets as far as allocating the model."""
    def refuse(*_a, **_k):
        raise AssertionError("the loader allocated the model before refusing the checkpoint")
    monkeypatch.setattr(loader, "build_empty", refuse)


def refused(path, match: str):
    with pytest.raises(ModelLoadError, match=match) as info:
        load_model(path, progress=False)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_valid_tiny_checkpoint_loads(base, single):
    for p in (base, single):
        model = load_model(p, progress=False)
        assert model.cfg.num_layers == 2


@pytest.mark.parametrize("field,value,match", [
    ("num_hidden_layers", 100000, r"num_hidden_layers is 100000 but the checkpoint's tensors hold 2 decoder layers"),
    ("num_experts", 10**9, r"1000000000 experts per layer, but layer 0 of the checkpoint has 4"),
    ("hidden_size", 10**9, r"hidden_size is 1000000000 but no tensor .* \(largest: 320\)"),
    ("vocab_size", 10**10, r"vocab_size is 10000000000 but no tensor"),
    ("moe_intermediate_size", 10**8, r"expert_intermediate_size is 100000000 but no tensor"),
    ("num_attention_heads", 64, r"shape mismatch"),  # within bounds: caught on the meta skeleton
    ("head_dim", 10**9, r"head_dim is 1000000000"),
])
def test_sizes_checked_against_headers_before_allocating(base, tmp_path, no_alloc, field, value, match):
    p = clone(base, tmp_path / "m")
    edit_config(p, **{field: value})
    refused(p, match)


def test_huge_sizes_refused_with_bounded_memory(base, tmp_path):
    # A fresh process so its peak RSS is this load's: the refusals must not touch gigabytes first.
    cases = []
    for i, (field, value) in enumerate([("num_hidden_layers", 100000), ("num_experts", 10**6),
                                        ("hidden_size", 10**7), ("vocab_size", 10**9)]):
        p = clone(base, tmp_path / f"m{i}")
        edit_config(p, **{field: value})
        cases.append(str(p))
    code = textwrap.dedent(f"""
        import resource, sys
        from hybrid.models import ModelLoadError, load_model
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        n = 0
        for p in {cases!r}:
            try:
                load_model(p, progress=False)
            except ModelLoadError:
                n += 1
        print(n, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    n, grown_kib = map(int, out.stdout.split())
    assert n == 4
    assert grown_kib < 200 * 1024  # the tiny model itself is ~100 KiB


@pytest.mark.parametrize("change,match", [
    ({"rms_norm_eps": -1e-6}, r"rms_norm_eps must be a positive finite number"),
    ({"rms_norm_eps": 0}, r"rms_norm_eps must be a positive"),
    ({"use_sliding_window": True, "sliding_window": -5}, r"sliding_window must be a positive integer"),
    ({"sliding_window": -1}, r"sliding_window must be a positive integer"),
    ({"decoder_sparse_step": 0}, r"decoder_sparse_step must be >= 1"),
    ({"hidden_size": "256"}, r"hidden_size must be an integer, got '256'"),
    ({"num_experts": [4]}, r"num_experts must be an integer"),
    ({"norm_topk_prob": "false"}, r"norm_topk_prob must be true or false"),
    ({"mlp_only_layers": "0"}, r"mlp_only_layers must be a list"),
    ({"rope_scaling": [1]}, r"rope_scaling must be an object"),
    ({"model_type": ["qwen3_moe"]}, r"model_type must be a string"),
    ({"eos_token_id": "x"}, r"eos_token_id must be a token id"),
    ({"rope_theta": "big"}, r"rope_theta must be a positive"),
    ({"num_hidden_layers": ...}, r"missing field 'num_hidden_layers'"),
])
def test_bad_config_fields(base, tmp_path, no_alloc, change, match):
    p = clone(base, tmp_path / "m")
    edit_config(p, **change)
    refused(p, match)


@pytest.mark.parametrize("content,match", [
    (b"\xff\xfe{}", r"not UTF-8"),
    (b"[1, 2]", r"expected a JSON object, found list"),
    (b"{\"model_type\": ", r"not valid JSON"),
    (b"[" * 100000, r"not valid JSON"),
])
def test_config_file_not_an_object(base, tmp_path, content, match):
    p = clone(base, tmp_path / "m")
    (p / "config.json").write_bytes(content)
    refused(p, match)


def _edit_header(path: Path, fn, name_of=lambda h: sorted(h)[0]):
    f = shards(path)[0]
    header, data = split(f)
    meta = header.pop("__metadata__", None)
    fn(header, name_of(header))
    if meta is not None:
        header["__metadata__"] = meta
    join(f, header, data)


def _reverse(h, n):
    h[n]["data_offsets"] = h[n]["data_offsets"][::-1]


def _overlap(h, _n):
    a, b = sorted((e for e in h.values()), key=lambda e: e["data_offsets"][0])[:2]
    b["data_offsets"] = [b["data_offsets"][0] - 2, b["data_offsets"][1] - 2]


def _beyond(h, n):
    h[n]["data_offsets"] = [h[n]["data_offsets"][0], h[n]["data_offsets"][1] + 10**9]


def _relabel(h, n):
    h[n]["dtype"] = "F32"  # written as BF16: the span is half what F32 needs


@pytest.mark.parametrize("fn,match", [
    (_reverse, r"reversed"),
    (_overlap, r"overlaps the tensor before it|bytes but its data_offsets span"),
    (_beyond, r"truncated safetensors file"),
    (_relabel, r"F32 \[.*\] is \d+ bytes but its data_offsets span \d+"),
    (lambda h, n: h[n].update(shape="32"), r"shape must be a list of non-negative integers"),
    (lambda h, n: h[n].update(shape=[-1, 32]), r"shape must be a list of non-negative integers"),
    (lambda h, n: h[n].update(data_offsets="0-4"), r"data_offsets must be two integers"),
    (lambda h, n: h[n].update(dtype=7), r"unknown dtype 7"),
    (lambda h, n: h[n].pop("dtype"), r"header entry needs dtype, shape and data_offsets"),
    (lambda h, n: h.update({n: [1, 2]}), r"header entry needs"),
])
def test_bad_safetensors_headers(base, tmp_path, no_alloc, fn, match):
    p = clone(base, tmp_path / "m")
    _edit_header(p, fn)
    refused(p, match)


def test_header_not_an_object_or_absurd_length(single, tmp_path):
    p = clone(single, tmp_path / "m")
    f = shards(p)[0]
    header, data = split(f)
    join(f, None, data, header_bytes=b"[1, 2, 3]")
    refused(p, r"not a JSON object")
    f.write_bytes((2**62).to_bytes(8, "little") + b"{}")
    refused(p, r"header length")


@pytest.mark.parametrize("index,match", [
    ([1, 2], r"expected a JSON object, found list"),
    ({"weight_map": ["a"]}, r"weight_map must be a non-empty object"),
    ({"weight_map": {"model.embed_tokens.weight": 5}}, r"weight_map values must be file names"),
    ({"weight_map": {"model.embed_tokens.weight": "../outside.safetensors"}}, r"outside the checkpoint directory"),
    ({"weight_map": {"model.embed_tokens.weight": "/etc/passwd"}}, r"outside the checkpoint directory"),
])
def test_bad_index(base, tmp_path, index, match):
    p = clone(base, tmp_path / "m")
    (p / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(p, match)


def test_shard_symlink_outside_the_directory_is_refused(single, tmp_path):
    p = clone(single, tmp_path / "m")
    outside = tmp_path / "elsewhere.safetensors"
    (p / "model.safetensors").rename(outside)
    os.symlink(outside, p / "model.safetensors")
    refused(p, r"outside the checkpoint directory")


def test_hub_cache_snapshot_symlinks_still_load(single, tmp_path):
    # the Hugging Face hub cache: snapshots/REV/file -> ../../blobs/SHA, outside the snapshot folder
    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in single.iterdir():
        (blobs / f.name).write_bytes(f.read_bytes())
        os.symlink(Path("../../blobs") / f.name, snap / f.name)
    assert load_model(snap, progress=False).cfg.num_layers == 2


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nan_or_inf_weight_is_refused(single, tmp_path, value):
    from safetensors.torch import load_file, save_file

    p = clone(single, tmp_path / "m")
    f = p / "model.safetensors"
    t = load_file(str(f))
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    t[name][2, 5] = value
    save_file(t, str(f), metadata={"format": "pt"})
    msg = refused(p, r"NaN/Inf")
    assert name in msg and "1 NaN/Inf value(s)" in msg


def test_corrupt_tokenizer_and_generation_config(base, tmp_path):
    from hybrid.runtime.tokenizer import Tokenizer

    p = clone(base, tmp_path / "m")
    (p / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 5}}')
    with pytest.raises(ModelLoadError, match=r"not a readable tokenizer"):
        Tokenizer(p)
    (p / "tokenizer.json").write_bytes(b"\x00\x01garbage")
    with pytest.raises(ModelLoadError, match=r"not a readable tokenizer"):
        Tokenizer(p)
    for gen, match in ((b"\xff", r"not UTF-8"), (b"[]", r"expected a JSON object"),
                       (b'{"eos_token_id": "two"}', r"eos_token_id must be a token id")):
        (p / "generation_config.json").write_bytes(gen)
        refused(p, match)


def test_cli_bad_checkpoint_is_one_line_exit_2(base, tmp_path):
    p = clone(base, tmp_path / "m")
    edit_config(p, num_hidden_layers=100000)
    env = dict(os.environ, HYBRID_NO_PROGRESS="1")
    r = subprocess.run([sys.executable, "-m", "hybrid", "generate", "--model", str(p), "-n", "1"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "num_hidden_layers is 100000" in lines[0], r.stderr


def test_cli_inprocess_bad_header_exit_2(single, tmp_path, capsys):
    p = clone(single, tmp_path / "m")
    _edit_header(p, _reverse)
    assert main(["generate", "--model", str(p), "-n", "1"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_loaded_weights_equal_the_file(single):
    # the finite check reads but never changes what is loaded
    from safetensors.torch import load_file

    model = load_model(single, progress=False)
    t = load_file(str(single / "model.safetensors"))
    assert torch.equal(model.embed.float(), t["model.embed_tokens.weight"].float())


# --- read_header's boundaries, on hand-made files (one byte either way of each limit) -----------------------
def _st(path: Path, entries: dict, data: int, header_pad: int = 0, cut: int = 0) -> Path:
    """A safetensors file with the given header entries and `data` bytes of data, `cut` bytes short."""
    h = json.dumps(entries).encode() + b" " * header_pad
    blob = len(h).to_bytes(8, "little") + h + bytes(data)
    path.write_bytes(blob[:len(blob) - cut] if cut else blob)
    return path


def test_read_header_boundaries(tmp_path):
    from hybrid.models.checks import read_header

    def e(begin, end, shape=None):
        return {"dtype": "U8", "shape": [end - begin] if shape is None else shape, "data_offsets": [begin, end]}

    ok = read_header(_st(tmp_path / "ok.st", {"a": e(0, 4), "z": e(4, 4)}, 4))  # a zero-size tensor at the end
    assert ok["z"]["data_offsets"] == [4, 4] and ok["z"]["shape"] == [0]
    assert read_header(_st(tmp_path / "exact.st", {"a": e(0, 4)}, 4))["a"]["shape"] == [4]
    with pytest.raises(ModelLoadError, match="ends beyond it"):
        read_header(_st(tmp_path / "short.st", {"a": e(0, 4)}, 4, cut=1))
    with pytest.raises(ModelLoadError, match="overlaps"):
        read_header(_st(tmp_path / "overlap.st", {"a": e(0, 4), "b": e(3, 7)}, 7))
    with pytest.raises(ModelLoadError, match="a gap of 1 bytes"):
        read_header(_st(tmp_path / "gap.st", {"a": e(0, 4), "b": e(5, 9)}, 9))
    (tmp_path / "seven.st").write_bytes(bytes(7))
    with pytest.raises(ModelLoadError, match="no header"):
        read_header(tmp_path / "seven.st")
    h = json.dumps({"a": e(0, 0)}).encode()
    (tmp_path / "cut.st").write_bytes(len(h).to_bytes(8, "little") + h[:-1])  # the header itself one byte short
    with pytest.raises(ModelLoadError, match=f"header needs {8 + len(h)} bytes, file has {7 + len(h)}"):
        read_header(tmp_path / "cut.st")
    (tmp_path / "fits.st").write_bytes(len(h).to_bytes(8, "little") + h)  # header only, no data: fine
    assert read_header(tmp_path / "fits.st")["a"]["shape"] == [0]


@pytest.mark.parametrize("sw, off, ok", [(0, False, True), (0, None, False), (1, None, True), (-1, False, False),
                                         (4096, None, True), (2.5, None, False)])
def test_sliding_window_zero_only_with_the_window_off(sw, off, ok):
    from hybrid.models.checks import check_config_fields

    raw = {"sliding_window": sw} | ({} if off is None else {"use_sliding_window": off})
    if ok:
        check_config_fields(raw)
    else:
        with pytest.raises(ModelLoadError, match="sliding_window"):
            check_config_fields(raw)
