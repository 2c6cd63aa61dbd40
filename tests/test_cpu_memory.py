"""Expert-weight buffers in 2 MiB pages (cpu_kernels/memory.py): the policy, the alignment, the advice, and that
the packed experts compute the same with either page size."""

import os

import pytest
import torch

from cpu_kernels import CpuMoE, knobs, memory


@pytest.fixture
def policy(monkeypatch):
    """Set HYBRID_HUGEPAGES for one test (the knobs and the policy are cached per process: cleared before and
    after)."""
    def set_(value):
        if value is None:
            monkeypatch.delenv("HYBRID_HUGEPAGES", raising=False)
        else:
            monkeypatch.setenv("HYBRID_HUGEPAGES", value)
        knobs.reset()
        memory.hugepages_wanted.cache_clear()
    yield set_
    knobs.reset()
    memory.hugepages_wanted.cache_clear()


@pytest.mark.parametrize("text,mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                       ("always madvise [never]", "never"), ("garbled", "")])
def test_thp_mode_reads_the_bracketed_word(tmp_path, text, mode):
    f = tmp_path / "enabled"
    f.write_text(text)
    assert memory.thp_mode(str(f)) == mode


def test_thp_mode_without_the_file(tmp_path):
    assert memory.thp_mode(str(tmp_path / "absent")) == ""


def test_policy_values(policy):
    policy(None)
    assert memory.hugepages_wanted() == os.uname().sysname.startswith("Linux")
    policy("0")
    assert memory.hugepages_wanted() is False
    policy("yes")
    with pytest.raises(ValueError, match="HYBRID_HUGEPAGES must be 0 or 1"):
        memory.hugepages_wanted()


@pytest.mark.skipif(not os.uname().sysname.startswith("Linux"), reason="madvise policy is Linux only")
def test_weight_buffer_is_aligned_and_advised(policy):
    policy("1")
    n = 5 * memory.HUGE + 12345  # a ragged size: the view still has exactly n bytes
    b = memory.weight_buffer(n)
    assert b.dtype == torch.uint8 and b.numel() == n and b.is_contiguous()
    assert b.data_ptr() % memory.HUGE == 0
    b[-1] = 7  # the whole view is writable memory of the allocation
    assert int(b[-1]) == 7
    if memory.thp_mode():  # a kernel with THP compiled in accepts the advice
        assert memory.advise_huge(memory.weight_buffer(2 * memory.HUGE).data_ptr(), 2 * memory.HUGE)


def test_advice_needs_a_whole_huge_page():
    base = torch.empty(3 * memory.HUGE, dtype=torch.uint8)
    start = base.data_ptr() + (-base.data_ptr() % memory.HUGE) + 4096
    assert memory.advise_huge(start, memory.HUGE - 8192) is False  # no whole 2 MiB page inside


def test_small_or_disabled_buffers_are_plain(policy):
    policy("1")
    assert memory.weight_buffer(4096).numel() == 4096
    policy("0")
    b = memory.weight_buffer(3 * memory.HUGE)
    assert b.numel() == 3 * memory.HUGE and b._base is None  # not a view into a larger allocation


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_page_size_changes_no_output(policy, dtype):
    g = torch.Generator().manual_seed(3)
    E, F, D = 24, 256, 512  # int4: 24 x 3 x 256 x 512 / 2 bytes = 4.5 MiB of packed experts, 2 huge pages or more
    ws = (torch.randn(E, F, D, generator=g) / D**0.5, torch.randn(E, F, D, generator=g) / D**0.5,
          torch.randn(E, D, F, generator=g) / F**0.5)
    x = torch.randn(4, D, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(4)]).to(torch.int32)
    w = torch.rand(4, 2, generator=g)
    outs = []
    for flag in ("0", "1"):
        policy(flag)
        moe = CpuMoE(*ws, dtype=dtype, threads=2)
        if flag == "1" and memory.hugepages_wanted() and moe.isa != "ref":  # the experts sit in the aligned buffer
            assert moe.packed_weights()[0]["block"].data_ptr() % memory.HUGE == 0
        outs.append(moe.forward(x, ids, w).clone())
    assert torch.equal(outs[0], outs[1])


def test_refused_advice_is_said_once_and_the_buffer_still_works(policy, monkeypatch, caplog):
    import logging

    policy("1")
    monkeypatch.setattr(memory, "_madvise", lambda: (lambda addr, n, advice: -1))  # a kernel without THP
    memory._warn_refused.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="cpu_kernels"):
            bufs = [memory.weight_buffer(3 * memory.HUGE) for _ in range(3)]
        said = [r for r in caplog.records if "MADV_HUGEPAGE) refused" in r.getMessage()]
        assert len(said) == 1
        for b in bufs:
            b.fill_(3)
            assert b.numel() == 3 * memory.HUGE and int(b.sum()) == 9 * memory.HUGE
    finally:
        memory._warn_refused.cache_clear()
