# run 23, call 5 (session 28): call 4's prefill A/B once more in alternating processes (old knobs, new, old, new:
# hsum 0 + tail_split 1 against the defaults), then the kernel alone with both settings in each round.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --strategies cost --prefill 2048,8192 --decode-batch 1 --steps 2 --prefill-repeats 3"
for t in old new old new; do
  L=$(( 230 - ($(date +%s) - T0) )); [ $L -lt 35 ] && { echo "prefill $t not run (time)"; continue; }
  K=""; [ $t = old ] && K="--tune hsum=0,tail_split=1"
  timeout $L $E $K > /tmp/pf.txt 2>&1
  cat /tmp/pf.txt >> $OUT/prefill_logs.txt
  echo "$t $(grep -oE "prefill_[0-9]+_(tok_s|runs_tok_s)=[0-9.,]+" /tmp/pf.txt | tr '\n' ' ') $(grep -E "Error" /tmp/pf.txt | head -1)"
done | tee $OUT/prefill_ab.txt
echo "# prefill done at $(( $(date +%s) - T0 )) s"
L=$(( 290 - ($(date +%s) - T0) ))
[ $L -gt 30 ] && timeout $L python3 -m bench.decode_probe --dtypes bf16,int8 --cases 1x8,4x8same --iters 30 \
  --variants fused+hsum=0+tail_split=1,fused --rounds 3 --out $OUT/probe.json > $OUT/probe.txt 2>&1
grep -E "ceiling" $OUT/probe.txt; sed -n '/^# medians/,$p' $OUT/probe.txt
echo "# all done at $(( $(date +%s) - T0 )) s"
