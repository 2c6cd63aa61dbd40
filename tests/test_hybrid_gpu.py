"""The hybrid layer on a real GPU: pinned packed weights, copy-stream staging, CPU lane overlap (GPU box)."""

import pytest
import torch

import cpu_kernels
from cpu_kernels.reference import moe_forward
from hybrid.offload import HybridExperts, Offload
from placement.cost_model import ExpertShape
from placement.hardware import BUILTIN_PROFILES
from placement.schedule import LayerScheduler

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

E, D, F_, K = 16, 512, 384, 4


def demo_checkpoint(tmp_path, layers: int, seed: int):
    """A random demo-shaped checkpoint (vocab 256, no EOS); std 0.1 keeps greedy tokens away from ties."""
    from hybrid.models.presets import hf_config
    from hybrid.models.writer import write_random_checkpoint

    cfg = hf_config("demo")
    cfg.update(vocab_size=256, num_hidden_layers=layers, eos_token_id=None, pad_token_id=None)
    return write_random_checkpoint(tmp_path / "ckpt", cfg, seed=seed, std=0.1)


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*s, generator=g) / s[-1] ** 0.5).to(torch.bfloat16) for s in ((E, F_, D), (E, F_, D), (E, D, F_))]


def layer_for(strategy, resident, cpu_dtype="bf16", slots=2):
    shape = ExpertShape("t", hidden=4096, intermediate=1536, num_experts=E, topk=K)
    off = Offload("cuda", torch.bfloat16, LayerScheduler(shape, BUILTIN_PROFILES["ktransformers-paper-amx"], strategy),
                  cpu_dtype=cpu_dtype, staging_slots=slots)
    wg, wu, wd = weights()
    layer = HybridExperts(0, wg, wu, wd, off)
    layer.set_resident(resident)
    return layer, (wg, wu, wd)


