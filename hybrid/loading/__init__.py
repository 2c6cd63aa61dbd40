"""Opening a model for the CLI and the server, one step per module, imports going one way (session -> steps):

    parse   command-line arguments -> a frozen SessionConfig (device, dtype, RuntimeConfig, HybridConfig)
    check   the one-line refusals before any weight is read (checkpoint headers, KV cache, DRAM, plan, GPU
            budget); without CUDA, no resident copies
    dram    the process's DRAM estimated from config.json, and what this machine (and its cgroup) has
    load    checkpoint -> model (and the Offload of the hybrid layer), tokenizer
    place   which experts are resident: the plan's, or the most routed in a short calibration run
    report  the status lines saying where the experts live and what the memory figures mean here
    session open_session: the steps in order, then the Engine, warmed up
    progress  progress bars as whole lines when stderr is a log
"""
