"""The hybrid MoE layer against the reference MoE: every strategy, resident sets, CPU dtypes, ISAs."""

import time

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import cpu_kernels
from cpu_kernels.reference import moe_forward
from hybrid.offload import HybridExperts, Offload
from hybrid.offload.experts import add_resident_captured
from placement.cost_model import ExpertShape
from placement.hardware import BUILTIN_PROFILES
from placement.measure import torch_expert
from placement.memory import down_bytes, packed_expert_bytes
from placement.schedule import LayerScheduler

E, D, F_, K = 8, 96, 80, 2  # D, F not multiples of the kernels' tiles
AMX_BOX = BUILTIN_PROFILES["ktransformers-paper-amx"]
STRATEGIES = ["cost", "cpu", "ship", "threshold:4"]


def bf16_weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(torch.bfloat16).float()  # noqa: E731
    return mk(E, F_, D), mk(E, F_, D), mk(E, D, F_)


def routing(T, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    if skew:
        logits[:, :2] += 3.0
    w, ids = torch.softmax(logits, -1).topk(K, -1)
    return ids, w / w.sum(-1, keepdim=True)


def make_layer(strategy, resident=(), cpu_dtype="bf16", isa="ref", shape_scale=1.0):
    # Price the tiny expert as the 235B one so the cost model makes non-trivial splits.
    shape = ExpertShape("test", hidden=4096, intermediate=int(1536 * shape_scale), num_experts=E, topk=K)
    off = Offload("cpu", torch.float32, LayerScheduler(shape, AMX_BOX, strategy), cpu_dtype=cpu_dtype,
                  cpu_isa=isa, staging_slots=2, ship_chunk=3)  # 8 experts: chunks refill slots
    wg, wu, wd = bf16_weights()
    layer = HybridExperts(0, wg, wu, wd, off)
    layer.set_resident(resident)
    return layer, (wg, wu, wd)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("resident", [(), (0, 5), tuple(range(E))])
@pytest.mark.parametrize("T", [1, 7, 300])
def test_matches_reference(strategy, resident, T):
    layer, (wg, wu, wd) = make_layer(strategy, resident)
    x = torch.randn(T, D).to(torch.bfloat16).float()
    ids, w = routing(T, seed=T, skew=True)
    ref = moe_forward(x, wg, wu, wd, ids, w)
    out = layer(x, ids, w)
    assert out.shape == (T, D) and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_lanes_are_really_used():
    layer, _ = make_layer("ship", resident=(1,))
    ids, w = routing(64, seed=3)
    layer(torch.randn(64, D), ids, w)
    s = layer.stats
    assert s.shipped_experts == int((np.bincount(ids.flatten(), minlength=E) > 0).sum()) - 1
    assert s.cpu_experts == 0 and s.resident_experts == 1
    assert s.cpu_lane_calls == 0 and s.cpu_lane_start_s == 0.0
    layer2, _ = make_layer("cpu")
    t0 = time.perf_counter()
    layer2(torch.randn(64, D), ids, w)
    took = time.perf_counter() - t0
    assert layer2.stats.shipped_experts == 0 and layer2.stats.cpu_experts > 0
    assert layer2.stats.cpu_share == 1.0
    # when the CPU lane started, inside the call (what calibration reads as cpu_lane_start)
    assert layer2.stats.cpu_lane_calls == 1 and 0.0 < layer2.stats.cpu_lane_start_s < took


def test_cost_strategy_mixes_lanes_on_a_big_batch():
    layer, _ = make_layer("cost")
    ids = torch.arange(E).repeat(512)[: 512 * K].view(512, K)  # 128 tokens per expert
    w = torch.full(ids.shape, 0.5)
    layer(torch.randn(512, D), ids, w)
    assert layer.stats.cpu_experts > 0 and layer.stats.shipped_experts > 0


@pytest.mark.parametrize("cpu_dtype", ["int8", "int4", "q8_0", "q4_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs"])
def test_quantized_cpu_dtype_same_function_on_every_lane(cpu_dtype):
    """Resident and shipped experts are de-quantized from the CPU executor's bytes: all lanes agree (the GPU lanes
    here on the CPU, the same de-quantizers the GPU box runs on CUDA)."""
    isa = cpu_kernels.available_isas()[0]
    outs = []
    ids, w = routing(40, seed=1)
    x = torch.randn(40, D).to(torch.bfloat16).float()
    for strategy, resident in (("cpu", ()), ("ship", ()), ("cpu", tuple(range(E)))):
        layer, _ = make_layer(strategy, resident, cpu_dtype=cpu_dtype, isa=isa)
        outs.append(layer(x, ids, w))
    # Lanes differ only in accumulation order and the CPU kernels' on-the-fly activation quantization.
    for o in outs[1:]:
        assert (o - outs[0]).abs().max() / outs[0].abs().max() < 0.05
    layer, (wg, wu, wd) = make_layer("ship", cpu_dtype=cpu_dtype, isa=isa)
    g, u, d = layer.expert_weights(3)
    assert g.shape == (F_, D) and d.shape == (D, F_)
    if cpu_dtype in ("int8", "int4"):  # one scale per row / group: the rounding bound
        assert (g - wg[3]).abs().max() <= wg[3].abs().max() / (7 if cpu_dtype == "int4" else 127) * 0.51 + 1e-6


@pytest.mark.parametrize("isa", [i for i in cpu_kernels.available_isas() if i != "ref"])  # ref holds plain floats
def test_ship_lane_serves_layers_of_different_layouts(isa):
    """Layers whose experts sit in different packed layouts (a GGUF file's layer whose down keeps a dtype of its
    own) share one ship lane: chunks of one layer are staged and de-quantized in that layer's layout, chunks of the
    next in its own, the raw staging grows to the larger layout once, and every layer's shipped result is its CPU
    lane's."""
    ids, w = routing(40, seed=3)
    x = torch.randn(40, D).to(torch.bfloat16).float()
    downs = (None, "int8", None)  # the int8 down is the larger layout, met second
    outs = {}
    for strategy in ("cpu", "ship"):
        shape = ExpertShape("test", hidden=4096, intermediate=1536, num_experts=E, topk=K)
        off = Offload("cpu", torch.float32, LayerScheduler(shape, AMX_BOX, strategy), cpu_dtype="int4",
                      cpu_isa=isa, staging_slots=2, ship_chunk=3, group_size=32)
        wg, wu, wd = bf16_weights()
        layers = [HybridExperts(i, wg, wu, wd, off, down_dtype=d) for i, d in enumerate(downs)]
        outs[strategy] = [layer(x, ids, w) for layer in layers] + [layers[0](x, ids, w)]
        if strategy == "ship":
            assert all(layer.stats.shipped_experts > 0 for layer in layers)
            lane = off.ship_lane
            assert len(lane._layouts) == 2
            big = max(layout.nbytes for layout in lane._layouts.values())
            dense = 3 * F_ * D * 4
            assert lane._raw_cap == big and lane.vram_bytes == 2 * 3 * (dense + big)
            # ...which the planner's price of a staged expert's raw bytes covers (placement.memory.breakdown: the
            # executor's bytes, a few per-row extras more than the lane stages)
            priced = packed_expert_bytes(D, F_, "int4", [1], 32) - down_bytes(D, F_, "int4", [1], 32) \
                + down_bytes(D, F_, "int8", [1], 32)
            assert big <= priced < 1.05 * big
    for layer_i, (a, b) in enumerate(zip(outs["ship"], outs["cpu"])):
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < 2e-2, (layer_i, rel)  # the CPU kernels quantize activations on the fly
    assert not torch.equal(outs["ship"][0], outs["ship"][1])  # the int8 down is another function than int4's


@pytest.mark.parametrize("isa", [i for i in cpu_kernels.available_isas() if i != "ref"])
def test_compiled_cpu_lane(isa):
    layer, (wg, wu, wd) = make_layer("cpu", resident=(2,), isa=isa)
    ids, w = routing(33, seed=7)
    x = torch.randn(33, D).to(torch.bfloat16).float()
    ref = moe_forward(x, wg, wu, wd, ids, w)
    out = layer(x, ids, w)
    assert ((out - ref).abs().max() / ref.abs().max()) < 2e-2  # bf16 activations in the compiled kernels


def test_set_resident_validates():
    layer, _ = make_layer("cost")
    with pytest.raises(ValueError):
        layer.set_resident([E])
    layer.set_resident([3, 1])
    assert list(layer.resident_ids) == [1, 3] and layer.resident_bytes == 2 * 3 * F_ * D * 4


def test_memory_report():
    layer, _ = make_layer("ship")
    ids, w = routing(16, seed=2)
    layer(torch.randn(16, D), ids, w)
    mem = layer.offload.memory()
    assert mem["dram_expert_bytes"] == layer.cpu_moe.nbytes > 0
    assert mem["vram_staging_bytes"] > 0 and mem["vram_resident_bytes"] == 0


def test_unaligned_rows_take_the_expert_loop():
    """D*4 bytes not a multiple of 16: grouped GEMMs decline, the per-expert loop serves (same result)."""
    d = 90
    g = torch.Generator().manual_seed(4)
    wg, wu = (torch.randn(E, F_, d, generator=g) / d ** 0.5 for _ in range(2))
    wd = torch.randn(E, d, F_, generator=g) / F_ ** 0.5
    wg, wu, wd = (w.to(torch.bfloat16).float() for w in (wg, wu, wd))
    shape = ExpertShape("test", hidden=4096, intermediate=1536, num_experts=E, topk=K)
    off = Offload("cpu", torch.float32, LayerScheduler(shape, AMX_BOX, "ship"), cpu_isa="ref", ship_chunk=3)
    layer = HybridExperts(0, wg, wu, wd, off)
    layer.set_resident([1, 6])
    x = torch.randn(50, d, generator=g).to(torch.bfloat16).float()
    ids, w = routing(50, seed=9)
    torch.testing.assert_close(layer(x, ids, w), moe_forward(x, wg, wu, wd, ids, w), atol=2e-5, rtol=1e-4)


def test_core_split_between_executor_and_launcher(monkeypatch):
    """On CUDA the executor's pool gets all cores but one and the launching thread the rest: pinned there
    during each layer call (launcher_pinned), its own affinity back afterwards. The split itself is plain
    logic, checked on a fake object."""
    import os
    import threading
    import types

    from hybrid.offload.shared import _PROCESS_CPUS

    if len(_PROCESS_CPUS) < 2:
        pytest.skip("needs two cpus")
    from cpu_kernels import knobs

    fake = types.SimpleNamespace(lane_cpus=None, _launcher_cpus=None)
    monkeypatch.setenv("HYBRID_CORE_SPLIT", "0")
    knobs.reset()
    Offload._split_cores(fake, None)
    assert fake.lane_cpus is None and fake._launcher_cpus is None  # neither thread pinned
    monkeypatch.delenv("HYBRID_CORE_SPLIT")
    knobs.reset()
    topo = Offload._split_cores(fake, None)  # the default: both pinned
    pool = {c for n in topo.nodes for c in n}
    assert pool and fake._launcher_cpus and not pool & fake._launcher_cpus
    assert pool | fake._launcher_cpus == set(_PROCESS_CPUS) and fake.lane_cpus == {min(pool)}
    assert len(fake._launcher_cpus) == 1  # all cores but one to the executor
    seen = {}

    def launcher():  # a thread of its own, so the test runner's affinity is untouched
        seen["before"] = os.sched_getaffinity(0)
        with Offload.launcher_pinned(fake):
            seen["inside"] = os.sched_getaffinity(0)
        seen["after"] = os.sched_getaffinity(0)

    t = threading.Thread(target=launcher)
    t.start()
    t.join()
    assert seen["inside"] == fake._launcher_cpus and not seen["inside"] & pool
    assert seen["after"] == seen["before"] == set(_PROCESS_CPUS)


@pytest.mark.parametrize("isa", cpu_kernels.available_isas())
def test_host_function_runs_the_cpu_lane_experts(isa):
    """The body of the host-function CPU lane (what CUDA's callback thread runs), called here through the
    same (function pointer, argument) pair cuLaunchHostFunc gets: the masked experts only, into the pinned
    buffers; a failure poisons the output with NaN and is counted instead of raising."""
    import ctypes

    from hybrid.offload.host_lane import HostFnLane

    layer, (wg, wu, wd) = make_layer("cost", resident=(0, 3), isa=isa)
    lane = HostFnLane(torch.device("cpu"))
    T = 9
    ids, w = routing(T, seed=11)
    xh, ih, wh, oh, _ = lane.buffers(T, D, K, torch.float32)
    xh.copy_(torch.randn(T, D).to(torch.bfloat16).float())
    ih.copy_(ids)
    wh.copy_(w)
    oh.fill_(float("nan"))
    mask = torch.ones(E, dtype=torch.bool)
    mask[[0, 3]] = False
    fn, arg, jid = lane.job(layer, xh, ih, wh, oh, mask, captured=True)
    assert jid == 0  # no CUDA stream: no doorbell lane, the host function runs the job
    call = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fn)
    call(arg)
    ref = moe_forward(xh, wg, wu, wd, ids, w, expert_mask=mask)
    tol = dict(atol=2e-5, rtol=1e-4) if isa == "ref" else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(oh, ref, **tol)
    assert lane.failures == 0
    ih[4, 1] = E  # out of range: the executor refuses the call
    call(arg)
    assert lane.failures == 1 and torch.isnan(oh).all()