@pytest.mark.parametrize("strategy", ["cost", "cpu", "ship", "threshold:16"])
@pytest.mark.parametrize("resident", [(), (1, 4, 9), tuple(range(E))])
@pytest.mark.parametrize("T", [1, 33, 700])
def test_gpu_layer_matches_reference(strategy, resident, T):
    layer, (wg, wu, wd) = layer_for(strategy, resident)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    w, ids = torch.softmax(torch.randn(T, E, generator=g), -1).topk(K, -1)
    ref = moe_forward(x.float(), wg.float(), wu.float(), wd.float(), ids, w)
    out = layer(x.cuda(), ids.cuda(), w.cuda())
    torch.cuda.synchronize()
    assert out.is_cuda and out.dtype == torch.bfloat16
    rel = ((out.float().cpu() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel  # bf16 operands on every lane


def test_packed_weights_are_pinned_once():
    layer, _ = layer_for("ship", ())
    mem = layer.offload.memory()
    assert mem["pinned_bytes"] >= layer.cpu_moe.nbytes * 0.99  # the one DRAM copy, page-locked in place
    assert mem["vram_staging_bytes"] == 0  # nothing shipped yet
    ids = torch.arange(E).repeat(8)[: 32 * K].view(32, K).cuda()
    layer(torch.randn(32, D, device="cuda", dtype=torch.bfloat16), ids, torch.full((32, K), 0.25, device="cuda"))
    lane = layer.offload.ship_lane  # n_slots chunks of `chunk` experts, bf16
    assert 0 < layer.offload.memory()["vram_staging_bytes"] <= lane.n_slots * lane.chunk * 3 * D * F_ * 2


@pytest.mark.parametrize("cpu_dtype", ["int8", "int4", "q8_0", "q4_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs"])
def test_quantized_ship_lane_on_gpu(cpu_dtype):
    """The ship lane de-quantizes the CPU executor's packed bytes on the GPU (hybrid.offload.sources): the same
    layer's output as on the CPU lane, for each quantized dtype's layout."""
    outs = []
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, D, generator=g).to(torch.bfloat16).cuda()
    w, ids = torch.softmax(torch.randn(64, E, generator=g), -1).topk(K, -1)
    for strategy in ("cpu", "ship"):
        layer, _ = layer_for(strategy, (), cpu_dtype=cpu_dtype)
        outs.append(layer(x, ids.cuda(), w.cuda()).float())
    assert ((outs[0] - outs[1]).norm() / outs[0].norm()).item() < 3e-2


def test_eager_cpu_lane_host_function_matches_worker_thread():
    """Eager calls run the CPU lane as a native host function (no GIL); the Python worker lane (the `ref`
    ISA's) agrees, over more calls than the lane keeps jobs for."""
    g = torch.Generator().manual_seed(6)
    outs = {}
    for host in (True, False):
        layer, _ = layer_for("cpu", (2, 5))
        if not host:  # the same compiled kernel, called from the worker lane
            layer.offload.uses_host_lane = lambda _layer: False
        res = []
        for T in [1, 7, 64, 300] * 20:
            x = torch.randn(T, D, generator=g).to(torch.bfloat16)
            w, ids = torch.softmax(torch.randn(T, E, generator=g), -1).topk(K, -1)
            res.append(layer(x.cuda(), ids.cuda(), w.cuda()).float().cpu())
        lane = layer.offload._host_lane
        assert (lane is not None and lane.failures == 0 and len(lane._eager_jobs) > 0) == host
        outs[host] = res
        g.manual_seed(6)
    for a, b in zip(outs[True], outs[False]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # same kernel, same inputs: bit-identical


def test_compiled_isa_is_used_on_the_box():
    layer, _ = layer_for("cpu", ())
    assert layer.cpu_moe.isa == cpu_kernels.available_isas()[0] != "ref"


def test_captured_decode_matches_eager(tmp_path):
    """Decode in CUDA graphs (CPU lane as a host function) against eager decode of the same hybrid model."""
    from hybrid.offload.build import load_hybrid
    from hybrid.offload.config import HybridConfig
    from hybrid.runtime.engine import Engine
    from hybrid.runtime.sampling import SamplingParams

    ckpt = demo_checkpoint(tmp_path, layers=3, seed=3)
    prompts = [[5, 17, 99, 3, 250, 41, 7], [200, 1, 64], [9] * 12]
    outs, logits = [], []
    for eager in (True, False):
        hcfg = HybridConfig(gpu_experts=4, schedule="cost", profile="ktransformers-paper-amx")
        model, off = load_hybrid(ckpt, "cuda", torch.bfloat16, hcfg, progress=False)
        for layer in off.layers:
            layer.set_resident([0, 3, 5, 9])
        eng = Engine(model, None, max_batch=4, max_context=64, eager=eager)
        assert (eng.graphs is None) == eager
        res = eng.generate(prompts, max_new_tokens=8, sampling=SamplingParams(temperature=0), stop_token_ids=[])
        outs.append([r.token_ids for r in res])
        slots = [eng.allocate_slot() for _ in range(2)]
        for s in slots:
            eng.prefill(s, [1, 2, 3])
        logits.append(eng.decode_step(slots, [4, 5]).float().clone())
        if not eager:
            assert any(layer.captured for layer in off.layers) and off.host_lane.failures == 0
    assert outs[0] == outs[1]
    assert ((logits[0] - logits[1]).norm() / logits[0].norm()).item() < 2e-2


@pytest.mark.parametrize("resident", [0, 4])
def test_doorbell_graphs_match_host_function_graphs(tmp_path, monkeypatch, resident):
    """Captured decode with the doorbell lane (mapped inputs and output, stream memory operations) gives the
    greedy tokens the host-function lane gives (its fallback, as when the doorbell lane is full), and the
    doorbell lane really served the captured layers."""
    from hybrid.offload.build import load_hybrid
    from hybrid.offload.config import HybridConfig
    from hybrid.runtime.engine import Engine
    from hybrid.runtime.sampling import SamplingParams

    from hybrid import gpu_kernels
    from hybrid.offload.host_lane import HostFnLane

    ckpt = demo_checkpoint(tmp_path, layers=3, seed=4)
    runs = {}
    calls = {"packed": 0, "in_place": 0}
    real_pack, real_in_place = HostFnLane._write_packed, HostFnLane.inputs_in_place

    def packed(self, *a, **k):
        calls["packed"] += 1
        return real_pack(self, *a, **k)

    def in_place(self, *a, **k):
        got = real_in_place(self, *a, **k)
        calls["in_place"] += got is not None
        return got

    monkeypatch.setattr(HostFnLane, "_write_packed", packed)
    monkeypatch.setattr(HostFnLane, "inputs_in_place", in_place)
    real_doorbell = HostFnLane.doorbell
    for bell in ("1", "0"):
        # "0": no doorbell lane takes a job, so every step falls back to host functions and copies
        monkeypatch.setattr(HostFnLane, "doorbell", real_doorbell if bell == "1" else lambda self, isa: None)
        model, off = load_hybrid(ckpt, "cuda", torch.bfloat16, HybridConfig(gpu_experts=resident, schedule="cpu"),
                                 progress=False)
        eng = Engine(model, None, max_batch=4, max_context=64)
        res = eng.generate([[5, 17, 99, 3], [200, 1, 64, 7, 8]], max_new_tokens=12,
                           sampling=SamplingParams(temperature=0), stop_token_ids=[])
        lane = off.host_lane
        served = sum(b.served for b in lane._doorbells.values())
        runs[bell] = ([r.token_ids for r in res], served, lane.failures)
    (tok1, served1, fail1), (tok0, served0, fail0) = runs["1"], runs["0"]
    assert served1 > 0 and served0 == 0 and fail1 == fail0 == 0
    assert tok1 == tok0
    if gpu_kernels.fused_enabled(torch.zeros(1, device="cuda")):
        # the softmax router's kernel wrote every captured layer's lane inputs: no packing kernel was captured
        assert calls["in_place"] > 0 and calls["packed"] == 0


@pytest.mark.parametrize("resident,defer", [(0, 2), (4, 2), (0, 1)])
def test_deferred_experts_in_graphs_match_eager(tmp_path, resident, defer):
    """Expert deferral in decode graphs (the deferred CPU job on its own stream and doorbell, joined by the next
    layer) computes what eager deferral computes; one deferred expert per token makes the routing's column
    slices strided."""
    from hybrid.offload.build import load_hybrid
    from hybrid.offload.config import HybridConfig
    from hybrid.runtime.engine import Engine
    from hybrid.runtime.sampling import SamplingParams

    ckpt = demo_checkpoint(tmp_path, layers=4, seed=6)
    runs = []
    for eager in (True, False):
        model, off = load_hybrid(ckpt, "cuda", torch.bfloat16,
                                 HybridConfig(gpu_experts=resident, schedule="cpu", defer_experts=defer), progress=False)
        eng = Engine(model, None, max_batch=4, max_context=64, eager=eager)
        res = eng.generate([[5, 17, 99, 3], [200, 1, 64, 7, 8]], max_new_tokens=10,
                           sampling=SamplingParams(temperature=0), stop_token_ids=[])
        slots = [eng.allocate_slot() for _ in range(2)]
        for s in slots:
            eng.prefill(s, [1, 2, 3])
        logits = eng.decode_step(slots, [4, 5]).float().clone()
        runs.append(([r.token_ids for r in res], logits, off))
    (tok_e, log_e, _), (tok_g, log_g, off_g) = runs
    assert off_g.host_lane.failures == 0 and off_g.host_lane._deferred_wait is None
    assert tok_e == tok_g
    assert ((log_e - log_g).norm() / log_e.norm()).item() < 2e-2
