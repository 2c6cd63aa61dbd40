"""bench.cpu_moe on this machine in its quick configuration: the phase profile counts only the timed
calls (a warm-up call would inflate it), every decode row above the DRAM ceiling carries a note, and the
rotation pool tiles by 64 experts."""

import json

import cpu_kernels
from bench.cpu_moe import main, pool_size


def test_pool_tiles_and_dwarfs_the_cache(monkeypatch):
    import bench.cpu_moe as cm

    monkeypatch.setattr(cm, "llc_bytes", lambda: 300 << 20)  # the GPU box host's ~300 MiB
    for D, F, dtype in ((2048, 768, "int8"), (4096, 1536, "bf16"), (512, 256, "int4")):
        n = pool_size(D, F, dtype)
        per = 3 * D * F * {"bf16": 2, "int8": 1, "int4": 0.5}[dtype]
        assert n % 64 == 0 and n * per >= 4 * (300 << 20)


def test_cpu_moe_quick(tmp_path):
    isa = [i for i in cpu_kernels.available_isas() if i != "ref"][:1] or ["ref"]
    out = tmp_path / "cpu_moe.json"
    assert main(["--quick", "--isas", isa[0], "--dtypes", "bf16", "--threads", "1", "--scaling", "",
                 "--dram-bytes", str(64 << 20), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["dram_buffer_bytes"] == 64 << 20 and set(res["dram_gbps_after"]) == {"1"}
    for r in res["rows"]:
        assert r["timed_calls"] >= 3
        if isa[0] != "ref":  # the compiled libraries count profiled calls (ref has no profiler)
            assert r["profiled_calls"] == r["timed_calls"]  # the warm-up call is not in the phases
        assert (r["kind"] == "decode" and r["dram_frac"] > 1) == ("above_ceiling_note" in r)
