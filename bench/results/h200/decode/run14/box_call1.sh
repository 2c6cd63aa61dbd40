# run 14, call 1 (prepared in session 18, not yet run): the eighth side by side with llama.cpp, at a HEAD whose
# int8/int4 kernels prefetch 16 rows ahead (session 18; the seventh call's decode code otherwise), with the GPU
# test files; run 12 call 2's steps unchanged, so it runs that script on a clean `git archive HEAD`
# (.boxcmd/src.tgz) and the peer files (.peer).
exec bash bench/results/h200/decode/run12/box_call2.sh "$@"
