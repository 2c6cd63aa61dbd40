export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
e2e() { name=$1; shift; timeout 90 python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --decode-batch 1,8 --steps 24 --out $OUT/$name "$@" > $OUT/$name.txt 2>&1; echo "== $name $(grep -oE "decode_b[18]_(tok_s|roofline_tok_s|of_roofline|replay_token_agreement)=[0-9.]+" $OUT/$name.txt | tr '\n' ' ') $(grep -E "Error" $OUT/$name.txt | head -2)"; }
e2e e2e_bf16
e2e e2e_bf16_defer2 --defer-experts 2
for f in tests/test_hybrid_gpu.py tests/test_cpu_moe.py tests/test_cpu_decode_path.py tests/test_doorbell_lane.py tests/test_hybrid_layer.py tests/test_hybrid_model.py tests/test_generate_gpu.py tests/test_model_equality.py tests/test_replace_gpu.py tests/test_deepseek_gpu.py tests/test_decode_fusions.py tests/test_expert_deferral.py; do
  n=$(basename $f .py); timeout 60 python3 -m pytest -q -x $f > $OUT/t_$n.txt 2>&1; echo "$f $(tail -1 $OUT/t_$n.txt)"
done | tee $OUT/gpu_tests.txt
grep -h -B2 -A12 "^E  " $OUT/t_*.txt | head -24
e2e e2e_int8 --cpu-dtype int8
timeout 45 python3 -m bench.decode_probe --dtypes bf16,int8 --cases 1x8,4x8same --variants fused --iters 40 --out $OUT/probe.json 2>&1 | tail -5