def test_host_lane_buffers_keep_what_graphs_hold_and_replace_the_rest():
    """Decode-sized buffers (what a graph captures) survive growth; prefill-sized ones are replaced."""
    from hybrid.offload.host_lane import HostFnLane

    lane = HostFnLane(torch.device("cpu"))
    small = lane.buffers(8, D, K, torch.float32)
    assert [tuple(t.shape) for t in small] == [(8, D), (8, K), (8, K), (8, D), (8, D)]
    assert small[1].dtype == torch.int32 and small[2].dtype == torch.float32
    grown = lane.buffers(lane.MAX_ROWS, D, K, torch.float32)[0]
    assert grown.data_ptr() != small[0].data_ptr() and lane.bufs._old  # the old one is kept alive
    big = lane.buffers(lane.MAX_ROWS + 1, D, K, torch.float32)
    assert big[0].shape == (lane.MAX_ROWS + 1, D)
    assert lane.buffers(8, D, K, torch.float32)[0].data_ptr() == grown.data_ptr()  # small calls: graph buffers
    lane.buffers(4 * lane.MAX_ROWS, D, K, torch.float32)
    assert not lane.big._old  # replaced, not kept


def test_host_lane_skips_the_re_arm_only_where_no_id_rings_twice_in_a_row():
    """Captured steps drop the doorbell's re-arm write only with two or more CPU-lane layers (each rings its
    own id, so consecutive rings differ) and no expert deferral; outside a capture there is nothing for a
    router kernel to write in place."""
    import types

    from hybrid.offload.host_lane import HostFnLane

    def model(cold_per_layer, defer=0):
        off = types.SimpleNamespace(defer=defer, layers=[])
        off.layers = [types.SimpleNamespace(offload=off, cold_ids=np.arange(n)) for n in cold_per_layer]
        return off.layers[0]

    assert HostFnLane._rings_differ(model([3, 5]))
    assert HostFnLane._rings_differ(model([0, 4, 4]))
    assert not HostFnLane._rings_differ(model([4, 0]))  # one CPU-lane layer: the same id every ring
    assert not HostFnLane._rings_differ(model([4, 4], defer=1))
    assert not HostFnLane._rings_differ(types.SimpleNamespace())  # no offload to ask
    layer, _ = make_layer("cpu", resident=(), isa=cpu_kernels.available_isas()[0])
    assert HostFnLane(torch.device("cpu")).inputs_in_place(layer, 1, D, K, torch.float32) is None


