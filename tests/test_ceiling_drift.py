"""bench.ceiling_drift: the sampling loop and its summary (the read itself is cpu_kernels', tested there)."""

from bench.ceiling_drift import main, sample, summary


def test_summary_of_a_known_series():
    s = summary([(0.0, 100.0), (0.5, 150.0), (1.0, 120.0)])
    assert s["samples"] == 3 and s["median_GBps"] == 120.0 and s["min_GBps"] == 100.0 and s["max_GBps"] == 150.0
    assert abs(s["max_over_min"] - 1.5) < 1e-12 and s["largest_step_GBps"] == 50.0
    assert s["best_of_3_median_GBps"] == 150.0  # one window of three: its best
    s2 = summary([(i, g) for i, g in enumerate([100.0, 90.0, 80.0, 70.0, 60.0, 130.0])], best_of=3)
    assert s2["best_of_3_p5_GBps"] < s2["best_of_3_median_GBps"] < s2["best_of_3_p95_GBps"]  # windows 100 and 130
    assert abs(s2["best_of_3_median_GBps"] - 115.0) < 1e-9


def test_sample_reads_until_the_time_is_up_and_at_least_twice():
    calls = []

    def read(nbytes, threads=None, repeats=3):
        calls.append((nbytes, threads, repeats))
        return 10.0 * len(calls)

    got = sample(0.0, 1 << 20, 3, read=read)
    assert [g for _, g in got] == [10.0, 20.0] and calls[0] == (1 << 20, 3, 1)
    assert got[0][0] <= got[1][0]


def test_runs_on_this_machine(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main(["--seconds", "0", "--mib", "64", "--out", str(out)]) == 0
    first = capsys.readouterr().out.splitlines()[-1]
    assert first.startswith("# ") and "median" in first
    assert main(["--summarize", str(out)]) == 0  # the saved series summarised again: the same line
    assert capsys.readouterr().out.strip() == first
