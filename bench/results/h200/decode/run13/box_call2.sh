# run 13, call 2 (session 18): prefill 2048/8192 of HEAD against d835f47 (the tree whose prefill check, alone on the
# box, read 25.6k / 49.6k tok/s), alternating, HEAD with 3 timed prefills per length (--prefill-repeats); then
# the CPU kernel test files on the box's real AMX (int4's AMX kernel was tested only through amx_emu); then int4 on
# AMX against its vector path (bench.cpu_moe's knee sweep). .boxcmd/src.tgz = git archive HEAD, old.tgz = d835f47.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src /tmp/old && tar xzf .boxcmd/src.tgz -C /tmp/src && tar xzf .boxcmd/old.tgz -C /tmp/old
(cd /tmp/old && python3 setup.py build_ext --inplace > $OUT/build_old.txt 2>&1) &
(cd /tmp/src && python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1)
wait
echo "# built at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --strategies cost --prefill 2048,8192 --decode-batch 1 --steps 2"
for t in src old src old; do
  L=$(( 330 - ($(date +%s) - T0) )); [ $L -lt 45 ] && { echo "prefill $t not run (time)"; continue; }
  R=""; [ $t = src ] && R="--prefill-repeats 3"
  (cd /tmp/$t && timeout $(( L < 80 ? L : 80 )) $E $R --out /tmp/pf_$t > /tmp/pf.txt 2>&1)
  cat /tmp/pf.txt >> $OUT/prefill_logs.txt
  echo "$t $(grep -oE "prefill_[0-9]+_(tok_s|runs_tok_s)=[0-9.,]+|prefill_[0-9]+_sched: [^|]*" /tmp/pf.txt | tr '\n' ' ') $(grep -E "Error" /tmp/pf.txt | head -1)"
done | tee $OUT/prefill_ab.txt
cd /tmp/src
L=$(( 450 - ($(date +%s) - T0) ))
timeout $L python3 -m pytest -q tests/test_cpu_int4_amx.py tests/test_cpu_int4_order.py tests/test_cpu_decode_path.py \
  tests/test_cpu_moe.py tests/test_cpu_activation.py > $OUT/cpu_tests.txt 2>&1; echo "cpu tests: $(tail -1 $OUT/cpu_tests.txt)"
L=$(( 580 - ($(date +%s) - T0) )); [ $L -lt 40 ] && { echo "knee sweep not run (time)"; exit 0; }
timeout $L python3 -m bench.cpu_moe --shapes qwen3-30b-a3b --dtypes int4 --decode 8x1,8x4 --prefill 8x256,8x1024 \
  --knee-sweep 4,8,16,32,64 --scaling '' --out $OUT/cpu_moe_int4.json 2>&1 | grep -v Warn | tee $OUT/cpu_moe_int4.txt
echo "# all done at $(( $(date +%s) - T0 )) s"