def test_core_split_can_be_turned_off(monkeypatch):
    import types

    from cpu_kernels import knobs

    monkeypatch.setenv("HYBRID_CORE_SPLIT", "0")
    knobs.reset()
    fake = types.SimpleNamespace(lane_cpus=None, _launcher_cpus=None)
    topo = Offload._split_cores(fake, None)
    assert fake.lane_cpus is None and fake._launcher_cpus is None and topo.threads >= 1


class _CopyCount(TorchDispatchMode):
    """Counts aten copy_ calls (the copies a lane issues)."""

    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.copy_:
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("isa", [i for i in cpu_kernels.available_isas() if i != "ref"])
def test_ship_lane_moves_an_expert_in_one_copy(isa):
    """bf16 packed weights without padding on one node: each shipped expert is one copy of its gate | up |
    down block, and the chunk's dense weights are strided views of the staging block, bitwise the
    executor's packed bytes; the layer on the ship lane computes what the CPU lane does."""
    from hybrid.offload.lanes import ShipLane
    from hybrid.offload.sources import expert_weights, packed_sources

    e, d, f = 8, 128, 64  # multiples of the packing tiles: no padding
    g = torch.Generator().manual_seed(11)
    wg, wu, wd = (torch.randn(*s, generator=g).to(torch.bfloat16) / 8 for s in ((e, f, d), (e, f, d), (e, d, f)))
    moe = cpu_kernels.CpuMoE(wg, wu, wd, isa=isa)
    sources = packed_sources(moe)
    assert len(sources) == 1 and sources[0].whole_block()
    lane = ShipLane(torch.device("cpu"), n_slots=2, chunk=3)
    lane.fetch(sources, [0], (f, d), torch.bfloat16)  # lays out the slots
    with _CopyCount() as copies:
        slot = lane.fetch(sources, [5, 1, 6], (f, d), torch.bfloat16)
    assert copies.n == 3  # one per expert
    assert lane.one_copy and lane.vram_bytes == 2 * 3 * 3 * f * d * 2  # dense chunks only, no raw staging
    got = lane.weights(sources, slot, torch.bfloat16)
    assert all(t.untyped_storage().data_ptr() == slot.block.untyped_storage().data_ptr() for t in got)  # views
    for j, ex in enumerate([5, 1, 6]):
        for mat, want in zip(got, (wg[ex], wu[ex], wd[ex])):
            assert torch.equal(mat[j], want)
    shape = ExpertShape("test", hidden=4096, intermediate=1536, num_experts=e, topk=K)
    x = torch.randn(40, d, generator=g).to(torch.bfloat16)
    w, ids = torch.softmax(torch.randn(40, e, generator=g), -1).topk(K, -1)
    outs = {}
    for strategy in ("cpu", "ship"):
        off = Offload("cpu", torch.bfloat16, LayerScheduler(shape, AMX_BOX, strategy), cpu_isa=isa, staging_slots=2,
                      ship_chunk=3)
        layer = HybridExperts(0, wg, wu, wd, off)
        assert all(torch.equal(a, b[3]) for a, b in zip(expert_weights(sources, 3, "cpu", torch.bfloat16), (wg, wu, wd)))
        outs[strategy] = layer(x, ids, w).float()
        assert (layer.stats.shipped_experts > 0) == (strategy == "ship")
        if strategy == "ship":
            assert off.ship_lane.one_copy  # the layer's own lane took the one-copy path
    rel = ((outs["ship"] - outs["cpu"]).norm() / outs["cpu"].norm()).item()
    assert rel < 2e-2, rel  # bf16 activations on both lanes, different accumulation orders


