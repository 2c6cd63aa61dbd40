"""Hand-picked mutations that the tests must catch: a check that the tests can fail where it matters.

    python tests/mutation_survey.py            # every mutation (C++ ones rebuild the kernels: ~1 min each)
    python tests/mutation_survey.py --python   # only the Python ones (seconds each)
    python tests/mutation_survey.py --only int4

Each mutation is a one-line change a plausible bug would make (an off-by-one at a limit, a dropped term, a
wrong lane index) and the test files that should see it. The survey copies the repository into a temporary
directory, applies one mutation at a time there (the working tree is never touched), rebuilds the compiled
kernels when a C++ file changed, and runs the tests. A mutation the tests do not fail is a gap: the survey
exits 1 and names it. Every entry was a survivor once (or guards code whose bugs other tests let through) and
has a test now; add one when you find a gap, together with the test that closes it.

This is not part of the CI command (the C++ half needs ~15 minutes on two cores).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_TESTS = ["tests/test_cpu_moe.py", "tests/test_cpu_decode_path.py", "tests/test_cpu_int4_order.py",
             "tests/test_cpu_int4_amx.py", "tests/test_cpu_mxfp4.py", "tests/test_cpu_moe_bias.py",
             "tests/test_cpu_activation.py"]

# (name, file, old, new, tests)
MUTATIONS = [
    ("int4 lane -> group index", "cpu_kernels/csrc/kern_avx512.h", "__builtin_ctz(L)));  // lane -> group",
     "__builtin_ctz(L) + 1));  // lane -> group", ["tests/test_cpu_int4_order.py"]),
    ("int4 one 4-row pass: sums in memory skip the old value", "cpu_kernels/csrc/kern_avx512.h",
     "_mm512_fmadd_ps(x, s, _mm512_load_ps(m[j][t]))", "_mm512_fmadd_ps(x, s, _mm512_setzero_ps())",
     ["tests/test_cpu_decode_path.py"]),
    ("int4 token pairs: second pass reads the wrong tokens", "cpu_kernels/csrc/kern_avx512.h",
     "i4_rows<4, MT - 2, B>(w, ldw, k, group, fold, rows + 2,", "i4_rows<4, MT - 2, B>(w, ldw, k, group, fold, rows + 1,",
     ["tests/test_cpu_decode_path.py"]),
    ("int4 token pairs (natural order): second pass writes over the first", "cpu_kernels/csrc/kern_avx512.h",
     "i4_rows_g<4, MT - 2, GS>(w, ldw, k, rows + 2, sw, C + 2 * ldc,", "i4_rows_g<4, MT - 2, GS>(w, ldw, k, rows + 2, sw, C + ldc,",
     ["tests/test_cpu_decode_path.py"]),
    ("int4 activation reorder skipped", "cpu_kernels/csrc/driver.h",
     "std::memcpy(row + 4 * P, q + 4 * N, 4);", "std::memcpy(row + 4 * P, q + 4 * P, 4);", ["tests/test_cpu_int4_order.py"]),
    ("int4 AMX unpack ignores the order", "cpu_kernels/csrc/kern_amx.h", "  if (!nat) {\n    for (int kc",
     "  if (true) {\n    for (int kc", ["tests/test_cpu_int4_order.py"]),
    ("int4 AVX2 high-half group index", "cpu_kernels/csrc/kern_avx2.h", "const __m256i ihi = fold == 16 ? lane :",
     "const __m256i ihi = fold == 8 ? lane :", ["tests/test_cpu_int4_order.py"]),
    ("int4 B tiles not reordered", "cpu_kernels/csrc/driver.h", "      if (t < m && reorder) {",
     "      if (t < m && false) {", ["tests/test_cpu_int4_order.py"]),
    ("int4 offset of the high lanes", "cpu_kernels/csrc/kern_avx512.h",
     "const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi32(3), _mm256_set1_epi32(7), 1);",
     "const __m512i shl = _mm512_set1_epi32(3);", ["tests/test_cpu_int4_order.py"]),
    ("abs max: the vector lanes' max dropped", "cpu_kernels/csrc/driver.h",
     "  for (float x : l) amax = std::max(amax, x);", "  for (float x : l) amax = std::min(amax, x);",
     ["tests/test_cpu_activation.py"]),
    ("abs max: the tail's last value skipped", "cpu_kernels/csrc/driver.h",
     "  for (; i < n; ++i) amax = std::max(amax, std::fabs(v[i]));",
     "  for (; i < n - 1; ++i) amax = std::max(amax, std::fabs(v[i]));", ["tests/test_cpu_activation.py"]),
    ("token rows: a preparation task's last token not written", "cpu_kernels/csrc/driver.h",
     "t < std::min(T, task * per + per); ++t) prep_token(t);", "t < std::min(T, task * per + per) - 1; ++t) prep_token(t);",
     ["tests/test_cpu_decode_path.py"]),
    ("int8 row-sum offset", "cpu_kernels/csrc/kern_avx512.h", "- 128 * rsum[j]) * sw[j]", "- 127 * rsum[j]) * sw[j]",
     CPU_TESTS),
    ("mxfp4 code offset", "cpu_kernels/csrc/kern_avx512.h", "const __m512i twelve = _mm512_set1_epi8(12);",
     "const __m512i twelve = _mm512_set1_epi8(11);", CPU_TESTS),
    ("down bias outside the weight", "cpu_kernels/csrc/driver.h", "dst[r] += w * (c[r] + bd[r]);",
     "dst[r] += w * c[r] + bd[r];", CPU_TESTS),
    ("routing weight dropped (fused)", "cpu_kernels/csrc/fused.h", "        const float w = wt[i];",
     "        const float w = 1.0f;", CPU_TESTS),
    ("activation rounding truncates", "cpu_kernels/csrc/driver.h",
     "q[i] = (int8_t)std::nearbyint(std::min(127.f, std::max(-127.f, v[i] * inv)));",
     "q[i] = (int8_t)(std::min(127.f, std::max(-127.f, v[i] * inv)));", CPU_TESTS),
    ("fast_exp one term short", "cpu_kernels/csrc/hy.h",
     "f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));", "f * (1.0f / 24 + f * (1.0f / 120)))));",
     ["tests/test_cpu_activation.py"]),
    ("pf_rows clamp floor", "cpu_kernels/csrc/api.h", "g_pf_rows = std::min(64, std::max(8, value / 4 * 4));",
     "g_pf_rows = std::min(64, std::max(4, value / 4 * 4));", ["tests/test_cpu_decode_path.py"]),
    ("HYBRID_INT4_ORDER ignored", "cpu_kernels/moe.py", "self.int4_order = int4_order or _int4_order_env() or (",
     "self.int4_order = int4_order or (", ["tests/test_cpu_int4_order.py"]),
    ("prefill repeats: first run kept", "bench/hybrid_e2e.py", "                dt = statistics.median(runs)",
     "                dt = runs[0]", ["tests/test_e2e_cpu_only_sizes.py"]),
    ("planner: DRAM need exactly fits", "placement/planner.py", "    if mem.cpu_total > settings.cpu_budget:",
     "    if mem.cpu_total >= settings.cpu_budget:", ["tests/test_plan_planner.py"]),
    ("planner: dtype hint exclusive", "placement/planner.py",
     "breakdown(cfg, replace(s, cpu_dtype=d)).cpu_total <= settings.cpu_budget]",
     "breakdown(cfg, replace(s, cpu_dtype=d)).cpu_total < settings.cpu_budget]", ["tests/test_plan_planner.py"]),
    ("engine: KV need exactly free", "hybrid/runtime/engine.py", "    if need > free:", "    if need >= free:",
     ["tests/test_engine_limits.py"]),
    ("engine: slot id one past the batch", "hybrid/runtime/engine.py", "not 0 <= slot < self.max_batch:",
     "not 0 <= slot <= self.max_batch:", ["tests/test_engine_limits.py"]),
    ("engine: prompt fills the context", "hybrid/runtime/engine.py", "        if start + n > self.max_context:",
     "        if start + n >= self.max_context:", ["tests/test_engine_limits.py"]),
    ("engine: decode at the last position", "hybrid/runtime/engine.py",
     "        positions = [self.lengths[s] for s in slots]\n        if max(positions) >= self.max_context:\n"
     "            raise ValueError(f\"a slot reached max_context {self.max_context}\")\n        t0 = time.perf_counter()\n"
     "        if self.graphs is not None and self.graphs.prepare(",
     "        positions = [self.lengths[s] for s in slots]\n        if max(positions) > self.max_context:\n"
     "            raise ValueError(f\"a slot reached max_context {self.max_context}\")\n        t0 = time.perf_counter()\n"
     "        if self.graphs is not None and self.graphs.prepare(", ["tests/test_engine_limits.py"]),
    ("engine: a queued step past the last position", "hybrid/runtime/engine.py",
     "        if max(positions) >= self.max_context:\n            raise ValueError(f\"a slot reached max_context {self.max_context}\")\n"
     "        fed = last_tokens is None",
     "        if max(positions) > self.max_context:\n            raise ValueError(f\"a slot reached max_context {self.max_context}\")\n"
     "        fed = last_tokens is None", ["tests/test_decode_ahead.py"]),
    ("server: a prompt of the whole context", "hybrid/server/routes.py", "    if prompt_len >= context:",
     "    if prompt_len > context:", ["tests/test_server_limits.py"]),
    ("server: max_tokens exactly the room", "hybrid/server/routes.py", "    if req.max_tokens > room:",
     "    if req.max_tokens >= room:", ["tests/test_server_limits.py"]),
    ("server: token id == vocabulary size", "hybrid/server/routes.py",
     "bad = [t for t in p if not 0 <= t < runtime.vocab_size]", "bad = [t for t in p if not 0 <= t <= runtime.vocab_size]",
     ["tests/test_server_limits.py"]),
    ("server: batched prefill fills a slot", "hybrid/server/adapter.py",
     "            if start + len(chunk) > eng.max_context:", "            if start + len(chunk) >= eng.max_context:", ["tests/test_server_limits.py"]),
    ("server: histogram bound exclusive", "hybrid/server/metrics.py", "            if value <= upper:",
     "            if value < upper:", ["tests/test_server_limits.py"]),
    ("server: tokens/s window doubled", "hybrid/server/metrics.py",
     "while self._recent and self._recent[0][0] < now - TOKENS_PER_S_WINDOW_S:",
     "while self._recent and self._recent[0][0] < now - 2 * TOKENS_PER_S_WINDOW_S:", ["tests/test_server_limits.py"]),
    ("server: stop list one short", "hybrid/server/schemas.py", "    if len(items) > MAX_STOP_STRINGS:",
     "    if len(items) >= MAX_STOP_STRINGS:", ["tests/test_server_limits.py"]),
    ("server: integer upper bound exclusive", "hybrid/server/schemas.py", "    if hi is not None and v > hi:",
     "    if hi is not None and v >= hi:", ["tests/test_server_limits.py"]),
    ("split: a count at the table length", "placement/split_search.py",
     "        if hist[i] >= cpu_t.shape[0]:\n            return -1, 0.0, 0.0",
     "        if hist[i] > cpu_t.shape[0]:\n            return -1, 0.0, 0.0", ["tests/test_split_search.py"]),
    ("split: a tie ships more", "placement/split_search.py", "        if span < best:", "        if span <= best:", ["tests/test_split_search.py"]),
    ("lane_times: a count at the table length", "placement/split_search.py", "        if m >= cpu_t.shape[0]:",
     "        if m > cpu_t.shape[0]:", ["tests/test_split_search.py"]),
    ("table_sum: a count at the table length", "placement/split_search.py",
     "        if hist[i] >= table.shape[0]:\n            return -1.0", "        if hist[i] > table.shape[0]:\n            return -1.0",
     ["tests/test_split_search.py"]),
    ("topology: 9 nodes allowed", "cpu_kernels/topology.py", "        if len(nodes) > 8:", "        if len(nodes) > 9:", ["tests/test_cpu_quant_topology.py"]),
    ("topology: limit fills the smallest node first", "cpu_kernels/topology.py",
     "order = sorted(range(len(self.nodes)), key=lambda i: -len(self.nodes[i]))",
     "order = sorted(range(len(self.nodes)), key=lambda i: len(self.nodes[i]))", ["tests/test_cpu_quant_topology.py"]),
    ("build: deferring every expert allowed", "hybrid/offload/build.py",
     "if hcfg.defer_experts and hcfg.defer_experts >= cfg.experts_per_token:",
     "if hcfg.defer_experts and hcfg.defer_experts > cfg.experts_per_token:", ["tests/test_hybrid_model.py"]),
    ("build: a budget of exactly the fixed part refused", "hybrid/offload/build.py",
     "    if left < 0:\n        raise UsageError(f\"--gpu-budget", "    if left <= 0:\n        raise UsageError(f\"--gpu-budget", ["tests/test_hybrid_model.py"]),
    ("config: every expert per token refused", "hybrid/models/config.py",
     "        if self.experts_per_token > self.num_experts:", "        if self.experts_per_token >= self.num_experts:", ["tests/test_config_edges.py"]),
    ("config: two rotary dims refused", "hybrid/models/config.py", "        if rot < 2 or rot % 2:",
     "        if rot <= 2 or rot % 2:", ["tests/test_config_edges.py"]),
    ("config: groups exactly holding k refused", "hybrid/models/config.py",
     "            if r.topk_group * (self.num_experts // r.n_group) < self.experts_per_token:",
     "            if r.topk_group * (self.num_experts // r.n_group) <= self.experts_per_token:", ["tests/test_config_edges.py"]),
    ("config: a one-token window refused", "hybrid/models/config.py",
     "        if self.sliding_window is not None and self.sliding_window < 1:",
     "        if self.sliding_window is not None and self.sliding_window <= 1:", ["tests/test_config_edges.py"]),
    ("detok: a stop string at index 0 missed", "hybrid/server/detok.py", "for s in self._stop) if i >= 0]",
     "for s in self._stop) if i > 0]", ["tests/test_server_units.py"]),
    ("shape: every expert per token refused", "placement/cost_model.py", "        if self.topk > self.num_experts:",
     "        if self.topk >= self.num_experts:", ["tests/test_shape_stats_edges.py"]),
    ("active experts: K == E refused", "placement/cost_model.py",
     "    if num_experts <= 0 or topk <= 0 or tokens < 0 or topk > num_experts:",
     "    if num_experts <= 0 or topk <= 0 or tokens < 0 or topk >= num_experts:", ["tests/test_shape_stats_edges.py"]),
    ("routing: every expert per token refused", "placement/routing_stats.py", "not 1 <= self.topk <= self.num_experts:",
     "not 1 <= self.topk < self.num_experts:", ["tests/test_shape_stats_edges.py"]),
    ("routing: exactly MAX_TOKENS refused", "placement/routing_stats.py",
     "        if self.tokens > MAX_TOKENS or self.window_tokens > MAX_TOKENS:",
     "        if self.tokens >= MAX_TOKENS or self.window_tokens >= MAX_TOKENS:", ["tests/test_shape_stats_edges.py"]),
    ("crossover tie ships", "placement/cost_model.py", "t_gpu(shape, hw, m) < t_cpu(shape, hw, m, kernel)",
     "t_gpu(shape, hw, m) <= t_cpu(shape, hw, m, kernel)", ["tests/test_cost_model.py"]),
    ("zero-token expert shipped", "placement/schedule.py", "        ship = np.asarray(ship, dtype=bool) & (hist > 0)",
     "        ship = np.asarray(ship, dtype=bool)", ["tests/test_schedule.py"]),
    ("replace: a tie extends the streak", "placement/replace.py", "                if by_slice[s, c] > by_slice[s, v]:",
     "                if by_slice[s, c] >= by_slice[s, v]:", ["tests/test_replace_policy.py"]),
    ("replace: slices from the oldest", "placement/replace.py", "        tail = per_batch[W - n_slices * cfg.slice_len:]",
     "        tail = per_batch[:n_slices * cfg.slice_len]", ["tests/test_replace_policy.py"]),
    ("replace: saving not capped by ship", "placement/replace.py",
     "        return np.minimum(cpu_compute_time(cpu_shape, hw, m), np.where(m > 0, tau, 0.0) + g) - g",
     "        return cpu_compute_time(cpu_shape, hw, m) - g", ["tests/test_replace_policy.py"]),
    ("routing: prefill share, no prompt", "placement/routing_stats.py",
     "        if self.decode_counts is None or self.decode_tokens == self.tokens:", "        if self.decode_counts is None:",
     ["tests/test_profile_routing.py"]),
    ("routing: uniform rows sum to 1", "placement/routing_stats.py",
     "            return np.full(self.counts.shape, self.topk / self.num_experts)",
     "            return np.full(self.counts.shape, 1.0 / self.num_experts)", ["tests/test_profile_routing.py"]),
    ("routing: one count too many", "placement/routing_stats.py",
     "        if counts.size and int(counts.sum(axis=1).max()) > self.tokens * self.topk:",
     "        if counts.size and int(counts.sum(axis=1).max()) > self.tokens * self.topk + 1:",
     ["tests/test_profile_routing.py"]),
    ("top-p boundary", "hybrid/runtime/sampling.py", "drop = (probs.cumsum(-1) - probs) >= params.top_p",
     "drop = (probs.cumsum(-1) - probs) > params.top_p", ["tests/test_sampling_extremes.py"]),
    ("prompt fills the context", "hybrid/runtime/generation.py", "        if len(ids) >= engine.max_context:",
     "        if len(ids) > engine.max_context:", ["tests/test_generate.py"]),
    ("cache read past max_context", "hybrid/runtime/kv_cache.py",
     "L = self.max_context if kv_len is None else min(kv_len, self.max_context)",
     "L = self.max_context if kv_len is None else kv_len", ["tests/test_generate.py"]),
    ("queue one short", "hybrid/server/scheduler.py", "            if len(self._waiting) + len(seqs) > self.max_queue:",
     "            if len(self._waiting) + len(seqs) >= self.max_queue:", ["tests/test_server_scheduler.py"]),
    ("prefill budget exclusive", "hybrid/server/scheduler.py",
     "            if batch and w * (len(batch) + 1) > self.prefill_chunk:",
     "            if batch and w * (len(batch) + 1) >= self.prefill_chunk:", ["tests/test_server_scheduler.py"]),
    ("length at max_context", "hybrid/server/scheduler.py",
     "                  or len(seq.prompt_ids) + seq.n_generated >= self.runtime.max_context):",
     "                  or len(seq.prompt_ids) + seq.n_generated > self.runtime.max_context):",
     ["tests/test_server_scheduler.py"]),
    ("prompt size floor rounds down", "hybrid/server/prompt_limits.py",
     "    return -(-chars // max_token_chars) if max_token_chars else 0",
     "    return chars // max_token_chars if max_token_chars else 0", ["tests/test_server_units.py"]),
    ("prompt limit exclusive", "hybrid/server/prompt_limits.py", "    if floor >= limit:", "    if floor > limit:",
     ["tests/test_server_units.py"]),
    ("any *localhost host", "hybrid/server/guards.py", 'name.endswith(".localhost")', 'name.endswith("localhost")',
     ["tests/test_server_units.py"]),
    ("auth scheme case-sensitive", "hybrid/server/guards.py", 'if scheme.lower() != "bearer"', 'if scheme != "Bearer"',
     ["tests/test_server_hostile.py"]),
    ("hybrid flags: --cpu-threads alone dropped", "hybrid/offload/build.py",
     '"cpu_threads", "profile", "plan", "replace",', '"profile", "plan", "replace",', ["tests/test_cli_robust.py"]),
    ("zero-size tensor refused", "hybrid/models/checks.py", "        if not 0 <= begin <= end:",
     "        if not 0 <= begin < end:", ["tests/test_loader_robust.py"]),
    ("1-byte tensor gap allowed", "hybrid/models/checks.py", "        if begin > at:\n", "        if begin > at + 1:\n",
     ["tests/test_loader_robust.py"]),
    ("truncated header allowed", "hybrid/models/checks.py", "            if 8 + n > size:",
     "            if 8 + n > size + 1:", ["tests/test_loader_robust.py"]),
    ("sliding_window 0 always", "hybrid/models/checks.py", "(sw >= 1 or (sw == 0 and off))",
     "(sw >= 0 or (sw == 0 and off))", ["tests/test_loader_robust.py"]),
    ("bounds: reuse share skips steps with no repeat", "bench/bounds.py",
     "for n, r in _repeats(step_counts, resident) if n]", "for n, r in _repeats(step_counts, resident) if r]",
     ["tests/test_guard_bounds.py"]),
    ("bounds: resident reads at DRAM speed", "bench/bounds.py", "r * resident_bytes / hbm_bw) for c, r in layers)",
     "r * resident_bytes / dram_bw) for c, r in layers)", ["tests/test_guard_bounds.py"]),
    ("vs_llamacpp: -ncmoe the resident layers", "bench/vs_llamacpp.py", "ncmoe = args.layers - args.layers // 4",
     "ncmoe = args.layers // 4", ["tests/test_bench_decode.py"]),
    ("vs_llamacpp: quarter keeps an eighth", "bench/vs_llamacpp.py", '"quarter": ("bf16", ["--resident", str(args.experts // 4)])',
     '"quarter": ("bf16", ["--resident", str(args.experts // 8)])', ["tests/test_bench_decode.py"]),
    ("vs_llamacpp: quarter-layers keeps every layer", "bench/vs_llamacpp.py", '["--resident-layers", str(args.layers // 4)]',
     '["--resident-layers", str(args.layers)]', ["tests/test_bench_decode.py"]),
    ("hybrid_e2e: whole layers from the front", "bench/hybrid_e2e.py", "if i >= n_layers - whole else []",
     "if i < whole else []", ["tests/test_bench_decode.py"]),
    ("vs_llamacpp: environment beats the fallback", "bench/vs_llamacpp.py", "env={**os.environ, **(extra_env or {})}",
     "env={**(extra_env or {}), **os.environ}", ["tests/test_bench_decode.py"]),
    ("vs_llamacpp: a zero share shown as missing", "bench/vs_llamacpp.py", 'if v is not None else "-"',
     'if v else "-"', ["tests/test_bench_decode.py"]),
    ("doorbell: full one job late", "hybrid/offload/doorbell.py", "return len(self._jobs) >= self.CAP",
     "return len(self._jobs) > self.CAP", ["tests/test_doorbell_lane.py"]),
    ("int4: zero group 0 / 0", "cpu_kernels/quant.py",
     "inv = torch.where(amax > 0, 7.0 / amax, torch.zeros_like(amax))", "inv = 7.0 / amax",
     ["tests/test_cpu_quant_topology.py"]),
    ("int4: fold block under a chunk", "cpu_kernels/quant.py", "(K // group) % fold or fold * group % 64:",
     "(K // group) % fold:", ["tests/test_cpu_quant_topology.py"]),
    ("mxfp4: exponent floored at -126", "cpu_kernels/quant.py", "e = e.clamp(-127, 127)", "e = e.clamp(-126, 127)",
     ["tests/test_cpu_quant_topology.py"]),
    ("calibrate: CPU peak at the last m", "placement/calibrate.py", "peaks[backend] = max(f for _, f in curve)",
     "peaks[backend] = curve[-1][1]", ["tests/test_calibrate_steps.py"]),
    ("calibrate: alpha of H2D only", "placement/calibrate.py",
     'alpha=(link["h2d_alpha"] + link["d2h_alpha"]) / 2)', 'alpha=link["h2d_alpha"])', ["tests/test_calibrate_steps.py"]),
    ("calibrate: link bandwidth D2H", "placement/calibrate.py", 'link_bw=link["h2d_bw"],', 'link_bw=link["d2h_bw"],',
     ["tests/test_calibrate_steps.py"]),
    ("calibrate: fixed costs dropped", "placement/calibrate.py", "            gpu.update({k: ov[k] for k in keys})\n", "",
     ["tests/test_calibrate_steps.py"]),
    ("sampling: request seed ignored", "hybrid/runtime/sampling.py", "g.manual_seed(self.seed)", "g.manual_seed(0)",
     ["tests/test_sampling_extremes.py"]),
    ("hy_forward: K = 0 accepted", "cpu_kernels/csrc/driver.h", "T < 0 || K < 1 ||", "T < 0 || K < 0 ||",
     ["tests/test_cpu_driver_edges.py"]),
    ("hy_forward: local index == E accepted", "cpu_kernels/csrc/driver.h", "if (l >= E) return HY_EARG;",
     "if (l > E) return HY_EARG;", ["tests/test_cpu_driver_edges.py"]),
    ("hy_forward: a layer of no nodes accepted", "cpu_kernels/csrc/driver.h", "L->n_nodes < 1 ||", "L->n_nodes < 0 ||",
     ["tests/test_cpu_driver_edges.py"]),
    ("hy_forward: 8 nodes refused", "cpu_kernels/csrc/driver.h", "L->n_nodes > HY_MAX_NODES ||",
     "L->n_nodes >= HY_MAX_NODES ||", ["tests/test_cpu_driver_edges.py"]),
    ("fused path with no active expert", "cpu_kernels/csrc/driver.h",
     "const bool fused = g_fused && pad_rows == 0 && na > 0 &&", "const bool fused = g_fused && pad_rows == 0 &&", ["tests/test_cpu_driver_edges.py"]),
    ("stream read drops the partial chunk", "cpu_kernels/csrc/api.h",
     "  }, (int)((nbytes + chunk - 1) / chunk));\n  int64_t s = 0;", "  }, (int)(nbytes / chunk));\n  int64_t s = 0;",
     ["tests/test_cpu_driver_edges.py"]),
    ("spin_us clamp floor", "cpu_kernels/csrc/api.h", "g_spin_us.store(std::max(0, value));", "g_spin_us.store(value);",
     ["tests/test_cpu_decode_path.py"]),
    ("stream_pf not whole lines", "cpu_kernels/csrc/api.h", "g_stream_pf = std::max(0, value) / 64 * 64;",
     "g_stream_pf = std::max(0, value);", ["tests/test_cpu_decode_path.py"]),
    ("AMX parked tile 3 reloaded from tile 2", "cpu_kernels/csrc/kern_amx.h", "HY_TILE_LOAD(3, c2 + 16, cst);",
     "HY_TILE_LOAD(3, c2, cst);", ["tests/test_cpu_amx_edges.py"]),
    ("AMX int4 K block not whole groups", "cpu_kernels/csrc/kern_amx.h",
     "const int KB = std::max(unit, g_amx_kblock / unit * unit);", "const int KB = std::max(unit, g_amx_kblock);",
     ["tests/test_cpu_amx_edges.py"]),
    ("AMX knee exclusive", "cpu_kernels/csrc/driver.h", "&& m >= L->knee;", "&& m > L->knee;", ["tests/test_cpu_amx_edges.py"]),
    ("plan: expert id == E accepted", "placement/plan_file.py", "            if any(e >= E for e in lp.resident_experts):",
     "            if any(e > E for e in lp.resident_experts):", ["tests/test_plan_planner.py"]),
    ("plan: a settings count of 0 accepted", "placement/plan_file.py", "(_is_int(plan.settings[name]) and plan.settings[name] >= 1)",
     "(_is_int(plan.settings[name]) and plan.settings[name] >= 0)", ["tests/test_plan_planner.py"]),
    ("plan: CPU budget unchecked", "placement/plan_file.py", " or self.cpu_bytes > self.cpu_budget_bytes:",
     ":", ["tests/test_plan_planner.py"]),
    ("predict: graph lanes summed", "placement/predict.py", "    return max(cpu, gpu)\n", "    return cpu + gpu\n",
     ["tests/test_plan_planner.py"]),
    ("predict: prefill histogram floored", "placement/predict.py", "hist = np.rint(np.asarray(shares, dtype=np.float64) * tokens)",
     "hist = np.floor(np.asarray(shares, dtype=np.float64) * tokens)", ["tests/test_plan_planner.py"]),
    ("predict: prefill K/V read per row", "placement/predict.py", "kv_read = (1 if prefill else rows) * kv_bytes",
     "kv_read = rows * kv_bytes", ["tests/test_plan_planner.py"]),
    ("predict: embedding table read whole", "placement/predict.py", 'params = cfg.param_counts()["non_expert"] - cfg.vocab_size * cfg.hidden_size', 'params = cfg.param_counts()["non_expert"]',
     ["tests/test_plan_planner.py"]),
    ("generate: the later stop string cuts", "hybrid/runtime/generation.py", "cut = min((full.find(s) for s in stop_strings",
     "cut = max((full.find(s) for s in stop_strings", ["tests/test_generate.py"]),
    ("generate: held-back text never flushed", "hybrid/runtime/generation.py", "            if stream and len(c.text) > r.emitted:",
     "            if False:", ["tests/test_generate.py"]),
    ("decode_timeline: a step's host sync counted as a layer's gap", "bench/decode_timeline.py",
     "        if 0 <= g < step_gap_us:", "        if 0 <= g:", ["tests/test_bench_decode.py"]),
    ("decode_timeline: gaps per layer from the wrong count", "bench/decode_timeline.py",
     "return {k: (len(v) / per, statistics.median(v))", "return {k: (len(v), statistics.median(v))",
     ["tests/test_bench_decode.py"]),
    ("decode graphs: padding rows keep the last step's positions", "hybrid/runtime/cuda_graphs.py",
     "r[0, n:], r[1, n:], r[2, n:] = 0, -1, 0", "r[0, n:], r[2, n:] = 0, 0", ["tests/test_context_buckets.py"]),
    ("decode graphs: positions and slots rows swapped", "hybrid/runtime/cuda_graphs.py",
     '"slots": inputs[2],  # [b]', '"slots": inputs[1],  # [b]', ["tests/test_context_buckets.py"]),
    ("router norm_in: the norm's scale from the squares of h alone", "hybrid/gpu_kernels/router.py",
     "            hs = hs.to(x.dtype.element_ty).to(tl.float32)\n            ss += hs * hs",
     "            ss += tl.load(x + t * sx + d, mask=dm, other=0.0).to(tl.float32) ** 2",
     ["tests/test_gpu_kernels.py"]),
    ("router norm_in: the normed row without the norm's weight", "hybrid/gpu_kernels/router.py",
     "xr = (hs * rstd * tl.load(nw + d, mask=dm, other=0.0).to(tl.float32)).to(x.dtype.element_ty)",
     "xr = (hs * rstd).to(x.dtype.element_ty)", ["tests/test_gpu_kernels.py"]),
    ("router norm_in: the preloaded weight tile from the next expert's row", "hybrid/gpu_kernels/router.py",
     "w0 = tl.load(w + r[:, None] * D + d0[None, :]", "w0 = tl.load(w + (r[:, None] + 1) * D + d0[None, :]",
     ["tests/test_gpu_kernels.py"]),
    ("router norm fold: rows over one chunk fold too", "hybrid/models/moe.py",
     "return (h.shape[-1] <= NORM_IN_MAX_D and ", "return (", ["tests/test_gpu_kernels.py"]),
    ("bounds: tokens per expert counts the resident reads", "bench/bounds.py",
     "counts = [np.asarray(c)[~resident] for", "counts = [np.asarray(c) for", ["tests/test_guard_bounds.py"]),
    ("bounds: a token bin drops its top", "bench/bounds.py", "sel = (tok >= lo) & (tok <= hi) if",
     "sel = (tok >= lo) & (tok < hi) if", ["tests/test_guard_bounds.py"]),
    ("vs_llamacpp --summarize: a value at the target's floor counted as missed", "bench/vs_llamacpp.py",
     "            if v >= floor:", "            if v > floor:", ["tests/test_bench_decode.py"]),
    ("e2e env A/B: an unset variable left set after the A/B", "bench/hybrid_e2e.py",
     "                        os.environ.pop(name, None)", "                        pass",
     ["tests/test_e2e_cpu_only_sizes.py"]),
    ("decode graphs: fresh() keeps the captured graphs", "hybrid/runtime/cuda_graphs.py",
     "other._pool, other._stage, other._inputs, other.graphs = None, {}, {}, {}",
     "other._pool, other._stage, other._inputs = None, {}, {}",
     ["tests/test_e2e_cpu_only_sizes.py"]),
    ("decode ahead: a row that ended takes the tokens queued past its end", "hybrid/runtime/generation.py",
     "                if r in active:  # a row that stopped", "                if True:  # a row that stopped",
     ["tests/test_decode_ahead.py"]),
    ("decode ahead: can_feed ignores lengths changed since the queued step", "hybrid/runtime/engine.py",
     "return self._fed is not None and self._fed == (list(slots), [self.lengths[s] for s in slots])",
     "return self._fed is not None and self._fed[0] == list(slots)", ["tests/test_decode_ahead.py"]),
    ("hsum: the last level's quarters from the wrong vector", "cpu_kernels/csrc/kern_avx512.h",
     "return add_lanes<FP>(_mm512_shuffle_i32x4(w[0], w[1], 0x88), _mm512_shuffle_i32x4(w[0], w[1], 0xDD));",
     "return add_lanes<FP>(_mm512_shuffle_i32x4(w[0], w[1], 0x88), _mm512_shuffle_i32x4(w[1], w[0], 0xDD));",
     ["tests/test_cpu_decode_path.py"]),
    ("hsum: int8's row sums offset per token instead of per row", "cpu_kernels/csrc/kern_avx512.h",
     "_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)rsum));",
     "_mm512_set1_epi32(rsum[0]);", ["tests/test_cpu_decode_path.py"]),
    ("hsum: 2-row int4 passes store 4 values per token", "cpu_kernels/csrc/kern_avx512.h",
     "    if (NR == 4) _mm_storeu_ps(C + t * ldc, q);", "    if (NR >= 2) _mm_storeu_ps(C + t * ldc, q);",
     ["tests/test_cpu_decode_path.py"]),
    ("tail split: a part counts as a whole task", "cpu_kernels/csrc/fused.h",
     "counted = part < 0 ? ts : 1;", "counted = ts;", ["tests/test_cpu_decode_path.py"]),
    ("tail split: parts not on 16-row multiples", "cpu_kernels/csrc/fused.h",
     "const int step = (nr + ts * 16 - 1) / (ts * 16) * 16;", "const int step = (nr + ts - 1) / ts;",
     ["tests/test_cpu_decode_path.py"]),
    ("l2 touch: the last word of the tensor not read", "bench/l2_prefetch_probe.py",
     "mask=off < n, other=0", "mask=off < n - 1, other=0", ["tests/test_l2_touch.py"]),
    ("ceiling drift: the smallest step reported as the largest", "bench/ceiling_drift.py",
     '"largest_step_GBps": max(steps)', '"largest_step_GBps": min(steps)', ["tests/test_ceiling_drift.py"]),
]


def run(m, tree: Path) -> str:
    name, rel, old, new, tests = m
    path = tree / rel
    orig = path.read_text()
    if orig.count(old) != 1:
        return "STALE (the code it mutates changed: update the entry)"
    path.write_text(orig.replace(old, new))
    try:
        env = dict(os.environ, PYTHONPATH=str(tree))
        if rel.startswith("cpu_kernels/csrc/"):
            b = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, capture_output=True)
            if b.returncode:
                return "killed (does not compile)"
        try:
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests], cwd=tree,
                               env=env, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            return "killed (tests hang)"
        return "killed" if r.returncode else "SURVIVED"
    finally:
        path.write_text(orig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", action="store_true", help="only the mutations of Python files")
    p.add_argument("--only", help="only mutations whose name contains this")
    a = p.parse_args(argv)
    todo = [m for m in MUTATIONS if (not a.python or m[1].endswith(".py")) and (not a.only or a.only in m[0])]
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__"))
        if any(m[1].startswith("cpu_kernels/csrc/") for m in todo):
            subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, capture_output=True, check=True)
        bad = []
        for m in todo:
            verdict = run(m, tree)
            print(f"{m[0]:36} {verdict}", flush=True)
            if not verdict.startswith("killed"):
                bad.append(m[0])
            if m[1].startswith("cpu_kernels/csrc/"):  # back to the unmutated kernels for the next entry
                subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, capture_output=True)
    print(f"{len(todo) - len(bad)} of {len(todo)} killed" + (f"; gaps: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
