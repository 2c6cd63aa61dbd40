export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
for f in tests/test_hybrid_gpu.py tests/test_cpu_moe.py tests/test_cpu_moe_bias.py tests/test_cpu_decode_path.py tests/test_doorbell_lane.py tests/test_hybrid_layer.py tests/test_hybrid_model.py tests/test_generate_gpu.py tests/test_model_equality.py tests/test_replace_gpu.py tests/test_deepseek_gpu.py tests/test_decode_fusions.py tests/test_expert_deferral.py; do
  n=$(basename $f .py); timeout 80 python3 -m pytest -q -x $f > $OUT/t_$n.txt 2>&1; echo "$f $(tail -1 $OUT/t_$n.txt)"
done | tee $OUT/gpu_tests.txt
grep -h -B2 -A12 "^E  " $OUT/t_*.txt | head -30
echo "# tests done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
timeout 75 python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --decode-batch 1,8 --steps 24 --defer-experts 2 --out $OUT/e2e_defer2 > $OUT/e2e_defer2.txt 2>&1
echo "== defer2 $(grep -oE "decode_b[18]_(tok_s|of_roofline|replay_token_agreement)=[0-9.]+" $OUT/e2e_defer2.txt | tr '\n' ' ') $(grep -E "Error" $OUT/e2e_defer2.txt | head -2)"
echo "# e2e done at $(( $(date +%s) - T0 )) s"
df -h /tmp | tail -1
L=$(( 570 - ($(date +%s) - T0) ))
timeout $L python3 -m bench.deepseek_box --ckpt /tmp/dsv3-5l --cpu-dtype int8 --graphs --strategies cost,cpu --profile bench/results/h200/profile_qwen3-235b-a22b.json --out $OUT/deepseek > $OUT/deepseek_int8.txt 2>&1
echo "rc=$?"; grep -v Warn $OUT/deepseek_int8.txt | tail -25
echo "# all done at $(( $(date +%s) - T0 )) s"
