# run 10, call 5: row-at-a-time vector kernels at one token per expert (rowseq) against the 4-row blocks, the CPU
# kernel alone, pool past the LLC; a clean `git archive` of d4138aa (the experiment, reverted after this call)
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/s5 && tar xzf .boxcmd/src.tgz -C /tmp/s5 && cd /tmp/s5
python3 setup.py build_ext --inplace > /tmp/build5.txt 2>&1 || { tail -30 /tmp/build5.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
timeout $(( 150 - ($(date +%s) - T0) )) python3 -m bench.decode_probe --dtypes int8,int4,bf16 --experts 384 --cases 1x8,8x8 --variants fused-blocks,fused-rows,fused-blocks,fused-rows --iters 25 --out $OUT/probe_rows.json 2>&1 | grep -v Warn | tee $OUT/probe_rows.txt
echo "# all done at $(( $(date +%s) - T0 )) s"
