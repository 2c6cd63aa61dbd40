"""Quantized GPU weights on CUDA (run on the GPU box): each family's tiny checkpoint loaded in bf16 with int8, int4
or fp8 parts gives the logits of the bf16 model whose matrices are the de-quantized ones (within bf16
tolerance: the decode GEMV and the chunked de-quantizing GEMMs sum in another order than cuBLAS, up to the first
token whose routing that rounding flips), CUDA-graph
decode gives the eager tokens (the quantized GEMV is captured in the graphs), and the fused q/k/v path takes
quantized weights."""

from __future__ import annotations

import pytest
import torch

from tiny_models import FAMILIES, eager_and_graph_tokens, make_checkpoint

from hybrid.models import load_model
from hybrid.models.gpu_weights import PARTS, matrices
from hybrid.models.qweight import QWeight
from hybrid.runtime import Engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU box)")]
PROMPT = [3, 17, 42, 99, 5, 250, 7, 64]
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [200, 1, 64], [9] * 12]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        # bf16 values: the bf16 model holds the checkpoint's values exactly, so the loader (which quantizes the
        # file's values) and the reference (which quantizes the bf16 model's) quantize the same numbers
        make_checkpoint(family, path, bf16_values=True)
        out[family] = path
    return out


def logits(model, ids):
    eng = Engine(model, max_batch=1, max_context=32, eager=True)
    return eng.forward(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]))[0].float().cpu()


def logits_and_routes(model, ids):
    """The logits and, per MoE layer, each token's set of chosen experts (in prompt order)."""
    from bench.routing_realism import expert_choices

    with expert_choices(model) as seen:
        out = logits(model, ids)
    assert len(seen) == sum(layer.moe is not None for layer in model.layers)
    return out, [[frozenset(row) for row in torch.cat(seen[i]).tolist()] for i in sorted(seen)]


def first_routing_difference(a, b) -> int:
    """The first token position whose experts differ in any MoE layer (len of the prompt if none)."""
    T = len(a[0])
    return min([t for la, lb in zip(a, b) for t in range(T) if la[t] != lb[t]], default=T)


def independent_flips(a, b) -> int:
    """Differing choices that are not the consequence of another: per token, the first MoE layer whose experts
    differ (the token's later layers read that layer's changed output, so they are its consequence, not flips of
    their own)."""
    T = len(a[0])
    return sum(any(la[t] != lb[t] for la, lb in zip(a, b)) for t in range(T))


def dequantized_reference(path, dtypes):
    model = load_model(path, device="cuda", dtype=torch.bfloat16, progress=False)
    with torch.no_grad():
        for module, attr, _, part in matrices(model):
            if dtypes.get(part, "bf16") != "bf16":
                w = getattr(module, attr)
                w.copy_(QWeight.from_float(w.float(), dtypes[part]).dequantize(torch.bfloat16))
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_cuda_quantized_model_is_the_dequantized_model(checkpoints, family, kind):
    dtypes = {p: kind for p in PARTS}
    model = load_model(checkpoints[family], device="cuda", dtype=torch.bfloat16, progress=False, gpu_dtypes=dtypes)
    ref, ref_routes = logits_and_routes(dequantized_reference(checkpoints[family], dtypes), PROMPT)
    got, got_routes = logits_and_routes(model, PROMPT)
    # Routing is discontinuous: where two experts' scores nearly tie, the bf16 rounding of another summation order
    # can pick the other one, and that token's row (and, through attention, the later rows) then legitimately
    # differ. Nearly every choice must agree (a flip's consequences in the token's later layers are not counted
    # as flips of their own), and every row before the first differing choice must match.
    pairs = [(x, y) for la, lb in zip(ref_routes, got_routes) for x, y in zip(la, lb)]
    same = sum(x == y for x, y in pairs)
    flips = independent_flips(ref_routes, got_routes)
    rows = first_routing_difference(ref_routes, got_routes)
    err = float((got[:rows] - ref[:rows]).abs().max()) if rows else 0.0
    seen = dict(family=family, same_choices=f"{same} of {len(pairs)}", independent_flips=flips,
                first_difference=rows, err=err, bound=3e-2 * float(ref.abs().max()))
    assert len(pairs) - flips >= 0.9 * len(pairs), ("routing differs too often", seen)
    assert err <= 3e-2 * float(ref.abs().max()), seen
    # decode rows go through the quantized GEMV: one token at a time, the same logits as the prefill's rows where
    # the token routes as its prefill row did (a near tie may flip there too: then it is one more flip to count)
    from bench.routing_realism import expert_choices

    eng = Engine(model, max_batch=1, max_context=32, eager=True)
    eng.allocate_slot()
    eng.prefill(0, PROMPT[:-1])
    with expert_choices(model) as chosen:
        step = eng.decode_step([0], [PROMPT[-1]])[0].float().cpu()
    step_routes = [frozenset(chosen[i][0][0].tolist()) for i in sorted(chosen)]
    if step_routes == [layer[-1] for layer in got_routes]:
        assert float((step - got[-1]).abs().max()) <= 3e-2 * float(got[-1].abs().max())
    else:  # one more flip, unless it is the near tie that already flipped this token's prefill row
        again = any(la[-1] != lb[-1] for la, lb in zip(ref_routes, got_routes))
        assert len(pairs) - flips - (not again) >= 0.9 * len(pairs), ("routing differs too often", seen, "and at decode")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_cuda_graph_decode_equals_eager_with_quantized_weights(checkpoints, family, kind):
    model = load_model(checkpoints[family], device="cuda", dtype=torch.bfloat16, progress=False,
                       gpu_dtypes={p: kind for p in PARTS})
    eager, graphs, _ = eager_and_graph_tokens(model, PROMPTS)
    assert eager == graphs


