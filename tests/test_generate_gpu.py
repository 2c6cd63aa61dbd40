"""GPU-only checks (run on the GPU box): CUDA-graph decode equals eager decode, the grouped-GEMM
expert executor equals a per-expert loop on CUDA, and a checkpoint loaded onto the GPU in bf16 stays
within bf16 tolerance of transformers' fp32 logits."""

from __future__ import annotations

import pytest
import torch

from hybrid.models import StackedExperts, build_empty, init_random_
from hybrid.models.families import family_for
from hybrid.models.presets import hf_config
from hybrid.runtime import Engine
from hybrid.runtime.config import RuntimeConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU box)")]


def tiny_model(dtype=torch.bfloat16):
    raw = hf_config("demo", layers=2)
    cfg = family_for(raw).parse_config(raw)
    return init_random_(build_empty(cfg, "cuda", dtype), seed=0, std=0.1)


def test_graph_decode_matches_eager():
    model = tiny_model()
    prompts = [torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 17, 9)]
    graph = Engine(model, max_batch=4, max_context=64, eager=False)
    eager = Engine(model, max_batch=4, max_context=64, eager=True)
    assert graph.graphs is not None and eager.graphs is None
    # Logits of one decode step on slots out of order (3 rows run in the 4-row bucket).
    for e in (graph, eager):
        for s, p in zip((2, 0, 1), prompts):
            e.allocate_slot()
            e.lengths[s] = 0
            e.prefill(s, p)
    lg = graph.decode_step([2, 0, 1], [5, 6, 7]).clone()
    le = eager.decode_step([2, 0, 1], [5, 6, 7])
    assert (lg - le).abs().max().item() <= 2e-2 * le.abs().max().item()
    for e in (graph, eager):
        for s in (0, 1, 2):
            e.free_slot(s)
    a = graph.generate(prompts, 24, stop_token_ids=[])
    b = eager.generate(prompts, 24, stop_token_ids=[])
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert graph.graphs.graphs  # graphs were captured and used


def test_graph_steps_queued_without_a_sync_match_eager():
    """DecodeGraphs.step queued back to back, no host sync between: each step's page-locked staging rows are
    rewritten only after the previous copy has read them, so every step sees its own inputs. The eager steps run
    first: Engine.decode_step synchronises the device, which between the graph steps would hide a missing guard."""
    model = tiny_model()
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25]]
    graph = Engine(model, max_batch=2, max_context=64, eager=False)
    eager = Engine(model, max_batch=2, max_context=64, eager=True)
    for e in (graph, eager):
        for s, p in enumerate(prompts):
            e.allocate_slot()
            e.prefill(s, p)
    graph.graphs.prepare(2, [5, 5])  # capture outside the queued steps
    steps = ([5, 6], [7, 8], [9, 10])
    expect = [eager.decode_step([0, 1], toks).clone() for toks in steps]
    # No sync between the graph steps: each clone is queued behind its replay.
    queued = [graph.graphs.step(toks, [len(prompts[0]) + i, len(prompts[1]) + i], [0, 1]).clone()
              for i, toks in enumerate(steps)]
    torch.cuda.synchronize()
    for lg, le in zip(queued, expect):
        assert (lg - le).abs().max().item() <= 2e-2 * le.abs().max().item()


def test_graph_decode_ahead_matches_step_by_step():
    """Greedy generation with graph steps queued one ahead (fed on the device: argmax ids and positions + 1 written
    by the graph itself) gives the tokens of graph steps fed by the host one at a time, also when a stop token ends
    one row while the others run on and when more prompts than slots change the batch."""
    model = tiny_model()
    ps = [torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 17, 9, 5, 12)]
    on = Engine(model, config=RuntimeConfig(max_batch=3, max_context=64, eager=False))
    off = Engine(model, config=RuntimeConfig(max_batch=3, max_context=64, eager=False, decode_ahead=False))
    assert on.decode_ahead and not off.decode_ahead
    free = off.generate(ps, 16, stop_token_ids=[])
    stop = free[1].token_ids[5]
    a = on.generate(ps, 16, stop_token_ids=[stop])
    b = off.generate(ps, 16, stop_token_ids=[stop])
    assert [(r.token_ids, r.finish_reason) for r in a] == [(r.token_ids, r.finish_reason) for r in b]
    assert b[1].finish_reason == "stop" and len(b[1].token_ids) == 5
    # a chain of fed steps straight through DecodeGraphs: the same tokens as host-fed steps
    slots = [on.allocate_slot() for _ in range(2)]
    first = [int(on.prefill(s, p).argmax()) for s, p in zip(slots, ps[:2])]
    queued = [on.decode_queue(slots, first)] + [on.decode_queue(slots) for _ in range(6)]
    chain = [q.tokens() for q in queued]
    for s in slots:
        on.free_slot(s)
    slots = [off.allocate_slot() for _ in range(2)]
    toks, ref = [int(off.prefill(s, p).argmax()) for s, p in zip(slots, ps[:2])], []
    for _ in range(7):
        toks = off.decode_step(slots, toks).argmax(-1).tolist()
        ref.append(toks)
    assert chain == ref


