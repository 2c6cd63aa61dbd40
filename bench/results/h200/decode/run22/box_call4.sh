# run 22, call 4 (session 27): target 5's kernel-alone part once more (call 2's command, a third draw), then what
# an extra token per expert costs at 8 experts (bench.decode_probe over 1-8 tokens on the same 8 experts), then the
# issue's named bench (bench.cpu_moe, 8 experts x 1 and x 4 tokens, K = 1) with the vector and AMX paths timed at
# 2, 4 and 8 tokens per expert (the knee sweep). .boxcmd/src.tgz = git archive HEAD.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
timeout 120 python3 -m bench.decode_probe --dtypes bf16,int8 --cases 1x8,4x8same --iters 30 --variants fused --rounds 3 \
  --out $OUT/probe.json > $OUT/probe.txt 2>&1; grep -v Warn $OUT/probe.txt | tail -7
echo "# probe done at $(( $(date +%s) - T0 )) s"
timeout 150 python3 -m bench.decode_probe --dtypes bf16,int8 --cases 1x8same,2x8same,3x8same,4x8same,8x8same --iters 30 \
  --variants fused --rounds 2 --out $OUT/probe_tokens.json > $OUT/probe_tokens.txt 2>&1; grep -v Warn $OUT/probe_tokens.txt | tail -11
echo "# token sweep done at $(( $(date +%s) - T0 )) s"
timeout 200 python3 -m bench.cpu_moe --shapes qwen3-30b-a3b --dtypes bf16,int8 --decode 8x1,8x4 --prefill '' \
  --knee-sweep 2,4,8 --kblocks '' --scaling '' --out $OUT/cpu_moe.json 2>&1 | grep -v Warn > $OUT/cpu_moe.txt; cat $OUT/cpu_moe.txt | tail -16
echo "# all done at $(( $(date +%s) - T0 )) s"
