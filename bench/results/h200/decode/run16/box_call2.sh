# run 16, call 2 (prepared in session 20, not yet run): the eleventh side by side with llama.cpp and the GPU test files,
# at the HEAD whose int4 3-4-token blocks run in one pass (i4_wide 2). Run 12 call 2's steps unchanged, on a clean
# `git archive HEAD` (.boxcmd/src.tgz) and the peer files (.peer).
exec bash bench/results/h200/decode/run12/box_call2.sh "$@"
