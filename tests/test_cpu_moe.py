"""Compiled CPU expert kernels vs the pure-PyTorch reference, for every ISA this machine can run.

Ragged loads (experts with 0, 1, 7, 300 and more tokens), T = 1 and 513, D and F that are multiples of
no tile; outputs pre-filled with NaN. int8/int4 are compared with the reference run on the weights
de-quantized independently here; the kernels also quantize activations per token (int8), which bounds
how close they can get: the tolerances below are ~2x what correct kernels show, far below what any
indexing or layout bug produces (errors of order 1).
"""

import threading

import pytest
import torch

import cpu_kernels
from cpu_kernels import CpuMoE, knee, quant
from cpu_kernels.moe import AMX_KNEE
from cpu_kernels.reference import moe_forward

ISAS = cpu_kernels.available_isas()
COMPILED = [i for i in ISAS if i != "ref"]
# (isa, amx_min_tokens): the AMX build is run with all experts on AMX, with the default knee, and with
# all experts on its AVX-512 vector path.
CASES = [pytest.param(i, 16, id=i) for i in ISAS if i != "amx"]
if "amx" in ISAS:
    CASES += [pytest.param("amx", k, id=f"amx-knee{k}", marks=pytest.mark.amx) for k in (1, 16, 10**9)]
# The AMX driver path with emulated tiles (any AVX2 host): covers packing/tiling logic where AMX is absent.
EMU = ["amx_emu"] if cpu_kernels._native.why_unavailable("amx_emu") is None else []
CASES += [pytest.param("amx_emu", k, id=f"amx_emu-knee{k}") for k in (1, 16) if EMU]
TOL = {"bf16": 1e-2, "int8": 4e-2, "int4": 4e-2}
E, F, D = 6, 97, 131


def weights(seed=0, e=E, f=F, d=D):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, f, d, generator=g) / d**0.5, torch.randn(e, f, d, generator=g) / d**0.5,
            torch.randn(e, d, f, generator=g) / f**0.5)


def ragged_routing(T, seed=0):
    """topk [T, 2]: slot 0 gives experts 0,1,2,3 exactly 300, 7, 1, 0 tokens (T=513), the rest to 4;
    slot 1 sends every token to 5. Tokens are shuffled."""
    g = torch.Generator().manual_seed(seed)
    first = torch.full((T,), 4, dtype=torch.int64)
    counts = [(0, 300), (1, 7), (2, 1)] if T >= 308 else [(2, 1)]
    pos = 0
    for e, c in counts:
        first[pos:pos + c] = e
        pos += c
    first = first[torch.randperm(T, generator=g)]
    ids = torch.stack([first, torch.full((T,), 5)], 1)
    w = torch.rand(T, 2, generator=g) + 0.1
    return ids, w


def dequantized(ws, dtype, group=128):
    if dtype == "bf16":
        return [w.bfloat16() for w in ws]
    if dtype == "int8":
        return [quant.dequantize_int8(*quant.quantize_int8(w)) for w in ws]
    out = []
    for w in ws:
        k = w.shape[-1]
        kp = (k + max(64, group) - 1) // max(64, group) * max(64, group)
        wp = torch.nn.functional.pad(w, (0, kp - k))
        out.append(quant.dequantize_int4(*quant.quantize_int4(wp, group), group)[..., :k])
    return out


def rel_err(y, r):
    return float((y.float() - r.float()).abs().max() / r.float().abs().max())


