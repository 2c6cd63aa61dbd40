# run 8, call 5: prefill order check (call 4 ran fused first: 21.8k / 44.0k against unfused 24.5k / 46.0k tok/s):
# unfused, fused, unfused again, alone on the box. Clean `git archive HEAD` in .boxcmd/src.tgz.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
for f in 0 1 0 1; do
  L=$(( 140 - ($(date +%s) - T0) )); [ $L -lt 28 ] && { echo "prefill fused=$f not run (time)"; continue; }
  HYBRID_FUSED_DECODE=$f timeout $L python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --strategies cost --prefill 2048,8192 --decode-batch 1 --steps 2 > /tmp/prefill.txt 2>&1
  echo "prefill fused=$f $(grep -oE "prefill_[0-9]+_tok_s=[0-9.]+" /tmp/prefill.txt | tr '\n' ' ') $(grep Error /tmp/prefill.txt | head -1)"
done | tee $OUT/prefill.txt
echo "# all done at $(( $(date +%s) - T0 )) s"
