export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
for f in tests/test_cpu_moe.py tests/test_cpu_decode_path.py tests/test_doorbell_lane.py tests/test_hybrid_gpu.py tests/test_hybrid_layer.py tests/test_hybrid_model.py tests/test_generate_gpu.py tests/test_model_equality.py tests/test_replace_gpu.py tests/test_deepseek_gpu.py; do
  echo "$f $(timeout 150 python3 -m pytest -q -x $f > $OUT/t_$(basename $f .py).txt 2>&1; tail -1 $OUT/t_$(basename $f .py).txt)"
done | tee $OUT/gpu_tests.txt
timeout 150 python3 -m bench.decode_probe --dtypes bf16,int8,int4 --cases 1x8,4x8same,8x8 --variants fused,phased --iters 40 --floor --out $OUT/decode_probe.json > $OUT/decode_probe.txt 2>&1; cat $OUT/decode_probe.txt
timeout 150 python3 -m bench.hybrid_e2e --profile bench/results/h200/profile_qwen3-30b-a3b_floor.json --layers 12 --resident 0 --strategies cost --prefill 2048,8192 --decode-batch 1 --steps 4 --out $OUT/prefill > $OUT/prefill.txt 2>&1; grep -oE "prefill_[0-9]+_(tok_s|of_bound)=[0-9.]+" $OUT/prefill.txt | tr '\n' ' '
grep -h -B2 -A12 "^E  " $OUT/t_*.txt | head -40
