"""bench/plan_eval runs end to end on the CPU (a smoke test: the numbers mean nothing here)."""

import json


def test_plan_eval_smoke(tmp_path):
    from bench.plan_eval import main
    from hybrid.models.presets import hf_config
    from hybrid.models.writer import write_random_checkpoint

    cfg = hf_config("demo")
    cfg.update(vocab_size=128, num_hidden_layers=2, eos_token_id=None, pad_token_id=None)
    ckpt = write_random_checkpoint(tmp_path / "ckpt", cfg, seed=2, std=0.1)
    assert main(["--model", str(ckpt), "--steps", "8", "--window", "2", "--max-context", "48", "--prompt", "8",
                 "--profile-tokens", "96", "--reserve", "0", "--cpu-isa", "ref", "--out", str(tmp_path / "out")]) == 0
    res = json.loads((tmp_path / "out" / "plan_eval.json").read_text())
    budgets = res["budgets"]
    assert len(budgets) == 3
    assert [sum(b["resident_per_layer"]) for b in budgets] == sorted(sum(b["resident_per_layer"]) for b in budgets)
    assert all(b["plan_gpu_bytes"] <= b["gpu_budget_bytes"] and b["measured_decode_tokens_per_s"] > 0 for b in budgets)
    assert all(b["predicted_on_seen_routing_tokens_per_s"] > 0 and 0.0 <= b["cold_share_seen"] <= 1.0
               and 0.0 <= b["cold_share_profiled"] <= 1.0 for b in budgets)
    # more resident experts leave less of the profiled routing to the cold ones
    assert [b["cold_share_profiled"] for b in budgets] == sorted((b["cold_share_profiled"] for b in budgets), reverse=True)
    assert all(b["prefill_tokens"] == 47 and b["measured_prefill_tokens_per_s"] > 0 for b in budgets)
    assert set(res["shift"]) >= {"static", "online", "second_half_online_vs_static"}
    assert len(res["shift"]["static"]["per_window"]) == 8