@pytest.mark.parametrize("isa,knee", CASES)
@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("T", [1, 513])
def test_matches_reference(isa, knee, dtype, T):
    ws = weights()
    moe = CpuMoE(*ws, dtype=dtype, isa=isa, amx_min_tokens=knee)
    assert moe.isa == isa and moe.nbytes > 0
    ids, w = ragged_routing(T)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = torch.full((T, D), float("nan"), dtype=torch.bfloat16)
    y = moe.forward(x, ids, w, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert not torch.isnan(y).any()
    ref = moe_forward(x, *dequantized(ws, dtype), ids, w)
    assert rel_err(y, ref) < TOL[dtype]


@pytest.mark.parametrize("isa", COMPILED)
@pytest.mark.parametrize("group", quant.GROUP_SIZES)
def test_int4_groups_fp32_input(isa, group):
    ws = weights(seed=2, f=150, d=200)
    moe = CpuMoE(*ws, dtype="int4", group_size=group, isa=isa)
    ids, w = ragged_routing(40, seed=3)
    x = torch.randn(40, 200, generator=torch.Generator().manual_seed(4))
    y = moe.forward(x, ids, w)
    assert y.dtype == torch.float32
    ref = moe_forward(x, *dequantized(ws, "int4", group), ids, w)
    assert rel_err(y, ref) < TOL["int4"]


@pytest.mark.parametrize("isa", COMPILED)
@pytest.mark.parametrize("activation", ["gelu", "swiglu_oai"])
def test_activations(isa, activation):
    ws = [w * 3 for w in weights(seed=5)]  # large enough that the SwiGLU clamp (7) is reached
    moe = CpuMoE(*ws, isa=isa, activation=activation)
    ids, w = ragged_routing(64, seed=6)
    x = torch.randn(64, D, generator=torch.Generator().manual_seed(7)).bfloat16()
    ref = moe_forward(x, *dequantized(ws, "bf16"), ids, w, activation=activation)
    assert rel_err(moe.forward(x, ids, w), ref) < TOL["bf16"]


@pytest.mark.parametrize("isa", ISAS)
def test_expert_mask_and_subset(isa):
    ws = weights(seed=8)
    ids, w = ragged_routing(513, seed=9)
    x = torch.randn(513, D, generator=torch.Generator().manual_seed(10)).bfloat16()
    mask = torch.tensor([True, False, True, True, False, True])
    full = CpuMoE(*ws, isa=isa)
    ref_masked = moe_forward(x, *dequantized(ws, "bf16"), ids, w, expert_mask=mask)
    y = full.forward(x, ids, w, expert_mask=mask)
    assert rel_err(y, ref_masked) < TOL["bf16"]
    assert rel_err(full.forward(x, ids, w), ref_masked) > 0.05  # the mask changed something
    # Only experts 0, 2, 5 held (cold experts of a layer); tokens routed elsewhere are skipped.
    held = [0, 2, 5]
    sub = CpuMoE(*[t[held].contiguous() for t in ws], isa=isa, expert_ids=held, num_experts=E)
    only = torch.zeros(E, dtype=torch.bool)
    only[held] = True
    ref_sub = moe_forward(x, *dequantized(ws, "bf16"), ids, w, expert_mask=only)
    assert rel_err(sub.forward(x, ids, w), ref_sub) < TOL["bf16"]
    both = only & mask
    ref_both = moe_forward(x, *dequantized(ws, "bf16"), ids, w, expert_mask=both)
    assert rel_err(sub.forward(x, ids, w, expert_mask=mask), ref_both) < TOL["bf16"]


@pytest.mark.parametrize("isa", ISAS)
def test_submit_from_threads(isa):
    ws = weights(seed=11)
    moe = CpuMoE(*ws, isa=isa, dtype="int8")
    jobs = []
    for s in range(6):
        ids, w = ragged_routing(100 + 37 * s, seed=s)
        jobs.append((torch.randn(100 + 37 * s, D, generator=torch.Generator().manual_seed(s)).bfloat16(), ids, w))
    expected = [moe.forward(*j) for j in jobs]
    results, errors, lock = [], [], threading.Lock()

    def worker(i):
        try:
            handles = [(k, moe.submit(*jobs[k])) for k in (i, (i + 3) % 6, (i + 5) % 6)]
            for k, h in handles:
                y = h.wait(timeout=120)
                with lock:
                    results.append((k, y))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 18
    for k, y in results:
        assert torch.equal(y, expected[k])  # same inputs, same kernels: bitwise equal


@pytest.mark.parametrize("isa", ISAS)
def test_host_job_is_forward_without_python(isa):
    """host_job: the C host function over the same buffers computes what forward does, bitwise, and a
    call the kernel refuses (an id out of range, written after the job was made) poisons out with NaN."""
    if isa == "ref":  # the reference runs in Python: there is no host function for it
        x, ids, w = torch.zeros(1, D).bfloat16(), torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 2)
        with pytest.raises(ValueError):
            CpuMoE(*weights(seed=13), isa=isa).host_job(x, ids, w, torch.empty_like(x))
        return
    ws = weights(seed=13)
    moe = CpuMoE(*ws, isa=isa, dtype="int8")
    T = 37
    ids, w = ragged_routing(T, seed=4)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(4)).bfloat16()
    mask = torch.rand(E, generator=torch.Generator().manual_seed(5)) < 0.6
    out = torch.full_like(x, float("nan"))
    ids32 = ids.to(torch.int32)
    job = moe.host_job(x, ids32, w.float().contiguous(), out, expert_mask=mask)
    job.run()
    assert job.runs == 1 and job.rc == 0 and job.failures == 0
    assert torch.equal(out, moe.forward(x, ids, w, expert_mask=mask))
    ids32[T // 2, 0] = E
    job.run()
    assert job.rc != 0 and job.failures == 1 and torch.isnan(out.float()).all()
    with pytest.raises(ValueError):
        moe.host_job(x, ids32, w.bfloat16(), out)  # weights must be fp32 (int64 ids are taken: test_doorbell_lane)
    with pytest.raises(ValueError):
        moe.host_job(x, ids32, w.float(), None)


@pytest.mark.parametrize("isa", ISAS)
def test_bad_input_raises(isa):
    ws = weights(seed=12)
    moe = CpuMoE(*ws, isa=isa)
    x = torch.randn(4, D).bfloat16()
    ids = torch.zeros(4, 2, dtype=torch.int64)
    w = torch.ones(4, 2)
    bad = [
        dict(x=torch.randn(4, D + 1).bfloat16()),                        # shape mismatch
        dict(ids=torch.full((4, 2), E, dtype=torch.int64)),              # id out of range
        dict(ids=torch.full((4, 2), -1, dtype=torch.int64)),
        dict(ids=torch.full((4, 2), 2**32 + 1, dtype=torch.int64)),      # would wrap to 1 as int32
        dict(ids=torch.full((4, 2), E, dtype=torch.int32)),
        dict(x=torch.randint(0, 3, (4, D))),                             # wrong dtype
        dict(ids=ids.float()),
        dict(x=torch.randn(D, 4).bfloat16().t()),                        # non-contiguous
        dict(w=torch.ones(2, 4).t()),
        dict(ids=torch.zeros(3, 2, dtype=torch.int64), w=torch.ones(3, 2)),
        dict(mask=torch.ones(E + 1, dtype=torch.bool)),
        dict(mask=torch.ones(E)),
        dict(out=torch.empty(4, D)),                                     # out dtype != x dtype
    ]
    for b in bad:
        with pytest.raises(ValueError):
            moe.forward(b.get("x", x), b.get("ids", ids), b.get("w", w), expert_mask=b.get("mask"), out=b.get("out"))
    with pytest.raises(ValueError):
        CpuMoE(ws[0], ws[1][:, :-1], ws[2], isa=isa)
    with pytest.raises(ValueError):
        CpuMoE(*ws, dtype="int4", group_size=48, isa=isa)
    with pytest.raises(ValueError):
        CpuMoE(*ws, dtype="fp8", isa=isa)
    with pytest.raises(ValueError):
        CpuMoE(ws[0].transpose(1, 2), ws[1], ws[2], isa=isa)
    assert torch.isfinite(moe.forward(x, ids, w)).all()  # still works after the errors


def test_unavailable_isa_is_loud(monkeypatch):
    from cpu_kernels import _native, knobs
    missing = [i for i in cpu_kernels.ISAS if i not in ISAS]
    for isa in missing:
        with pytest.raises(cpu_kernels.IsaUnavailable):
            CpuMoE(*weights(), isa=isa)
    monkeypatch.setenv("HYBRID_CPU_ISA", "ref")
    knobs.reset()
    _native.default_isa.cache_clear()
    try:
        assert CpuMoE(*weights()).isa == "ref"
        monkeypatch.setenv("HYBRID_CPU_ISA", "sse9")
        knobs.reset()
        _native.default_isa.cache_clear()
        with pytest.raises(cpu_kernels.IsaUnavailable):
            CpuMoE(*weights())
        for isa in missing:
            monkeypatch.setenv("HYBRID_CPU_ISA", isa)
            knobs.reset()
            _native.default_isa.cache_clear()
            with pytest.raises(cpu_kernels.IsaUnavailable):
                CpuMoE(*weights())
    finally:
        _native.default_isa.cache_clear()
    assert ISAS[-1] == "ref" and ISAS == [i for i in cpu_kernels.ISAS if i in ISAS]


def _quant_rows(v):
    """The kernels' per-token activation quantization, de-quantized again: round(v * 127/amax) * amax/127."""
    amax = v.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(v * inv).clamp(-127, 127) * (amax / 127.0)


def emulated(x, ws, ids, w, dtype):
    """Reference that also rounds activations the way the kernels do (bf16 h, or int8 x and h)."""
    wg, wu, wd = (t.float() for t in dequantized(ws, dtype))
    out = torch.zeros(x.shape[0], wd.shape[1])
    for e in torch.unique(ids).tolist():
        tok, kk = (ids == e).nonzero(as_tuple=True)
        xe = x[tok].float()
        xe = xe.bfloat16().float() if dtype == "bf16" else _quant_rows(xe)
        h = torch.nn.functional.silu(xe @ wg[e].T) * (xe @ wu[e].T)
        h = h.bfloat16().float() if dtype == "bf16" else _quant_rows(h)
        out.index_add_(0, tok, (h @ wd[e].T) * w[tok, kk][:, None])
    return out


@pytest.mark.parametrize("isa,knee", [c for c in CASES if c.values[0] != "ref"])
@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_kernel_arithmetic_tight(isa, knee, dtype):
    """With activation rounding emulated, only fp32 summation order differs: a tight bound that a wrong
    group scale, a lost tail or an off-by-one row would break. For int8 activations a different order
    can flip the rounding of a few h values by one step (seen: max error 2.2e-3 on AVX-512 int4), so
    there the max bound is looser and the mean error carries the tight check."""
    ws = weights(seed=13)
    moe = CpuMoE(*ws, dtype=dtype, isa=isa, amx_min_tokens=knee)
    ids, w = ragged_routing(513, seed=14)
    x = torch.randn(513, D, generator=torch.Generator().manual_seed(15))
    y, ref = moe.forward(x, ids, w), emulated(x, ws, ids, w, dtype)
    assert rel_err(y, ref) < (2e-3 if dtype == "bf16" else 1e-2)
    assert float((y - ref).abs().mean() / ref.abs().mean()) < 2e-4


@pytest.mark.parametrize("isa", COMPILED + EMU)
@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_numa_split_matches(isa, dtype):
    """Two (fake) NUMA nodes: F split in two slices, each run by its own pool, partials summed."""
    cpus = sorted(__import__("os").sched_getaffinity(0))
    topo = cpu_kernels.Topology(((cpus[0],), (cpus[-1],)))
    ws = weights(seed=16, f=300, d=D)
    moe = CpuMoE(*ws, dtype=dtype, isa=isa, topology=topo, group_size=64)
    assert len(moe._slices) == 2 and moe._slices[0][1] == moe._slices[1][0]
    ids, w = ragged_routing(513, seed=17)
    x = torch.randn(513, D, generator=torch.Generator().manual_seed(18)).bfloat16()
    ref = moe_forward(x, *dequantized(ws, dtype, 64), ids, w)
    y = moe.forward(x, ids, w)
    assert not torch.isnan(y).any() and rel_err(y, ref) < TOL[dtype]
    one = CpuMoE(*ws, dtype=dtype, isa=isa, topology=cpu_kernels.Topology(((cpus[0],),)), group_size=64)
    assert one.nbytes == pytest.approx(moe.nbytes, rel=0.1)  # split, not duplicated


@pytest.mark.parametrize("isa", ISAS)
def test_threads_empty_batch_and_knee(isa):
    ws = weights(seed=19)
    moe = CpuMoE(*ws, isa=isa, threads=1)
    assert moe.topology.threads == 1
    empty = moe.forward(torch.zeros(0, D).bfloat16(), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2))
    assert empty.shape == (0, D)
    ids, w = ragged_routing(40, seed=20)
    x = torch.randn(40, D, generator=torch.Generator().manual_seed(21)).bfloat16()
    ref = moe_forward(x, *dequantized(ws, "bf16"), ids, w)
    for knee in (1, 10**9):  # the knee only picks a path; results agree
        moe.set_amx_min_tokens(knee)
        assert rel_err(moe.forward(x, ids, w), ref) < TOL["bf16"]
    with pytest.raises(ValueError):
        moe.set_amx_min_tokens(0)
    with pytest.raises(ValueError):
        CpuMoE(*ws, isa=isa, threads=0)


