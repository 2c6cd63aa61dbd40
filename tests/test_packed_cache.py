"""The packed-expert cache (hybrid/offload/packed_cache.py, CpuMoE.packed_state / from_packed): a second load
copies every layer's executor bytes back without converting anything and computes bit for bit what the first
did (bf16, int8, int4, mxfp4 from a gpt-oss checkpoint); the key follows the checkpoint's files, the dtype and
the int4 group; a truncated file or a flipped byte is found and the cache rebuilt; a cache folder that cannot be
written, a full disk and too little space each leave no half cache and a load that works, with one warning;
packed_cache=False (--no-cache) neither reads nor writes; `hybrid cache list` / `rm`. The write runs in the
background: the load returns before it ends, a failed load cancels it, the exit of a one-shot `hybrid generate`
finishes it, a second process meanwhile converts (no half cache is read), and the files stay in the page cache."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import cpu_kernels
from cpu_kernels import Topology
from cpu_kernels.moe import CpuMoE, packed_layout
from hybrid.errors import UsageError
from hybrid.models.presets import hf_config
from hybrid.models.writer import write_random_checkpoint
from hybrid.offload import packed_cache as pc
from hybrid.offload.build import load_hybrid
from hybrid.offload.config import HybridConfig

SMALL = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             eos_token_id=None, pad_token_id=None)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """Two MoE layers of 4 experts, D = F = 64, bf16 weights."""
    raw = dict(hf_config("demo", layers=2), **SMALL, moe_intermediate_size=64, intermediate_size=128, num_experts=4,
               num_experts_per_tok=2)
    return write_random_checkpoint(tmp_path_factory.mktemp("pc") / "qwen", raw, seed=1, std=0.1)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """gpt-oss with its experts published in MXFP4 (and expert biases), two layers of 4 experts."""
    raw = dict(hf_config("gpt-oss-120b", layers=2), **SMALL, intermediate_size=64, num_local_experts=4,
               num_experts_per_tok=2, experts_per_token=2, sliding_window=8)
    return write_random_checkpoint(tmp_path_factory.mktemp("pc") / "gpt_oss", raw, seed=2, dtype=torch.float32,
                                   std=0.1, mxfp4=True)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "hycache"
    monkeypatch.setenv("HYBRID_CACHE", str(root))
    cpu_kernels.knobs.reset()
    yield root / "packed"
    cpu_kernels.knobs.reset()


def load(path, cpu_dtype="bf16", wait=True, **kw):
    """load_hybrid on the CPU; wait: until the cache's background write is over (as a next start would find it)."""
    hcfg = HybridConfig(gpu_experts=0, cpu_dtype=cpu_dtype, profile="ktransformers-paper-amx", **kw)
    off = load_hybrid(path, "cpu", torch.float32, hcfg, progress=False)[1]
    if wait:
        assert pc.wait_for_writers(timeout=120)
    return off


def outputs(off) -> list[torch.Tensor]:
    """Each layer's CPU executor on the same tokens (every expert, batch and decode sizes)."""
    g = torch.Generator().manual_seed(0)
    res = []
    for layer in off.layers:
        moe = layer.cpu_moe
        for T in (1, 9):
            x = torch.randn(T, moe.D, generator=g)
            ids = torch.stack([torch.randperm(moe.E, generator=g)[:2] for _ in range(T)])
            res.append(moe(x, ids, torch.rand(T, 2, generator=g)))
    return res


