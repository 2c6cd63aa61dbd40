# run 8, call 4: the GPU test files not yet run at this commit (and the CPU kernel tests on AMX), int4 graph
# decode and the CPU kernels alone after the int4/mxfp4 kernel work (prefetch on and off), prefill with the fused
# kernels (and without, if time is left). Clean `git archive HEAD` in .boxcmd/src.tgz.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
left() { echo $(( 440 - ($(date +%s) - T0) )); }
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
for f in tests/test_hybrid_gpu.py tests/test_deepseek_gpu.py tests/test_gpu_kernels.py tests/test_replace_gpu.py tests/test_expert_deferral.py tests/test_decode_fusions.py tests/test_cpu_moe.py tests/test_cpu_mxfp4.py; do
  n=$(basename $f .py); timeout 60 python3 -m pytest -q -x $f > /tmp/t_$n.txt 2>&1; echo "$f $(tail -1 /tmp/t_$n.txt)"
done | tee $OUT/gpu_tests.txt
grep -h -B5 -A20 "^E  " /tmp/t_*.txt | head -40
echo "# tests done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
timeout 80 python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --decode-batch 1,8 --steps 24 --cpu-dtype int4 > /tmp/e2e_int4.txt 2>&1
echo "== int4 $(grep -oE "decode_b[18]_(tok_s|of_roofline|replay_token_agreement)=[0-9.]+" /tmp/e2e_int4.txt | tr '\n' ' ') $(grep Error /tmp/e2e_int4.txt | head -1)" | tee $OUT/e2e_int4.txt
echo "# e2e done at $(( $(date +%s) - T0 )) s"
timeout 70 python3 -m bench.decode_probe --dtypes bf16,int8,int4,mxfp4 --cases 1x8,4x8same --variants fused,fused-nopf --iters 30 --out $OUT/decode_probe.json > $OUT/decode_probe.txt 2>&1; grep -v Warn $OUT/decode_probe.txt | tail -18
echo "# probe done at $(( $(date +%s) - T0 )) s"
for f in 1 0; do
  L=$(left); [ $L -lt 50 ] && { echo "prefill fused=$f not run (time)"; continue; }
  HYBRID_FUSED_DECODE=$f timeout $L python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --strategies cost --prefill 2048,8192 --decode-batch 1 --steps 2 > /tmp/prefill_$f.txt 2>&1
  echo "prefill fused=$f $(grep -oE "prefill_[0-9]+_tok_s=[0-9.]+" /tmp/prefill_$f.txt | tr '\n' ' ') $(grep Error /tmp/prefill_$f.txt | head -1)"
done | tee $OUT/prefill.txt
echo "# all done at $(( $(date +%s) - T0 )) s"
