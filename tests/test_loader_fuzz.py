"""Fuzz: a few hundred seeded malformed checkpoints (config.json, safetensors headers and bytes, the shard
index, generation_config.json, tokenizer.json). Every one either loads or raises ModelLoadError with one
line, never another exception, and afterwards the process still loads the good checkpoint to the same
logits with its peak memory barely grown."""

from __future__ import annotations

import json
import random
import resource
import struct
from pathlib import Path

import pytest
import torch

from hybrid.models import ModelLoadError, load_model
from hybrid.runtime.tokenizer import Tokenizer
from loader_cases import clone, join, shards, split, write_tiny

CASES = 320
BAD_VALUES = [-1, 0, 1, 3, 10**12, 1e30, -1e-9, 0.5, "abc", "", [], [1, "x"], {}, {"a": 1}, True, False, None,
              float("nan"), float("inf"), 2**63, -(2**63)]


def _mutate_config(rng, p: Path):
    cfg = json.loads((p / "config.json").read_text())
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(sorted(cfg) + ["sliding_window", "use_sliding_window", "rope_scaling", "eos_token_id"])
        if rng.random() < 0.15:
            cfg.pop(key, None)
        else:
            cfg[key] = rng.choice(BAD_VALUES)
    (p / "config.json").write_text(json.dumps(cfg))


def _raw_config(rng, p: Path):
    data = (p / "config.json").read_bytes()
    kind = rng.randrange(4)
    if kind == 0:
        data = data[:rng.randrange(len(data))]
    elif kind == 1:
        data = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif kind == 2:
        i = rng.randrange(len(data))
        data = data[:i] + bytes([rng.randrange(128, 256)]) + data[i + 1:]
    else:
        data = json.dumps(rng.choice([[1, 2], "x", 3, None, [{}]])).encode()
    (p / "config.json").write_bytes(data)


def _mutate_header(rng, p: Path):
    f = rng.choice(shards(p))
    header, data = split(f)
    header.pop("__metadata__", None)
    names = sorted(header)
    for _ in range(rng.randint(1, 2)):
        e = header[rng.choice(names)]
        if not (isinstance(e, dict) and {"dtype", "shape", "data_offsets"} <= set(e)
                and isinstance(e["shape"], list) and isinstance(e["data_offsets"], list)):
            continue  # already broken by the first round
        kind = rng.randrange(9)
        if kind == 0:
            e["data_offsets"] = e["data_offsets"][::-1]
        elif kind == 1:
            d = rng.choice([-4, -2, 2, 4, 10**6, 2**62])
            e["data_offsets"] = [e["data_offsets"][0] + d, e["data_offsets"][1] + d]
        elif kind == 2:
            e["dtype"] = rng.choice(["F32", "F16", "I8", "F64", "BF16", "X9", 3, None])
        elif kind == 3:
            e["shape"] = rng.choice([[], [0], [-1], [2**40, 2**40], "3", [1.5], [True], e["shape"][::-1] + [1]])
        elif kind == 4:
            e.pop(rng.choice(["dtype", "shape", "data_offsets"]))
        elif kind == 5:
            e["data_offsets"] = rng.choice([[0], "0,4", [0, "4"], [0.5, 2], None])
        elif kind == 6:
            header[rng.choice(names)] = rng.choice([[], 1, "x", None])
        elif kind == 7:
            e["shape"] = [d + rng.choice([-1, 1]) for d in e["shape"]] or [1]
        else:
            header["__metadata__"] = rng.choice([{"format": "pt"}, [1], "x"])
    join(f, header, data)


def _raw_header(rng, p: Path):
    f = rng.choice(shards(p))
    raw = bytearray(f.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    kind = rng.randrange(4)
    if kind == 0:  # header length field
        raw[:8] = struct.pack("<Q", rng.choice([0, 1, n - 1, n + 1, len(raw), 2**40, 2**64 - 1]))
    elif kind == 1:  # a byte of the header JSON
        i = rng.randrange(8, 8 + n)
        raw[i] = rng.randrange(256)
    elif kind == 2:  # truncate anywhere
        del raw[rng.randrange(len(raw)):]
    else:  # data bytes turned into NaN / Inf (bf16 0x7fc0 / 0x7f80)
        i = 8 + n + 2 * rng.randrange((len(raw) - 8 - n) // 2)
        raw[i:i + 2] = rng.choice([b"\xc0\x7f", b"\x80\x7f", b"\x80\xff"])
    f.write_bytes(bytes(raw))


def _mutate_index(rng, p: Path):
    idx = p / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    wm = data["weight_map"]
    kind = rng.randrange(6)
    if kind == 0:
        data = rng.choice([[], "x", 1, None])
    elif kind == 1:
        data["weight_map"] = rng.choice([[], "x", None, {}])
    elif kind == 2:
        wm[rng.choice(sorted(wm))] = rng.choice(["../evil.safetensors", "/etc/passwd", "a/../../b", 7, "", None])
    elif kind == 3:
        wm[rng.choice(sorted(wm))] = "missing-00009.safetensors"
    elif kind == 4:
        wm.pop(rng.choice(sorted(wm)))  # a tensor the shards still hold: loads (the index only lists files)
    else:
        idx.write_bytes(b"\xff\xfe not json")
        return
    idx.write_text(json.dumps(data))


def _side_files(rng, p: Path):
    name = rng.choice(["generation_config.json", "tokenizer.json"])
    (p / name).write_bytes(rng.choice([b"\xff", b"[]", b"{", b'{"eos_token_id": "x"}', b'{"eos_token_id": [1, -2]}',
                                       b'{"model": 5}', b"\x00" * 10, b'{"eos_token_id": 2}']))


MUTATORS = [_mutate_config, _raw_config, _mutate_header, _raw_header, _mutate_index, _side_files]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    p = write_tiny(tmp_path_factory.mktemp("fuzz") / "good")
    from hybrid.runtime.demo import build_tokenizer

    build_tokenizer(p, vocab_size=300)
    return p


def _logits(path):
    model = load_model(path, progress=False)
    from hybrid.runtime import Engine

    e = Engine(model, max_batch=1, max_context=16)
    return e.forward(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], torch.tensor([0]))[0]


def test_fuzzed_checkpoints_always_load_or_refuse_in_one_line(good, tmp_path):
    reference = _logits(good)
    rng = random.Random(1234)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcome = {"refused": 0, "loaded": 0}
    kinds: dict[str, int] = {}
    for i in range(CASES):
        p = clone(good, tmp_path / f"c{i}")
        mutate = MUTATORS[i % len(MUTATORS)]
        mutate(rng, p)
        kinds[mutate.__name__] = kinds.get(mutate.__name__, 0) + 1
        try:
            load_model(p, progress=False)
            Tokenizer(p)
            outcome["loaded"] += 1
        except ModelLoadError as exc:
            assert "\n" not in str(exc) and str(exc), f"case {i} ({mutate.__name__}): {exc!r}"
            outcome["refused"] += 1
        # any other exception fails the test here, naming the case by its index and seed
    print(f"fuzz: {CASES} cases {kinds}: {outcome}")
    assert sum(outcome.values()) == CASES
    assert outcome["refused"] > CASES * 0.6  # the mutations are meant to break things; most must be refused
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert grown_mib < 300, f"peak memory grew by {grown_mib:.0f} MiB during the fuzz"
    torch.testing.assert_close(_logits(good), reference, rtol=0, atol=0)