@pytest.mark.parametrize("isa", COMPILED)
def test_read_bandwidth_and_profile(isa):
    from cpu_kernels import _native
    assert cpu_kernels.measure_read_bandwidth(1 << 24, isa=isa, repeats=1) > 0
    moe = CpuMoE(*weights(seed=22), isa=isa)
    ids, w = ragged_routing(16, seed=23)
    _native.profile_enable(isa)
    _native.profile_read(isa, reset=True)
    moe.forward(torch.randn(16, D).bfloat16(), ids, w)
    prof = _native.profile_read(isa, reset=True)
    _native.profile_enable(isa, False)
    assert prof["calls"] == 1 and all(prof[p] >= 0 for p in _native.PHASES)
    assert sum(prof[p] for p in _native.PHASES) > 0  # the call's phases were timed


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_packed_weights_are_the_plain_matrices(isa, dtype):
    """The one packed copy (what the GPU lane ships) de-quantizes to exactly the reference's weights."""
    ws = weights(seed=24)
    moe = CpuMoE(*ws, dtype=dtype, isa=isa, group_size=64)
    deq = dequantized(ws, dtype, 64)
    sl = moe.packed_weights()
    assert sl[0]["f0"] == 0 and sl[-1]["f1"] == F
    for s in sl:
        for name, full in zip(("gate", "up", "down"), deq):
            p = s[name]
            if p["dtype"] in ("bf16", "plain"):
                w = p["q"].float()
            elif p["dtype"] == "int8":
                w = quant.dequantize_int8(p["q"], p["scale"])
            else:
                w = quant.dequantize_int4(p["q"], p["scale"], p["group"], p["fold"])
            want = full[:, s["f0"]:s["f1"], :] if name != "down" else full[:, :, s["f0"]:s["f1"]]
            assert torch.equal(w[:, :p["rows"], :p["k"]], want.float())
            assert not w[:, p["rows"]:, :].any() and not w[:, :, p["k"]:].any()  # zero padding
        assert (s["block"] is not None) == (isa != "ref")
        if s["block"] is not None:  # expert-major: each expert's gate | up | down bytes, back to back
            qs = [s[name]["q"] for name in ("gate", "up", "down")]
            for e in (0, E - 1):
                whole = torch.cat([q[e].contiguous().view(torch.uint8).reshape(-1) for q in qs])
                assert torch.equal(s["block"][e], whole)


