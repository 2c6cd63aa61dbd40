"""gpt-oss on a real GPU (GPU box): bf16 close to transformers' fp32 truth; CUDA-graph decode (sink attention and
sliding windows over the static cache, biased experts with the clamped SwiGLU in the grouped GEMMs) giving the
same tokens as eager decode, with all experts in VRAM and with hybrid experts (bf16, and mxfp4 packed from a
published-layout MXFP4 checkpoint)."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("transformers")

from hybrid.models import load_model  # noqa: E402
from hybrid.models.writer import write_random_checkpoint  # noqa: E402
from hybrid.offload.build import load_hybrid  # noqa: E402
from hybrid.offload.config import HybridConfig  # noqa: E402
from tiny_models import cuda_bf16_errors, eager_and_graph_tokens, hf_config, make_checkpoint  # noqa: E402

PROMPTS = [[5, 77, 3, 200, 41, 9, 17], [250, 1, 64], [9, 9, 31, 8, 100]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_gpu")
    # the published SwiGLU constants: older transformers (the box's) hard-code alpha 1.702 and may not read the
    # config's swiglu_limit (the CPU tests reach the clamp with transformers 5.24)
    return path, make_checkpoint("gpt_oss", path, seed=7, swiglu_limit=7.0, swiglu_alpha=1.702)


@pytest.fixture(scope="module")
def mxfp4_ckpt(tmp_path_factory):
    raw = hf_config("gpt_oss").to_dict()
    raw.pop("quantization_config", None)
    return write_random_checkpoint(tmp_path_factory.mktemp("gpt_oss_mxfp4_gpu"), raw, seed=3, std=0.1, mxfp4=True)


def test_bf16_cuda_close_to_reference(ckpt):
    err_ours, err_hf, _ = cuda_bf16_errors(*ckpt, PROMPTS[0] * 2)  # longer than the sliding window (4)
    assert err_ours <= 2 * err_hf + 1e-3, (err_ours, err_hf)


def test_cuda_graph_decode_matches_eager(ckpt):
    path, _ = ckpt
    model = load_model(path, device="cuda", dtype=torch.bfloat16, progress=False)
    eager, graphs, eng = eager_and_graph_tokens(model, PROMPTS)
    assert graphs == eager


@pytest.mark.parametrize("cpu_dtype", ["bf16", "mxfp4"])
def test_cuda_graph_decode_hybrid_experts(ckpt, mxfp4_ckpt, cpu_dtype):
    path = ckpt[0] if cpu_dtype == "bf16" else mxfp4_ckpt
    # schedule cpu: eager steps put cold experts on the CPU lane as captured ones do (same kernels, same tokens)
    hcfg = HybridConfig(gpu_experts=2, schedule="cpu", cpu_dtype=cpu_dtype, profile="ktransformers-paper-amx")
    model, off = load_hybrid(path, "cuda", torch.bfloat16, hcfg, progress=False)
    for layer in off.layers:
        layer.set_resident([0, 5])
        assert layer.cpu_moe.dtype == cpu_dtype
    eager, graphs, eng = eager_and_graph_tokens(model, PROMPTS)
    assert graphs == eager



@pytest.mark.parametrize("cpu_dtype", ["bf16", "mxfp4"])
def test_ship_lane_matches_cpu_lane(ckpt, mxfp4_ckpt, cpu_dtype):
    """Eager prefill logits with every cold expert shipped to the GPU (de-quantized there from the packed codes for
    mxfp4; biases and the clamped SwiGLU) against every cold expert on the CPU lane, in fp32: in bf16 a router
    near-tie picks another expert at a position or two (seen on the box and on the CPU alike), which says nothing
    about the lanes."""
    from hybrid.runtime import Engine

    path = ckpt[0] if cpu_dtype == "bf16" else mxfp4_ckpt
    logits = {}
    for schedule in ("cpu", "ship"):
        hcfg = HybridConfig(gpu_experts=2, schedule=schedule, cpu_dtype=cpu_dtype, cpu_isa="ref",
                            profile="ktransformers-paper-amx")
        model, off = load_hybrid(path, "cuda", torch.float32, hcfg, progress=False)
        for layer in off.layers:
            layer.set_resident([0, 5])
        prompt = PROMPTS[0] * 3
        logits[schedule] = Engine(model, max_batch=1, max_context=64, eager=True).forward(
            torch.tensor([prompt]), torch.arange(len(prompt))[None], torch.tensor([0]))[0].float().cpu()
    scale = logits["cpu"].abs().max().item()
    assert (logits["ship"] - logits["cpu"]).abs().max().item() <= 1e-3 * scale
