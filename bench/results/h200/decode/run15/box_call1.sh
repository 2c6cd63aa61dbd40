# run 15, call 1 (prepared in session 19, not yet run): the ninth side by side with llama.cpp, at a HEAD whose decode
# path differs from the eighth call's (2525446) by: the fused path's reduce clearing only its block's columns, the
# byte_tasks and pf_l1 knobs (both off by default), and --cpu-threads / --profile alone turning the hybrid path on;
# with the GPU test files (the floor model's batch rows, hybrid/offload/overheads.py, have run only on the CPU).
# Run 12 call 2's steps unchanged, on a clean `git archive HEAD` (.boxcmd/src.tgz) and the peer files (.peer).
exec bash bench/results/h200/decode/run12/box_call2.sh "$@"