@pytest.mark.parametrize("isa", COMPILED)
def test_forked_child_still_computes(isa):
    """A child forked after the pools started has none of their threads: it must run the phases on the
    calling thread, not wait forever for workers that do not exist."""
    import os
    ws = weights(seed=25)
    moe = CpuMoE(*ws, isa=isa)
    ids, w = ragged_routing(64, seed=26)
    x = torch.randn(64, D, generator=torch.Generator().manual_seed(27)).bfloat16()
    expected = moe.forward(x, ids, w)
    pid = os.fork()
    if pid == 0:  # child: exit code says whether the result matched
        code = 1
        try:
            code = 0 if torch.equal(moe.forward(x, ids, w), expected) else 2
        finally:
            os._exit(code)
    import signal
    import time
    deadline = time.time() + 60
    while True:  # never hang the suite: a stuck child is killed and the test fails
        done, status = os.waitpid(pid, os.WNOHANG)
        if done or time.time() > deadline:
            break
        time.sleep(0.05)
    if not done:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("forked child did not finish within 60 s")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@pytest.mark.parametrize("isa,knee", [c for c in CASES if c.values[0] != "ref"])
@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_tile_multiple_width_bf16_rows_in_place(isa, knee, dtype):
    """D a multiple of 64 with bf16 tokens: the kernels read the token rows in place (no copy), here
    from a view that starts one row into a larger tensor; the input must come back unchanged."""
    d, f = 128, 192
    ws = weights(seed=28, f=f, d=d)
    moe = CpuMoE(*ws, dtype=dtype, isa=isa, amx_min_tokens=knee)
    ids, w = ragged_routing(513, seed=29)
    big = torch.randn(514, d, generator=torch.Generator().manual_seed(30)).bfloat16()
    x = big[1:]
    before = x.clone()
    out = torch.full((513, d), float("nan"), dtype=torch.bfloat16)
    y = moe.forward(x, ids, w, out=out)
    assert torch.equal(x, before) and not torch.isnan(y).any()
    assert rel_err(y, moe_forward(x, *dequantized(ws, dtype), ids, w)) < TOL[dtype]


