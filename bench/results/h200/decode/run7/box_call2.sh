# runs a clean `git archive HEAD` (.boxcmd/src.tgz), not the shared working tree (helpers edit it meanwhile)
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
timeout 100 python3 -m pytest -q -x tests/test_generate_gpu.py > $OUT/t_generate_gpu.txt 2>&1; echo "generate_gpu $(tail -1 $OUT/t_generate_gpu.txt)"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
e2e() { name=$1; shift; timeout 100 python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --decode-batch 1,8 --steps 24 --out $OUT/$name "$@" > $OUT/$name.txt 2>&1; echo "== $name $(grep -oE "decode_b[18]_(tok_s|of_roofline|replay_token_agreement)=[0-9.]+" $OUT/$name.txt | tr '\n' ' ') $(grep -E "Error" $OUT/$name.txt | head -2)"; }
e2e ctx32k_buckets --max-context 32768
e2e ctx32k_whole --max-context 32768 --no-context-buckets
echo "# e2e done at $(( $(date +%s) - T0 )) s"
for dt in int8 bf16; do
  L=$(( 575 - ($(date +%s) - T0) ))
  [ $L -lt 60 ] && { echo "no time left for $dt"; break; }
  timeout $L python3 -m bench.deepseek_box --ckpt /tmp/dsv3-5l --cpu-dtype $dt --graphs --strategies cost,cpu --profile bench/results/h200/profile_qwen3-235b-a22b.json --out $OUT/deepseek > $OUT/deepseek_$dt.txt 2>&1
  echo "== deepseek $dt rc=$?"; grep -E "^# (wrote|loaded|measured|hybrid)|strategy=" $OUT/deepseek_$dt.txt | cut -c1-900; grep -E "Error" $OUT/deepseek_$dt.txt | head -3
  echo "# deepseek $dt done at $(( $(date +%s) - T0 )) s"
done
