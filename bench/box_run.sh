#!/usr/bin/env bash
# The GPU-box checks in stages that each fit one 10-minute device call, results under $OUT (default ./box_out).
#
#   bash bench/box_run.sh tests      # build + every GPU/AMX-marked test file, one process per file (~2 min)
#   bash bench/box_run.sh layer      # hybrid calibrate --quick -> $OUT/profile.json, then the 30B layer sweep (~4 min)
#   bash bench/box_run.sh e2e [P]    # 8-layer 30B model: every strategy in its own process, traces; graphs decode (~5 min)
#   bash bench/box_run.sh plan [P]   # 8-layer 30B checkpoint + plan_eval at three budgets (~3 min)
#   bash bench/box_run.sh bounds     # CPU kernels vs a ceiling above the LLC; crossover in-sample + hold-out (~7 min)
#   bash bench/box_run.sh llama      # llama.cpp side by side (bench.vs_llamacpp, 12 layers); needs the peer files
#                                    # (llama.cpp source tarball, build script, make_gguf.py) in $PEER (default .peer)
#
# P: a profile JSON (default $OUT/profile.json if the layer stage made one, else the profile BENCHMARKS.md
# quotes for that stage: the host-lane profile for e2e, the one with the graph floor for plan).
# One file per pytest process: a single process running every GPU file once stopped silently on the box.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-box_out}
mkdir -p "$OUT"
stage=${1:-tests}
P=${2:-}
if [ -z "$P" ]; then
  if [ -f "$OUT/profile.json" ]; then P=$OUT/profile.json
  elif [ "$stage" = e2e ]; then P=bench/results/h200/profile_qwen3-30b-a3b_hostlane.json
  else P=bench/results/h200/profile_qwen3-30b-a3b_floor.json; fi
fi
if [ "$stage" = llama ]; then  # llama.cpp's build (~170 s) and the GGUF files overlap our build
  PEER=${PEER:-.peer}
  LB=/tmp/lcpp
  (bash "$PEER/build_llama_bench.sh" "$LB" > "$OUT/llama_build.txt" 2>&1) &
  build_pid=$!
  for _ in $(seq 60); do [ -d "$LB/src/llama.cpp/gguf-py" ] && break; sleep 1; done
  (PYTHONPATH=$LB/src/llama.cpp/gguf-py python3 "$PEER/make_gguf.py" /tmp/q3.gguf --layers 12 &&
   PYTHONPATH=$LB/src/llama.cpp/gguf-py python3 "$PEER/make_gguf.py" /tmp/q3q8.gguf --layers 12 --experts-type q8_0) \
    > "$OUT/gguf.txt" 2>&1 &
  gguf_pid=$!
fi
python3 -m pip install -e . --no-build-isolation --no-deps -q > "$OUT/build.txt" 2>&1 || { tail -20 "$OUT/build.txt"; exit 1; }

case "$stage" in
  tests)
    for f in tests/test_cpu_moe.py tests/test_cpu_decode_path.py tests/test_doorbell_lane.py tests/test_hybrid_gpu.py \
             tests/test_hybrid_layer.py tests/test_hybrid_model.py tests/test_generate_gpu.py tests/test_model_equality.py \
             tests/test_replace_gpu.py tests/test_deepseek_gpu.py tests/test_decode_fusions.py tests/test_expert_deferral.py \
             tests/test_gpt_oss_gpu.py; do
      echo "$f $(timeout 150 python3 -m pytest -q -x "$f" 2>&1 | tail -1)"
    done | tee "$OUT/gpu_tests.txt"
    ;;
  layer)
    timeout 120 python3 -m hybrid calibrate --shape qwen3-30b-a3b --backends amx --quick --out "$OUT/profile.json" \
      > "$OUT/calibrate.txt" 2>&1; tail -14 "$OUT/calibrate.txt"
    timeout 330 python3 -m bench.layer_sweep --shape qwen3-30b-a3b --profile "$OUT/profile.json" --out "$OUT/sweep" \
      > "$OUT/layer_sweep.txt" 2>&1; grep -E "cost/best=|median" "$OUT/layer_sweep.txt" | tail -12
    ;;
  e2e)
    timeout 330 python3 -m bench.hybrid_e2e --profile "$P" --layers 8 --isolate --trace "$OUT/tr" --out "$OUT/eager" \
      > "$OUT/e2e_eager.txt" 2>&1; grep -E "strategy=" "$OUT/e2e_eager.txt"
    timeout 150 python3 -m bench.hybrid_e2e --profile "$P" --layers 8 --graphs --strategies cpu --out "$OUT/graphs" \
      > "$OUT/e2e_graphs.txt" 2>&1; grep -E "strategy=" "$OUT/e2e_graphs.txt"
    (cd "$OUT" && tar czf traces.tgz tr_* 2>/dev/null && rm -f tr_*)  # few files come back: one archive
    ;;
  plan)
    timeout 90 python3 -m bench.make_checkpoint --preset qwen3-30b-a3b --layers 8 --out /tmp/q3-8l --device cuda \
      > /dev/null 2>&1
    timeout 400 python3 -m bench.plan_eval --model /tmp/q3-8l --profile "$P" --max-context 1024 --steps 64 \
      --out "$OUT/plan" > "$OUT/plan_eval.txt" 2>&1; grep -v Warn "$OUT/plan_eval.txt" | tail -12
    ;;
  bounds)
    timeout 420 python3 -m bench.cpu_moe --isas amx --dtypes bf16,int8 --kblocks "" --scaling "" --out "$OUT/cpu_moe.json" \
      > "$OUT/cpu_moe.txt" 2>&1; grep -E "^# (DRAM|knee .*derived|note)|^qwen" "$OUT/cpu_moe.txt" | tail -40
    timeout 150 python3 -m bench.crossover --profile bench/results/h200/profile_qwen3-235b-a22b.json \
      --shapes qwen3-235b-a22b,qwen3-30b-a3b --out "$OUT/crossover" > "$OUT/crossover.txt" 2>&1
    tail -5 "$OUT/crossover.txt"
    ;;
  llama)
    wait $build_pid || { tail -20 "$OUT/llama_build.txt"; exit 1; }
    wait $gguf_pid || { tail -20 "$OUT/gguf.txt"; exit 1; }
    timeout 420 python3 -m bench.vs_llamacpp --llama-bench $LB/bin/llama-bench --gguf-bf16 /tmp/q3.gguf \
      --gguf-q8 /tmp/q3q8.gguf --profile "$P" --out "$OUT/vs" ${CASES:+--cases $CASES} > "$OUT/vs_llamacpp.txt" 2>&1
    grep -E "^(bf16|int8|quarter|int4) |^\|" "$OUT/vs_llamacpp.txt"
    ;;
  *)
    echo "unknown stage $stage (tests | layer | e2e | plan | bounds | llama)" >&2; exit 2
    ;;
esac
