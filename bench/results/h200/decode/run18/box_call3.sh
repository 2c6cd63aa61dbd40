# run 18, call 3: how much compute headroom the CPU decode kernels have over DRAM on the box's Xeon. The same
# cases twice: experts from DRAM (the default pool, >= 4 x the LLC) and from the LLC (a pool of 8 experts, which
# every call reads whole: 19 / 38 / 75 MB for int4 / int8 / bf16 against the 300 MiB L3). A kernel that reads
# the LLC little faster than DRAM is bound by its own instructions at that shape, not by the memory.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
C="--dtypes int4,int8,bf16 --cases 1x8,2x8same,4x8same,8x8same --iters 30 --variants fused --rounds 2"
for pool in llc dram; do
  L=$(( 420 - ($(date +%s) - T0) )); [ $L -lt 30 ] && { echo "$pool not run (time)"; continue; }
  X=""; [ $pool = llc ] && X="--experts 8"
  n=$(ls $OUT | grep -c "^probe_$pool"); f=$OUT/probe_${pool}_$n
  timeout $L python3 -m bench.decode_probe $C $X --out $f.json > $f.txt 2>&1
  echo "## $pool $n (rc $?)"; grep -vE "Warn|^$" $f.txt | tail -22
done
echo "# all done at $(( $(date +%s) - T0 )) s"
