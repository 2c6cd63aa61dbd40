# last call of session 12: a clean `git archive HEAD` (.boxcmd/src.tgz); budget ~330 s of wall time
export PYTHONUNBUFFERED=1
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
for f in tests/test_gpt_oss_gpu.py tests/test_cpu_mxfp4.py tests/test_cpu_moe_bias.py tests/test_hybrid_gpu.py tests/test_cpu_decode_path.py tests/test_model_equality.py; do
  n=$(basename $f .py); timeout 45 python3 -m pytest -q -x $f > /tmp/t_$n.txt 2>&1; echo "$f rc=$? $(tail -1 /tmp/t_$n.txt)"
done > $OUT/gpu_tests.txt; cat $OUT/gpu_tests.txt
grep -h -B2 -A8 "^E  " /tmp/t_*.txt | head -20
echo "# tests done at $(( $(date +%s) - T0 )) s"
timeout $(left 250) python3 -m bench.gpt_oss_box --ckpt /tmp/gpt-oss-4l --layers 4 --cpu-dtype mxfp4 --graphs --strategies cost,cpu --profile bench/results/h200/profile_qwen3-235b-a22b.json --out $OUT/gpt_oss > /tmp/gpt_oss_mxfp4.txt 2>&1
echo "gpt_oss rc=$?"; grep -vE "it/s|s/it|%\|" /tmp/gpt_oss_mxfp4.txt | grep -E "^#|^\||^load|Error|strategy=" | cut -c1-700 | tee $OUT/gpt_oss_mxfp4.txt
echo "# gpt-oss done at $(( $(date +%s) - T0 )) s"
timeout $(left 325) python3 -m bench.decode_probe --dtypes bf16,int8,int4,mxfp4 --cases 1x8,4x8same --variants fused --iters 30 --out $OUT/probe.json > $OUT/probe.txt 2>&1; tail -9 $OUT/probe.txt
echo "# all done at $(( $(date +%s) - T0 )) s"
