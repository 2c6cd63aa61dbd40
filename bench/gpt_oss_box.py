"""A gpt-oss-120b-shaped MXFP4 checkpoint, loaded as published, end to end (the models table's gpt-oss row).

    python -m bench.gpt_oss_box --ckpt /tmp/gpt-oss-4l --cpu-dtype mxfp4 --graphs --profile PROFILE.json --out DIR

1. Writes the checkpoint unless DIR/config.json exists: the gpt-oss-120b preset cut to --layers (default 4: two
   sliding-window and two full-attention layers, 128 experts top-4 each), experts MXFP4 as openai publishes
   them (`_blocks` + `_scales`, 0.53125 bytes a weight: ~1.7 GB a layer), the rest bf16 (2.3 GB of embedding +
   head), in a child process (bench.deepseek_box.ensure_checkpoint).
2. Loads it with the hybrid experts (`load_hybrid`; --cpu-dtype mxfp4 packs the published blocks into the CPU
   executor without a float copy, bf16 / int8 / int4 de-quantize per layer) and reports the load time, peak and
   settled resident memory and the executor's expert bytes.
3. Runs bench.hybrid_e2e's measurements on it: prefill 2048 / 8192 and decode at batch 1 / 8 tokens/s per
   strategy against the placement's roofline (prefill: the LP bound of the placement; decode: the distinct
   experts each step reads, cold from DRAM at the measured ceiling in the CPU dtype, resident from HBM).
Results: DIR/gpt_oss_box_<cpu dtype>.json and .txt (the table).
"""

from __future__ import annotations

from pathlib import Path

from bench.deepseek_box import arguments, run_box
from placement.json_file import write_json


def table(res: dict) -> str:
    """The header and one row per strategy: prefill tok/s and share of its bound, decode tok/s and share of the
    roofline, for each measured size."""
    rows = res["results"]
    keys = [k[:-len("_tok_s")] for k in rows[0] if k.endswith("_tok_s") and not k.endswith(("bound_tok_s", "link_tok_s",
                                                                                              "roofline_tok_s"))]
    head = "| strategy | " + " | ".join(f"{k} tok/s | of {'roofline' if k.startswith('decode') else 'bound'}"
                                       for k in keys) + " |"
    lines = [res["header"], "", head, "| --- |" + " ---: | ---: |" * len(keys)]
    for r in rows:
        cells = []
        for k in keys:
            share = r.get(f"{k}_of_roofline", r.get(f"{k}_of_bound"))
            cells += [f"{r[f'{k}_tok_s']:,.1f}", "-" if share is None else f"{share:.0%}"]
        lines.append(f"| {r['strategy']} | " + " | ".join(cells) + " |")
    load = res.get("load") or {}
    if load:
        lines += ["", f"load {load['load_s']:.0f} s, RSS settled {load['rss_after'] / 2**30:.1f} GiB / peak "
                  f"{load['rss_peak'] / 2**30:.1f} GiB (with mapped checkpoint pages), anonymous settled "
                  f"{load['anon_after'] / 2**30:.1f} / peak {load['anon_peak'] / 2**30:.1f} GiB, executor experts "
                  f"{load['dram_expert_bytes'] / 2**30:.2f} GiB"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = arguments(__doc__, "/tmp/gpt-oss-4l", 4, "gpt-oss-120b", "mxfp4").parse_args(argv)
    res = run_box(args, "gpt-oss-120b", "mxfp4")
    out = Path(args.out)
    write_json(out / f"gpt_oss_box_{args.cpu_dtype}.json", res, indent=1)
    text = table(res)
    (out / f"gpt_oss_box_{args.cpu_dtype}.txt").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
