"""DeepSeek-V3 family on a real GPU (GPU box): bf16 close to transformers' fp32 truth, and CUDA-graph decode
over the MLA latent cache giving the same tokens as eager decode (plain and with hybrid experts). The same for
the GLM-4.5 family (its sigmoid router, shared experts and dense first layer; partial rotary over a K/V cache)."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("transformers")

from hybrid.models import load_model  # noqa: E402
from hybrid.offload.build import load_hybrid  # noqa: E402
from hybrid.offload.config import HybridConfig  # noqa: E402
from tiny_models import cuda_bf16_errors, eager_and_graph_tokens, make_checkpoint  # noqa: E402

PROMPTS = [[5, 77, 3, 200, 41, 9, 17], [250, 1, 64], [9, 9, 31, 8, 100]]


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def ckpt(tmp_path_factory, request):
    path = tmp_path_factory.mktemp(request.param + "_gpu")
    return path, make_checkpoint(request.param, path, seed=7)


def test_bf16_cuda_close_to_reference(ckpt):
    err_ours, err_hf, model = cuda_bf16_errors(*ckpt, PROMPTS[0])
    assert model.layers[1].moe.router.dtype == torch.float32  # the sigmoid router stays fp32
    assert err_ours <= 2 * err_hf + 1e-3, (err_ours, err_hf)


def test_cuda_graph_decode_with_latent_cache_matches_eager(ckpt):
    path, _ = ckpt
    model = load_model(path, device="cuda", dtype=torch.bfloat16, progress=False)
    eager, graphs, eng = eager_and_graph_tokens(model, PROMPTS)
    assert list(eng.cache.buffers) == (["latent"] if model.cfg.mla is not None else ["k", "v"])
    assert graphs == eager


def test_cuda_graph_decode_hybrid_experts(ckpt):
    path, _ = ckpt
    # schedule cpu: eager steps put cold experts on the CPU lane as captured ones do (same kernels, same tokens)
    hcfg = HybridConfig(gpu_experts=2, schedule="cpu", cpu_dtype="bf16", profile="ktransformers-paper-amx")
    model, off = load_hybrid(path, "cuda", torch.bfloat16, hcfg, progress=False)
    for layer in off.layers:
        layer.set_resident([0, 5])
    eager, graphs, eng = eager_and_graph_tokens(model, PROMPTS)
    assert graphs == eager


def _mla_logits(path, device, dtype, mode: str, prompt: list[int]) -> torch.Tensor:
    """A prompt prefilled in two passes (fresh, then over the cache), then three decode steps, every MLA layer
    attending in `mode`: the stacked logits (fp32, CPU)."""
    from hybrid.models.mla import MLAttention
    from hybrid.runtime import Engine

    model = load_model(path, device=device, dtype=dtype, progress=False)
    for layer in model.layers:
        if isinstance(layer.attn, MLAttention):
            layer.attn.mode = mode
    eng = Engine(model, max_batch=1, max_context=len(prompt) + 8, eager=True)
    slot = eng.allocate_slot()
    outs = [eng.prefill(slot, prompt[:40]), eng.prefill(slot, prompt[40:])]
    outs += [eng.decode_step([slot], [t])[0] for t in (3, 99, 180)]
    return torch.stack([o.float().cpu() for o in outs])


def test_absorbed_bf16_decode_over_a_long_cache_is_as_close_as_expanded(tmp_path):
    """The absorbed decode's fp32-output matrix products on CUDA in bf16, over a 300-key cache, against the fp32
    expanded form on the CPU: no further from it than the bf16 expanded form (SDPA) is. Every layer dense: a
    routed layer's top-k would turn a rounding difference into another expert's output."""
    path = tmp_path / "dsv3"
    make_checkpoint("deepseek_v3", path, seed=8, first_k_dense_replace=3)
    prompt = [(i * 37 + 11) % 250 for i in range(300)]
    truth = _mla_logits(path, "cpu", torch.float32, "expanded", prompt)
    err = {mode: (_mla_logits(path, "cuda", torch.bfloat16, mode, prompt) - truth).abs().max().item()
           for mode in ("expanded", "absorbed")}
    assert err["absorbed"] <= 2 * err["expanded"] + 1e-2, err
