export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
for g in 128 32; do
  timeout 75 python3 -m bench.decode_probe --dtypes int4,int4-natural --group $g --cases 1x8,2x8same,3x8same,4x8same,8x8 \
    --variants fused --iters 30 --out $OUT/probe_int4_order_g$g.json 2>&1 | grep -v Warn | tee $OUT/probe_int4_order_g$g.txt
done
echo "# probe done at $(( $(date +%s) - T0 )) s"