def same_bytes(a, b) -> bool:
    sa, sb = a.cpu_moe.packed_state(), b.cpu_moe.packed_state()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def folders(root):
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def no_conversion(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("converted an expert stack that the cache holds")
    monkeypatch.setattr(CpuMoE, "_mat", refuse)


def assert_restart_hits(monkeypatch, cache, path, ref, cpu_dtype="int8"):
    """With the test's patches undone, a new load of `path` converts nothing and holds `ref`'s packed bytes."""
    monkeypatch.undo()
    monkeypatch.setenv("HYBRID_CACHE", str(cache.parent))
    no_conversion(monkeypatch)
    hit = load(path, cpu_dtype)
    assert all(same_bytes(a, b) for a, b in zip(ref.layers, hit.layers))


def count_conversions(monkeypatch) -> list:
    calls, real = [], CpuMoE._mat
    monkeypatch.setattr(CpuMoE, "_mat", lambda self, *a: calls.append(1) or real(self, *a))
    return calls


@pytest.mark.parametrize("cpu_dtype, model", [("bf16", "qwen"), ("int8", "qwen"), ("int4", "qwen"),
                                               ("mxfp4", "gpt_oss")])
def test_second_load_copies_the_cache_bit_for_bit(request, cache, monkeypatch, cpu_dtype, model):
    path = request.getfixturevalue(model)
    first = load(path, cpu_dtype)
    (key,) = folders(cache)
    manifest = pc.read_manifest(cache / key)
    assert manifest["dtype"] == cpu_dtype and sorted(manifest["layers"]) == ["0", "1"]
    assert first.load_times.convert_s > 0 and first.load_times.cache_writing == sum(
        e["size"] for e in manifest["layers"].values()) and first.load_times.cache_bytes == 0
    os.utime(cache / key / pc.LAST_USED, (0, 0))
    with monkeypatch.context() as m:
        no_conversion(m)
        second = load(path, cpu_dtype)
    assert (cache / key / pc.LAST_USED).stat().st_mtime > 0  # `hybrid cache list` shows the last use
    assert second.load_times.convert_s == 0 and second.load_times.cache_bytes == first.load_times.cache_writing
    assert second.load_times.cache_writing == 0
    assert all(same_bytes(a, b) for a, b in zip(first.layers, second.layers))
    for a, b in zip(outputs(first), outputs(second)):
        assert torch.equal(a, b)
    if model == "gpt_oss":  # the expert biases travel with the bytes
        assert any(k.endswith(".bias") for k in second.layers[0].cpu_moe.packed_state())


def test_a_layer_the_cache_holds_needs_no_weights(qwen, cache):
    """What a loader that skips the experts the cache holds (PackedCache.holds) hands the factory: None."""
    from hybrid.offload import HybridExperts

    off = load(qwen, "int8")
    c = pc.open_for_load(qwen, argparse.Namespace(expert_intermediate_size=64, moe_layer_indices=(0, 1)), off,
                         pc.LoadTimes())
    assert c.holds(0) and c.holds(1) and not c.holds(2)
    layer = HybridExperts(1, None, None, None, off, cache=c)
    assert same_bytes(layer, off.layers[1])
    c._discard("gone")
    from hybrid.errors import UsageError

    with pytest.raises(UsageError, match="cache failed at layer 1 after the loader had skipped"):
        HybridExperts(1, None, None, None, off, cache=c)


def test_load_line_says_where_the_time_went(qwen, cache):
    """A miss says how much is being written in the background (its seconds are not the load's); a hit says
    how much it read and how fast."""
    line = re.compile(r"loaded in ([\d.]+) s: read ([\d.]+) s, convert ([\d.]+) s, upload ([\d.]+) s, "
                      r"cache ([\d.]+) s \((.*)\)")
    write, hit = load(qwen).load_times, load(qwen).load_times
    for times in (write, hit):
        assert times.read_s + times.convert_s + times.upload_s + times.cache_s == pytest.approx(times.total_s)
    m = line.fullmatch(write.line())
    assert m and m.group(6) == f"{write.cache_writing / 1e9:.2f} GB writing in the background", write.line()
    m = line.fullmatch(hit.line())
    assert m and hit.cache_s > 0, hit.line()
    m = re.fullmatch(r"([\d.]+) GB at ([\d.]+) GB/s", m.group(6))
    assert m and float(m.group(1)) == round(hit.cache_bytes / 1e9, 2) and hit.cache_bytes == write.cache_writing


def test_checkpoint_mtime_dtype_and_group_change_the_key(qwen, cache, tmp_path, monkeypatch):
    path = shutil.copytree(qwen, tmp_path / "ckpt")
    load(path)
    (old,) = folders(cache)
    shard = sorted(path.glob("*.safetensors"))[-1]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    calls = count_conversions(monkeypatch)
    load(path)
    assert len(calls) == 6  # 2 layers x gate, up, down: converted again
    (new,) = folders(cache)  # the cache of the older files is removed as superseded
    assert new != old
    del calls[:]
    load(path, "int8")
    assert len(calls) == 6 and len(folders(cache)) == 2
    layout = dict(cpu_isa=None, topology=None, threads=None, group_size=128, cpu_dtype="int4")
    cfg = argparse.Namespace(expert_intermediate_size=64, moe_layer_indices=(0, 1))
    load(path, "int4")
    hit = pc.open_for_load(path, cfg, argparse.Namespace(**layout), pc.LoadTimes())
    miss = pc.open_for_load(path, cfg, argparse.Namespace(**dict(layout, group_size=64)), pc.LoadTimes())
    assert hit.manifest is not None and miss.manifest is None and miss.key != hit.key


@pytest.mark.parametrize("damage", ["truncate", "flip_file", "flip_manifest"])
def test_damaged_cache_is_found_and_rebuilt(qwen, cache, monkeypatch, caplog, damage):
    first = load(qwen, "int8")
    (key,) = folders(cache)
    folder = cache / key
    layer_file = folder / "layer-1.bin"
    if damage == "truncate":
        os.truncate(layer_file, layer_file.stat().st_size - 1)
    elif damage == "flip_file":
        data = bytearray(layer_file.read_bytes())
        data[len(data) // 2] ^= 0x10
        layer_file.write_bytes(bytes(data))
    else:  # a digit of the body: still valid JSON, only the manifest's checksum catches it
        text = (folder / pc.MANIFEST).read_text()
        i = text.index('"created": ') + len('"created": ')
        digit = text[i]
        (folder / pc.MANIFEST).write_text(text[:i] + str((int(digit) + 1) % 10) + text[i + 1:])
    calls = count_conversions(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="hybrid.offload"):
        second = load(qwen, "int8")
    assert len(calls) == 6  # nothing was taken from the damaged cache
    assert [r.getMessage() for r in caplog.records if "rebuilding" in r.getMessage()], caplog.text
    assert pc.PackedCache.open(qwen, second.layers[0].cpu_moe.layout, (0, 1), pc.LoadTimes()).manifest is not None
    for a, b in zip(outputs(first), outputs(second)):
        assert torch.equal(a, b)


def test_layer_failing_mid_load_is_one_line_and_the_next_load_rebuilds(qwen, cache, monkeypatch, caplog):
    """Layer 1's bytes fail to read after the loader skipped its experts (the cache held them): one line naming the
    layer and what to do, the cache removed; the next load converts everything and writes it again, and the one
    after reads it back with the first load's bytes."""
    from hybrid.errors import UsageError

    first = load(qwen, "int4")
    real = pc.PackedCache._read_layer

    def fail_layer_1(self, entry, **kw):
        if entry["file"] == "layer-1.bin":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(self, entry, **kw)
    monkeypatch.setattr(pc.PackedCache, "_read_layer", fail_layer_1)
    with pytest.raises(UsageError, match="layer 1.*run again"):
        load(qwen, "int4")
    monkeypatch.undo()
    monkeypatch.setenv("HYBRID_CACHE", str(cache.parent))
    calls = count_conversions(monkeypatch)
    load(qwen, "int4")
    assert len(calls) > 0  # converted again: the failed cache was not used
    with monkeypatch.context() as m:
        no_conversion(m)
        third = load(qwen, "int4")
    assert all(same_bytes(a, b) for a, b in zip(first.layers, third.layers))


def test_sampled_hash_reads_windows_across_a_large_file():
    data = bytearray(os.urandom(3 << 20))
    base = pc.sampled_hash(bytes(data), len(data))
    middle = (len(data) - pc._WINDOW) * 31 // (pc._SAMPLES - 1) + 100  # inside the 32nd of 64 windows
    for at in (0, middle, len(data) - 1):  # the first, a middle and the last window
        flipped = bytearray(data)
        flipped[at] ^= 1
        assert pc.sampled_hash(bytes(flipped), len(flipped)) != base, at
    assert pc.sampled_hash(bytes(data[:-1]), len(data) - 1) != base


def _one_warning(caplog, *words):
    lines = [r.getMessage() for r in caplog.records
             if r.levelno >= logging.WARNING and "packed cache" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and all(w in lines[0] for w in words), lines
    return lines[0]


def test_unwritable_cache_folder_loads_with_one_warning(qwen, tmp_path, monkeypatch, caplog):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("HYBRID_CACHE", str(tmp_path / "file" / "cache"))
    cpu_kernels.knobs.reset()
    with caplog.at_level(logging.WARNING, logger="hybrid.offload"):
        off = load(qwen)
    _one_warning(caplog, "not written", "--no-cache")
    assert len(off.layers) == 2 and all(torch.isfinite(y).all() for y in outputs(off))


def test_full_disk_mid_write_leaves_no_half_cache(qwen, cache, monkeypatch, caplog):
    """The disk fills up in the background writer: one warning naming the error and the file, no folder."""
    real, calls = pc.PackedCache._write_layer, []

    def fill_up(self, *a):
        calls.append(threading.current_thread())
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "layer-1.bin")
        return real(self, *a)
    monkeypatch.setattr(pc.PackedCache, "_write_layer", fill_up)
    with caplog.at_level(logging.WARNING, logger="hybrid.offload"):
        off = load(qwen, "int4")
    _one_warning(caplog, f"not written ({os.strerror(errno.ENOSPC)}: layer-1.bin)")
    assert len(calls) == 2 and threading.main_thread() not in calls
    assert folders(cache) == []  # neither the temporary folder nor a cache remains
    assert len(off.layers) == 2 and all(torch.isfinite(y).all() for y in outputs(off))


def test_too_little_space_is_checked_before_writing(qwen, cache, monkeypatch, caplog):
    monkeypatch.setattr(pc.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 40, 1 << 40, 1 << 20))
    written = []
    monkeypatch.setattr(pc.PackedCache, "_write_layer", lambda *a: written.append(1))
    with caplog.at_level(logging.WARNING, logger="hybrid.offload"):
        load(qwen)
    _one_warning(caplog, "GB needed", "GB free")
    assert written == [] and folders(cache) == []


def test_no_cache_neither_reads_nor_writes(qwen, cache, monkeypatch):
    load(qwen, packed_cache=False)
    assert not cache.exists()  # nothing written
    load(qwen)
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*")}
    calls = count_conversions(monkeypatch)
    monkeypatch.setattr(pc.PackedCache, "open", lambda *a, **k: pytest.fail("opened the cache"))
    off = load(qwen, packed_cache=False)
    assert len(calls) == 6 and off.load_times.cache_s == 0 and off.load_times.cache_bytes == 0
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*")} == before


def test_cache_list_and_rm(qwen, cache, capsys):
    from hybrid.commands import cache as command

    parser = argparse.ArgumentParser()
    command.register(parser.add_subparsers(dest="command"))

    def run(*argv):
        args = parser.parse_args(["cache", *argv])
        return args.func(args), capsys.readouterr().out

    assert run("list") == (0, f"no packed caches under {cache}\n")
    load(qwen)
    load(qwen, "int8")
    keys = folders(cache)
    rc, out = run("list")
    assert rc == 0 and all(k in out for k in keys) and str(qwen.resolve()) in out
    assert "bf16" in out and "int8" in out and "GB" in out
    with pytest.raises(UsageError, match="no packed cache 'nope'"):
        run("rm", "nope")
    with pytest.raises(UsageError, match="KEY or --all"):
        run("rm")
    rc, out = run("rm", keys[0])
    assert rc == 0 and keys[0] in out and folders(cache) == keys[1:]
    rc, out = run("rm", "--all")
    assert rc == 0 and folders(cache) == []


def _stacks(E=4, F=96, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(*s, generator=g) * 0.1 for s in ((E, F, D), (E, F, D), (E, D, F))]
    b = dict(b_gate=torch.randn(E, F, generator=g), b_up=torch.randn(E, F, generator=g),
             b_down=torch.randn(E, D, generator=g))
    return w, b


@pytest.mark.parametrize("dtype, group", [("bf16", 128), ("int8", 128), ("int4", 32), ("mxfp4", 32)])
def test_from_packed_on_two_nodes_is_the_same_executor(dtype, group):
    """Two NUMA nodes (F split 64 + 32): every node's block, scales, row sums and biases come back."""
    (wg, wu, wd), b = _stacks()
    topo = Topology(((0,), (1,)))
    a = CpuMoE(wg, wu, wd, dtype=dtype, group_size=group, topology=topo, **b)
    assert a.layout == packed_layout(96, dtype, group, topology=topo) and len(a.layout["slices"]) == 2
    state = {k: v.clone() for k, v in a.packed_state().items()}
    c = CpuMoE.from_packed(state, (4, 96, 64), a.layout, dtype=dtype, group_size=group, topology=topo)
    sc = c.packed_state()
    assert sc.keys() == state.keys() and all(torch.equal(sc[k], state[k]) for k in state)
    assert c.nbytes == a.nbytes
    g = torch.Generator().manual_seed(1)
    x, ids, w = torch.randn(7, 64, generator=g), torch.randint(0, 4, (7, 2), generator=g), torch.rand(7, 2, generator=g)
    assert torch.equal(a(x, ids, w), c(x, ids, w))


def test_from_packed_refuses_bytes_that_do_not_fit():
    (wg, wu, wd), _ = _stacks()
    a = CpuMoE(wg, wu, wd, dtype="int8")
    state = dict(a.packed_state())
    with pytest.raises(ValueError, match="do not fit"):
        CpuMoE.from_packed(state, (4, 96, 64), dict(a.layout, kpad=128), dtype="int8")
    with pytest.raises(ValueError, match="n0.up.rsum"):
        CpuMoE.from_packed({k: v for k, v in state.items() if k != "n0.up.rsum"}, (4, 96, 64), a.layout, dtype="int8")
    with pytest.raises(ValueError, match="n0.block"):
        CpuMoE.from_packed(dict(state, **{"n0.block": state["n0.block"][:-1]}), (4, 96, 64), a.layout, dtype="int8")
    with pytest.raises(ValueError, match="does not hold"):
        CpuMoE.from_packed(dict(state, extra=state["n0.block"]), (4, 96, 64), a.layout, dtype="int8")
    assert json.dumps(a.layout)  # plain data: it goes into the cache's key and manifest


def test_a_hit_reads_no_expert_tensor_from_the_checkpoint(qwen, cache, monkeypatch):
    """On a hit the loader skips the experts the cache holds: no expert tensor is read or filled in."""
    import hybrid.models.loader as loader

    first = load(qwen, "int8")

    def no_fill(*a, **k):
        raise AssertionError("an expert tensor was read from the checkpoint on a cache hit")
    monkeypatch.setattr(loader, "_fill_stack", no_fill)
    second = load(qwen, "int8")
    assert all(same_bytes(a, b) for a, b in zip(first.layers, second.layers))


# -- the background write ---------------------------------------------------------------------------------------
def held_writer(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """The writer thread stops before its first layer until `release` is set; `writing` is set once it is there."""
    real, writing, release = pc.PackedCache._write_layer, threading.Event(), threading.Event()

    def held(self, *a):
        writing.set()
        assert release.wait(30)
        return real(self, *a)
    monkeypatch.setattr(pc.PackedCache, "_write_layer", held)
    return writing, release


def temporaries(root, pid=None) -> list[Path]:
    return sorted(root.glob(f".tmp-*-{pid}-*" if pid else ".tmp-*")) if root.is_dir() else []


def test_load_returns_before_the_writer_finishes(qwen, cache, monkeypatch):
    """The writer is held at layer 0 after load_hybrid returned: no cache yet, only this process's temporary
    folder; released, it publishes a cache that the next load reads with the first load's bytes."""
    writing, release = held_writer(monkeypatch)
    try:
        first = load(qwen, "int8", wait=False)
        assert writing.wait(30)  # the writer holds layer 0 while the load has returned
        assert pc.list_caches(cache) == [] and len(temporaries(cache, os.getpid())) == 1
        assert "writing in the background" in first.load_times.line()
        assert not pc.wait_for_writers(timeout=0)
    finally:
        release.set()
    assert pc.wait_for_writers(timeout=120)
    assert temporaries(cache) == [] and len(pc.list_caches(cache)) == 1
    assert_restart_hits(monkeypatch, cache, qwen, first)


def test_a_failed_load_writes_nothing(qwen, cache, monkeypatch, caplog):
    """Layer 1 fails to convert after layer 0 was stored: no writer starts, nothing is written, no warning."""
    real, calls = CpuMoE._mat, []

    def fail_layer_1(self, *a):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("conversion failed")
        return real(self, *a)
    monkeypatch.setattr(CpuMoE, "_mat", fail_layer_1)
    stored = []
    real_store = pc.PackedCache.store
    monkeypatch.setattr(pc.PackedCache, "store", lambda self, *a: stored.append(a[0]) or real_store(self, *a))
    with caplog.at_level(logging.WARNING, logger="hybrid.offload"):
        with pytest.raises(RuntimeError, match="conversion failed"):
            load(qwen, "int8", wait=False)
        assert stored == [0] and pc._WRITERS == set() and pc.wait_for_writers(timeout=0)
    assert folders(cache) == [] and not [r for r in caplog.records if "packed cache" in r.getMessage()]


def test_cache_files_stay_in_the_page_cache(qwen, cache, monkeypatch):
    """Neither the write nor a hit drops the files' pages: a restart copies at memory speed where there is room."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

    def resident(path: Path) -> float:
        """The share of the file's pages in the page cache (mincore over a mapping that touches none)."""
        size, page = path.stat().st_size, os.sysconf("SC_PAGE_SIZE")
        with open(path, "rb") as f:
            addr = libc.mmap(None, size, 1, 1, f.fileno(), 0)  # PROT_READ, MAP_SHARED
            assert addr not in (None, ctypes.c_void_p(-1).value)
            try:
                vec = (ctypes.c_ubyte * (-(-size // page)))()
                assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
                return sum(v & 1 for v in vec) / len(vec)
            finally:
                libc.munmap(addr, size)

    load(qwen, "int8")
    files = sorted(next(cache.iterdir()).glob("layer-*.bin"))
    assert len(files) == 2 and all(resident(f) == 1.0 for f in files)
    no_conversion(monkeypatch)
    load(qwen, "int8")
    assert all(resident(f) == 1.0 for f in files)


def tiny_with_tokenizer(folder: Path) -> Path:
    """The qwen fixture's shape with a vocabulary a byte-level tokenizer covers, and that tokenizer."""
    from hybrid.runtime.demo import build_tokenizer, pad_tokenizer

    raw = dict(hf_config("demo", layers=2), **dict(SMALL, vocab_size=512), moe_intermediate_size=64,
               intermediate_size=128, num_experts=4, num_experts_per_tok=2)
    path = write_random_checkpoint(folder, raw, seed=1, std=0.1)
    build_tokenizer(path, 384)
    assert pad_tokenizer(path / "tokenizer.json", 512) == 512
    return path


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_python(script: str, *args, **kw) -> subprocess.Popen:
    """The script in a child Python whose SIGINT is Python's own handler, as in a terminal (a suite started in the
    background passes its children SIGINT ignored)."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, HYBRID_NO_PROGRESS="1"), preexec_fn=_sigint_default, **kw)


@contextlib.contextmanager
def reaped(proc: subprocess.Popen):
    """The child killed and reaped if the block leaves it running (a failed assertion, a timeout)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_load_with_writer(hook: str, path) -> subprocess.Popen:
    """A child process loading `path` (int8 experts, every one in DRAM) whose packed-cache writer writes each layer
    through `hook`'s function `writer(self, layer, *a)`; the hook may call `real`, the writer's own method, and use
    sys, signal, threading and pc (hybrid.offload.packed_cache)."""
    return run_python("import signal, sys, threading, torch\n"
                      "from hybrid.offload import packed_cache as pc\n"
                      "from hybrid.offload.build import load_hybrid\n"
                      "from hybrid.offload.config import HybridConfig\n"
                      "real = pc.PackedCache._write_layer\n"
                      + textwrap.dedent(hook) +
                      "\npc.PackedCache._write_layer = writer\n"
                      "load_hybrid(sys.argv[1], 'cpu', torch.float32, HybridConfig(gpu_experts=0, cpu_dtype='int8', "
                      "profile='ktransformers-paper-amx'), progress=False)\n", path)


def test_exit_finishes_the_cache_of_a_one_shot_generate(cache, tmp_path):
    """`hybrid generate -n 1` whose writer is still at layer 0 when the command returns: the exit waits for it
    (one line), and `hybrid cache list` then shows a complete cache."""
    path = tiny_with_tokenizer(tmp_path / "tiny")
    proc = run_python("""
        import atexit, sys, threading
        from hybrid.offload import packed_cache as pc
        release, real = threading.Event(), pc.PackedCache._write_layer

        def held(self, *a):  # the writer waits until the interpreter exits
            assert release.wait(120)
            return real(self, *a)
        pc.PackedCache._write_layer = held
        atexit.register(release.set)  # registered after packed_cache's own wait, so it runs before it
        from hybrid.cli import main
        sys.exit(main(["generate", "--model", sys.argv[1], "-n", "1", "--prompt", "hi", "--cpu-dtype", "int8",
                       "--device", "cpu"]))
    """, path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert re.search(r"finishing the packed cache \([\d.]+ GB left to write; Ctrl-C skips it\)", err), err
    assert "writing in the background" in err and "not written" not in err
    (info,) = pc.list_caches(cache)
    assert info.model == str(path.resolve()) and info.dtype == "int8" and temporaries(cache) == []
    assert sorted(pc.read_manifest(info.folder)["layers"]) == ["0", "1"]
    listed = subprocess.run([sys.executable, "-m", "hybrid", "cache", "list"], capture_output=True, text=True,
                            env=os.environ)
    assert listed.returncode == 0 and info.key in listed.stdout and str(path.resolve()) in listed.stdout
    assert "bad" not in listed.stdout


def test_ctrl_c_at_exit_stops_the_write_and_leaves_no_folder(qwen, cache):
    """Ctrl-C while the exit waits for the writer: the writer stops, its temporary folder goes, exit as usual."""
    proc = run_load_with_writer("""
        def writer(self, *a):  # the writer holds layer 0 until stop()
            print("holding", flush=True)
            assert self._cancel.wait(120)
            return real(self, *a)
    """, qwen)
    with reaped(proc):
        assert proc.stdout.readline() == "holding\n"
        line = proc.stderr.readline()
        while line and "finishing the packed cache" not in line:
            line = proc.stderr.readline()
        assert line, "the exit did not wait for the writer"
        assert len(temporaries(cache, proc.pid)) == 1
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Traceback" not in err and "not written" not in err, err
    assert folders(cache) == []


def test_ctrl_c_taken_by_another_thread_at_exit_still_stops_the_write(qwen, cache):
    """A process-directed Ctrl-C may reach a thread other than the main one, which then sits in the exit's wait:
    the writer thread signals itself once the exit waits, and the process still stops the write and exits at
    once (its wait is timed; an untimed one held until the writer gave up, 120 s later)."""
    import time

    proc = run_load_with_writer("""
        exiting, waits = threading.Event(), pc.wait_for_writers

        def marked(*a, **k):  # the exit's wait has begun
            exiting.set()
            return waits(*a, **k)
        pc.wait_for_writers = marked

        def writer(self, *a):  # the writer holds layer 0; at exit it takes the Ctrl-C itself
            assert exiting.wait(60)
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
            assert self._cancel.wait(120)
            return real(self, *a)
    """, qwen)
    t0 = time.monotonic()
    with reaped(proc):
        _, err = proc.communicate(timeout=100)
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert "finishing the packed cache" in err and folders(cache) == []
    assert time.monotonic() - t0 < 90


def test_a_second_process_converts_while_the_first_writes(qwen, cache, monkeypatch):
    """Process A has written layer 0 into its temporary folder and waits; this process starts meanwhile: it
    finds no cache (A's folder is left alone: A lives), converts and publishes its own; A's rename then loses
    and A removes its folder, with no warning. The cache left reads back what this process converted."""
    child = run_load_with_writer("""
        def writer(self, layer, *a):
            if layer == 1:  # layer 0 is on disk
                print("held", flush=True)
                sys.stdin.readline()
            return real(self, layer, *a)
    """, qwen)
    with reaped(child):
        assert child.stdout.readline() == "held\n"
        (theirs,) = temporaries(cache, child.pid)
        assert (theirs / "layer-0.bin").is_file() and pc.list_caches(cache) == []
        calls = count_conversions(monkeypatch)
        ours = load(qwen, "int8")
        assert len(calls) == 6 and theirs.is_dir()  # converted; A's live folder was not taken for stale
        child.stdin.write("\n")
        child.stdin.flush()
        _, err = child.communicate(timeout=120)
    assert child.returncode == 0 and "not written" not in err, err
    assert temporaries(cache) == [] and len(pc.list_caches(cache)) == 1
    assert_restart_hits(monkeypatch, cache, qwen, ours)