# The AMX knee (the token count from which an expert runs on the tiles) comes from measured times, not a
# constant.


def test_knee_from_times():
    ms = [4, 8, 16, 32]
    # two measurements on the GPU box's host (235B shape, bf16, ms per call): AMX wins from 8 in one, from 16
    # in the other
    assert knee.knee_from_times(ms, [3.82, 4.86, 7.38, 12.45], [4.98, 4.52, 4.56, 5.03]) == 8
    assert knee.knee_from_times(ms, [4.70, 6.00, 9.26, 14.53], [6.01, 6.65, 5.78, 6.00]) == 16
    # int8: AMX slower at 8 and 16, faster only at 32
    assert knee.knee_from_times(ms, [3.91, 4.28, 4.48, 6.62], [6.21, 4.42, 4.63, 4.03]) == 32
    # one noisy win below a loss does not pull the knee down; never winning puts it past the sweep
    assert knee.knee_from_times(ms, [2, 2, 3, 4], [1, 3, 2, 3]) == 16
    assert knee.knee_from_times(ms, [1, 1, 1, 1], [2, 2, 2, 2]) == 64


def test_calibrated_knee_is_the_default(monkeypatch):
    monkeypatch.setattr(knee, "_DEFAULT", {})
    w = [torch.zeros(2, 8, 16), torch.zeros(2, 8, 16), torch.zeros(2, 16, 8)]
    assert cpu_kernels.CpuMoE(*w, dtype="bf16", isa="ref").amx_min_tokens == AMX_KNEE["bf16"]
    knee.set_default_knee({"bf16": 24, "int8": 40})
    assert cpu_kernels.CpuMoE(*w, dtype="bf16", isa="ref").amx_min_tokens == 24
    assert cpu_kernels.CpuMoE(*w, dtype="int8", isa="ref").amx_min_tokens == 40
    assert cpu_kernels.CpuMoE(*w, dtype="bf16", isa="ref", amx_min_tokens=3).amx_min_tokens == 3  # explicit wins
    knee.set_default_knee(None)  # a profile without a measured knee changes nothing
    assert cpu_kernels.CpuMoE(*w, dtype="bf16", isa="ref").amx_min_tokens == 24


def test_int4_takes_the_tiles_only_from_a_measured_knee(monkeypatch):
    """int4's AMX path has no box timing yet: unmeasured, its knee is out of reach; a calibrated one applies."""
    from cpu_kernels.moe import AMX_NEVER

    monkeypatch.setattr(knee, "_DEFAULT", {})
    w = [torch.zeros(2, 64, 64), torch.zeros(2, 64, 64), torch.zeros(2, 64, 64)]
    assert cpu_kernels.CpuMoE(*w, dtype="int4", isa="ref").amx_min_tokens == AMX_NEVER
    knee.set_default_knee({"int4": 12})
    assert cpu_kernels.CpuMoE(*w, dtype="int4", isa="ref").amx_min_tokens == 12
