# run 16, call 3 (prepared in session 21; no machine could be started for it, so it is the next session's first
# call): the twelfth side by side with llama.cpp at the session's final decode code (int4 i4_wide 2 by default; a
# step's inputs in one pinned copy, StepInputs) through bench/box_run.sh's llama stage, then the step-input probe.
# The GPU test files passed at this code in call 4. On a clean `git archive HEAD` (.boxcmd/src.tgz) and the peer
# files (.peer).
export PYTHONUNBUFFERED=1
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cp -r .peer /tmp/src/.peer && cd /tmp/src
CASES=bf16,int8,quarter,int4 PEER=.peer bash bench/box_run.sh llama
python3 -m bench.step_inputs_probe --out $OUT/step_inputs.json 2>&1 | tee $OUT/step_inputs.txt