def test_graph_decode_across_context_buckets_matches_eager():
    """Sequences that grow past the 256-position context bucket: the graphs of two context buckets (the second
    captured mid-generation) give the eager tokens, and so do graphs over the whole cache."""
    model = tiny_model()
    prompts = [torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (240, 250)]
    engines = {name: Engine(model, config=RuntimeConfig(max_batch=2, max_context=600, eager=name == "eager",
                                                        context_buckets=name != "whole"))
               for name in ("buckets", "whole", "eager")}
    out = {name: [r.token_ids for r in e.generate(prompts, 24, stop_token_ids=[])] for name, e in engines.items()}
    assert out["buckets"] == out["eager"] and out["whole"] == out["eager"]
    assert {L for _, L in engines["buckets"].graphs.graphs} == {256, 512}
    assert {L for _, L in engines["whole"].graphs.graphs} == {600}


@pytest.mark.parametrize("mode", ["grouped", "dense"])
def test_expert_paths_match_loop_on_cuda(mode):
    E, D, F = 8, 256, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    w = [torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16) * 0.05 for s in ((E, F, D), (E, F, D), (E, D, F))]
    ex = StackedExperts.from_weights(*w)
    ex.mode = mode
    assert ex.capturable
    x = torch.randn(37, D, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E - 2, (37, 2), device="cuda", generator=g)  # experts 6, 7 get no tokens
    ids[:, 1] = (ids[:, 0] + 1) % (E - 2)
    wts = torch.rand(37, 2, device="cuda", generator=g)
    out = ex(x, ids, wts).float()
    ref = torch.zeros(37, D, device="cuda")
    wg, wu, wd = (t.float() for t in w)
    for t in range(37):
        for k in range(2):
            e = int(ids[t, k])
            h = torch.nn.functional.silu(wg[e] @ x[t].float()) * (wu[e] @ x[t].float())
            ref[t] += wts[t, k] * (wd[e] @ h)
    assert (out - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


def test_checkpoint_on_gpu_bf16_close_to_transformers(tmp_path):
    pytest.importorskip("transformers")
    from hybrid.models import load_model
    from tiny_models import hf_logits, make_checkpoint

    hf = make_checkpoint("qwen3_moe", tmp_path, seed=3)
    p = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    truth = hf_logits(hf, p)
    hf_bf16 = hf_logits(hf.to(torch.bfloat16), p)
    model = load_model(tmp_path, device="cuda", dtype=torch.bfloat16, progress=False)
    e = Engine(model, max_batch=1, max_context=32)
    ours = e.forward(torch.tensor([p]), torch.arange(len(p))[None], torch.tensor([0]))[0].cpu()
    err_hf = (hf_bf16 - truth).abs().max().item()
    assert (ours - truth).abs().max().item() <= 2 * err_hf + 1e-3


def test_generate_json_reports_the_device_memory_after_each_start_up_step(tmp_path, capsys):
    """`generate --json` on CUDA: the device's memory after loading the weights, the KV cache, placing residents,
    the warm-up (graph capture) and the generation, in that order; torch's peak only grows, and the device's used
    memory (nvidia-smi's figure) holds at least what torch reserved."""
    import json

    from bench.make_checkpoint import main as make
    from hybrid.cli import main

    assert make(["--preset", "demo", "--layers", "2", "--out", str(tmp_path)]) == 0  # with its tokenizer
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path), "--device", "cuda", "-n", "4", "--gpu-experts", "2",
                 "--profile", "ktransformers-paper-amx", "--json"]) == 0
    phases = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["vram"]
    assert [p["phase"] for p in phases] == ["weights", "kv_cache", "residents", "warm_up", "generated"]
    peaks = [p["peak_allocated"] for p in phases]
    assert peaks == sorted(peaks) and peaks[0] > 0
    assert all(p["device_used"] >= p["reserved"] >= p["allocated"] > 0 for p in phases)
