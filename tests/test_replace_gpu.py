"""Online re-placement on a real GPU: the copy runs on a copy stream, lands between calls, and the
layer still computes the same function (GPU box; written without one, not yet run there)."""

import numpy as np
import pytest
import torch

from cpu_kernels.reference import moe_forward
from hybrid.offload import HybridExperts, Offload
from hybrid.offload.replace import OnlineReplacer
from placement.cost_model import ExpertShape
from placement.hardware import BUILTIN_PROFILES
from placement.replace import ReplaceConfig
from placement.schedule import LayerScheduler

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

E, D, F_, K = 16, 512, 384, 4


@pytest.mark.parametrize("cpu_dtype", ["bf16", "int8"])
def test_copy_stream_swap_matches_reference(cpu_dtype):
    hw = BUILTIN_PROFILES["ktransformers-paper-amx"]
    shape = ExpertShape("t", hidden=D, intermediate=F_, num_experts=E, topk=K)
    off = Offload("cuda", torch.bfloat16, LayerScheduler(shape, hw, "cpu"), cpu_dtype=cpu_dtype)
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(*s, generator=g) / s[-1] ** 0.5).to(torch.bfloat16) for s in ((E, F_, D), (E, F_, D), (E, D, F_))]
    layer = HybridExperts(0, *ws, off)
    layer.set_resident([0, 1])
    off.replacer = OnlineReplacer(off, shape, shape, hw, ReplaceConfig(window=32, slices=4))  # N_min = 14 here
    x = torch.randn(64, D, generator=g).to("cuda", torch.bfloat16)
    ids = torch.tensor([[5, 6 + t % 3, 9 + t % 3, 12 + t % 3] for t in range(64)], device="cuda")  # 5 is hottest
    wts = torch.full((64, 4), 0.25, device="cuda")
    for _ in range(200):
        layer(x, ids, wts)
        if off.replacer.stats.landed:
            break
    torch.cuda.synchronize()
    assert off.replacer.stats.landed == 1 and layer.is_resident[5]
    ref_w = [layer.expert_weights(e, device="cpu", dtype=torch.float32) for e in range(E)]
    stack = [torch.stack([w[i] for w in ref_w]) for i in range(3)]
    want = moe_forward(x.float().cpu(), *stack, ids.cpu(), wts.cpu())
    got = layer(x, ids, wts).float().cpu()
    assert np.isfinite(got.numpy()).all()
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