# Captured decode's resident-expert merge on the CPU. add_resident_captured sorts a step's assignments by
# resident slot, has the grouped GEMM compute only the resident rows, and must keep exactly those: the rows
# after them (cold experts' assignments) are never computed, so here they hold NaN, as uninitialised GEMM
# output might.

CAP_E, CAP_D, CAP_F = 8, 16, 12


def _capture_experts(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = ((CAP_F, CAP_D), (CAP_F, CAP_D), (CAP_D, CAP_F))
    return [tuple(torch.randn(*s, generator=g) / 4 for s in shapes) for _ in range(CAP_E)]


def _grouped(weights, resident, calls):
    """grouped(rows, offs): group j (rows offs[j-1]:offs[j]) through resident expert resident[j]; rows past
    offs[-1] are left NaN, as the real grouped GEMM leaves them uncomputed."""

    def run(rows, offs):
        calls.append(offs.tolist())
        y = torch.full_like(rows, float("nan"))
        start = 0
        for j, end in enumerate(offs.tolist()):
            if end > start:
                y[start:end] = torch_expert(rows[start:end], *weights[resident[j]])
            start = end
        return y

    return run


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("resident", [[5, 2, 7], [0], list(range(CAP_E))], ids=["three", "one", "all"])
def test_resident_merge_keeps_exactly_the_resident_rows(seed, resident):
    g = torch.Generator().manual_seed(100 + seed)
    T, K = 5, 3
    x = torch.randn(T, CAP_D, generator=g)
    ids = torch.stack([torch.randperm(CAP_E, generator=g)[:K] for _ in range(T)])  # [T, K] distinct per token
    w = torch.rand(T, K, generator=g)
    rank = torch.full((CAP_E,), len(resident), dtype=torch.long)
    rank[resident] = torch.arange(len(resident))
    weights = _capture_experts(seed)
    calls = []
    out = torch.zeros(T, CAP_D)
    add_resident_captured(out, x, ids, w, rank, len(resident), _grouped(weights, resident, calls))

    expect = torch.zeros(T, CAP_D)
    n_res = 0
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if e in resident:
                n_res += 1
                expect[t] += w[t, k] * torch_expert(x[t:t + 1], *weights[e])[0]
    assert calls and calls[0][-1] == n_res  # the GEMM was asked for the resident rows only
    assert torch.isfinite(out).all()  # no cold (uncomputed) row leaked in
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6)
    if len(resident) < CAP_E:
        assert n_res < T * K  # the case really had cold rows to drop
