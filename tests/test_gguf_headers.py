"""The GGUF header cache (hybrid.models.gguf.files): a second read of the same files takes their metadata and
tensor table from $HYBRID_CACHE/gguf-headers instead of GGUFReader's parse and gives the same values and bytes; a
rewritten file, a corrupt or inconsistent entry, or an unwritable cache folder fall back to the parse."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch

import hybrid.models.gguf.files as files


def write(path, value: int = 7, words=("alpha", "beta", "gamma"), rows: int = 4):
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_uint32("test.value", value)
    w.add_array("test.words", list(words))
    w.add_float32("test.eps", 1e-6)
    w.add_tensor("a.weight", np.arange(rows * 32, dtype=np.float32).reshape(rows, 32))
    w.add_tensor("b.weight", gguf.quants.quantize(np.linspace(-1, 1, 64 * rows, dtype=np.float32).reshape(rows, 64),
                                                  gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def no_parse(monkeypatch):
    def refuse(path):
        raise AssertionError(f"GGUFReader parsed {path} again")
    monkeypatch.setattr(files, "_reader", refuse)


def same(a, b):
    (pa, ma, ta), (pb, mb, tb) = a, b
    assert pa == pb and ma == mb and list(ta) == list(tb)
    for name in ta:
        x, y = ta[name], tb[name]
        assert (x.ggml_type, x.shape, x.file) == (y.ggml_type, y.shape, y.file)
        assert torch.equal(x.raw(), y.raw()), name


def test_second_read_comes_from_the_cache_with_the_same_values(tmp_path, monkeypatch):
    f = tmp_path / "m.gguf"
    write(f)
    first = files.read_files(f)
    entry = files.header_cache_file(first[0])
    assert entry.is_file() and first[1]["test.words"] == ["alpha", "beta", "gamma"]
    no_parse(monkeypatch)
    same(first, files.read_files(f))


def test_split_parts_are_cached_together(tmp_path, monkeypatch):
    w = gguf.GGUFWriter(str(tmp_path / "s.gguf"), "qwen3moe", split_max_tensors=1)
    w.add_uint32("test.value", 3)
    for i in range(3):
        w.add_tensor(f"t{i}.weight", np.full((2, 32), i, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    first_part = tmp_path / "s-00001-of-00003.gguf"
    first = files.read_files(first_part)
    assert len(first[0]) == 3 and sorted(first[2]) == ["t0.weight", "t1.weight", "t2.weight"]
    no_parse(monkeypatch)
    same(first, files.read_files(first_part))


def test_a_rewritten_file_is_parsed_again(tmp_path):
    f = tmp_path / "m.gguf"
    write(f, value=7)
    files.read_files(f)
    st = f.stat()
    write(f, value=9)  # same size; pin the old mtime as a rewrite inside the clock's granularity would leave it
    assert f.stat().st_size == st.st_size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert files.read_files(f)[1]["test.value"] == 9  # the header's hash no longer matches the entry


@pytest.mark.parametrize("damage", ["truncated", "offset past the end", "other format"])
def test_a_damaged_entry_is_parsed_again_and_rewritten(tmp_path, damage):
    f = tmp_path / "m.gguf"
    write(f)
    first = files.read_files(f)
    entry = files.header_cache_file(first[0])
    text = entry.read_text()
    if damage == "truncated":
        entry.write_text(text[:len(text) // 2])
    else:
        doc = json.loads(text)
        if damage == "offset past the end":
            doc["tensors"][0][4] = f.stat().st_size
        else:
            doc["format"] = files.HEADER_FORMAT + 1
        entry.write_text(json.dumps(doc))
    same(first, files.read_files(f))
    assert json.loads(entry.read_text()) == json.loads(text)  # rewritten whole


def test_an_unwritable_cache_folder_only_costs_the_parse(tmp_path, monkeypatch):
    f = tmp_path / "m.gguf"
    write(f)
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("HYBRID_CACHE", str(blocker))
    from cpu_kernels import knobs

    knobs.reset()
    parts, meta, tensors = files.read_files(f)
    assert meta["test.value"] == 7 and sorted(tensors) == ["a.weight", "b.weight"]
    assert not files.header_cache_file(parts).exists()
