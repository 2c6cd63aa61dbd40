# run 23, call 6 (session 28): prefill 2048 only, old knobs (hsum 0, tail_split 1) and the defaults in alternating
# processes, three pairs (calls 4-5 read the defaults 0.89-0.98x of the old knobs at 2048 tokens in three pairs).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --strategies cost --prefill 2048 --decode-batch 1 --steps 2 --prefill-repeats 3"
for t in new old new old new old; do
  L=$(( 150 - ($(date +%s) - T0) )); [ $L -lt 20 ] && { echo "prefill $t not run (time)"; continue; }
  K=""; [ $t = old ] && K="--tune hsum=0,tail_split=1"
  timeout $L $E $K > /tmp/pf.txt 2>&1
  cat /tmp/pf.txt >> $OUT/prefill_logs.txt
  echo "$t $(grep -oE "prefill_[0-9]+_(tok_s|runs_tok_s)=[0-9.,]+" /tmp/pf.txt | tr '\n' ' ') $(grep -E "Error" /tmp/pf.txt | head -1)"
done | tee $OUT/prefill_ab.txt
echo "# all done at $(( $(date +%s) - T0 )) s"
