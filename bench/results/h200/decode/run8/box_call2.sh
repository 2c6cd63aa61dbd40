# run 8, call 2: where the captured layer's fixed cost goes, fused decode kernels on and off (bench.decode_timeline)
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
for f in 1 0; do
  for r in none all; do
    echo "== fused=$f resident=$r"
    HYBRID_FUSED_DECODE=$f timeout 120 python3 -m bench.decode_timeline --resident $r --out $OUT/timeline_f${f}_$r.json 2>&1 | grep -v Warn | head -45
  done
done | tee $OUT/timeline.txt
echo "# all done at $(( $(date +%s) - T0 )) s"
