"""bench.l2_prefetch_probe's touch kernel: it reads every word of what it is given and writes nothing else, or
declines what it cannot read as aligned words. Without CUDA it runs in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch


DEVICES = ([pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                             reason="needs CUDA (GPU box)")])]
           + (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []))


def touch_module():
    pytest.importorskip("triton", reason="Triton is a test dependency (pyproject [test]); install it")
    from bench import l2_prefetch_probe

    return l2_prefetch_probe


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 7, 4096, 4097, 3 * 4096 + 5])
def test_touch_reads_every_word_and_writes_nothing_else(device, n):
    """The kernel's xor over each 4096-word block is stored only when it equals the magic value: a block built to
    hit it (its last word completing the xor, wherever the block ends) shows that every word was read."""
    probe = touch_module()
    g = torch.Generator().manual_seed(n)
    w = torch.randint(-1000, 1000, (n,), dtype=torch.int32, generator=g)
    last = min(n, probe.BLOCK) - 1  # the first block's last word
    w[last] = 0
    acc = 0
    for v in w[: last + 1].tolist():
        acc ^= v
    w[last] = 0x5A5A5A5A ^ acc
    w = w.to(device)
    before = w.clone()
    sink = probe._sink(w.device)
    sink.zero_()
    assert probe.l2_touch(w)
    assert torch.equal(w, before)
    assert int(sink.item()) == 0x5A5A5A5A  # the first block summed to the magic value: all of it was read
    w[0] += 1  # now no block hits it: nothing is written
    sink.zero_()
    assert probe.l2_touch(w)
    assert int(sink.item()) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_touch_takes_any_dtype_and_declines_what_it_cannot_read(device):
    probe = touch_module()
    for dtype, shape in ((torch.bfloat16, (5, 6)), (torch.float32, (3, 7)), (torch.uint8, (12,))):
        t = torch.ones(shape, dtype=dtype, device=device)
        assert probe.l2_touch(t, "evict_last")
        assert torch.equal(t, torch.ones_like(t))
    assert not probe.l2_touch(torch.ones(3, dtype=torch.bfloat16, device=device))  # 6 bytes: not whole words
    assert not probe.l2_touch(torch.ones(8, 8, device=device).t())  # not contiguous
    assert not probe.l2_touch(torch.ones(0, device=device))
