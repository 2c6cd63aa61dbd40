export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
run() { name=$1; shift; env "$@" timeout 120 python3 -m bench.hybrid_e2e --profile ${PROF:-$P} --layers 12 --resident 0 --strategies cost --prefill 2048,8192 --decode-batch 1 --steps 2 --out $OUT/$name > $OUT/$name.txt 2>&1; echo "$name $(grep -oE "prefill_[0-9]+_tok_s=[0-9.]+|prefill_[0-9]+_sched: [^|]*" $OUT/$name.txt | tr '\n' ' ')"; }
run A_default HYBRID_DOORBELL=1
run B_hostfn HYBRID_DOORBELL=0
PROF=bench/results/h200/decode/prefill_check/profile_knee8.json run C_knee8 HYBRID_DOORBELL=1
run D_spin50 HYBRID_SPIN_US=50
