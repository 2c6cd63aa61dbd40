# run 17, call 5 (session 22): the CPU kernel alone at decode routing against the ceiling of the same process
# (target 5's kernel-alone part: bf16 and int8, 8 experts x 1 token >= 90%, 8 experts x 4 tokens >= 80%), three
# rounds for medians, with the device time left.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
timeout 170 python3 -m bench.decode_probe --dtypes bf16,int8 --cases 1x8,4x8same --iters 30 --variants fused --rounds 3 \
  --out $OUT/probe.json > $OUT/probe.txt 2>&1; grep -v Warn $OUT/probe.txt | tail -25
echo "# all done at $(( $(date +%s) - T0 )) s"
