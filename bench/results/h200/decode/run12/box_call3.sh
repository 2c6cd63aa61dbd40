# run 12, call 3 (prepared in session 17, not yet run): the GPU test files call 2 had no time for, then e2e
# int8/int4 at batch 1 and 8 again on that call's host: run 11 call 4's steps unchanged, so it runs that script
# (a clean `git archive HEAD` in .boxcmd/src.tgz, as there).
exec bash bench/results/h200/decode/run11/box_call4.sh "$@"
