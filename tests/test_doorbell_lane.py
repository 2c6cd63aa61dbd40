"""The doorbell lane's CPU side (cpu_kernels/csrc/lane.h): a job registered with the lane runs when its id is
written to the doorbell word, answers in its done word, and computes what forward computes. The stream side
(cuStreamWriteValue32 / WaitValue32) is exercised by the GPU tests; here this thread plays it."""

import pytest
import torch

from cpu_kernels import CpuMoE
from hybrid.offload.doorbell import DoorbellLane
from test_cpu_moe import COMPILED

E, F, D, K = 6, 64, 96, 4


def small_moe(isa, seed):
    g = torch.Generator().manual_seed(seed)
    return CpuMoE(torch.randn(E, F, D, generator=g) / 10, torch.randn(E, F, D, generator=g) / 10,
                  torch.randn(E, D, F, generator=g) / 10, isa=isa, threads=2), g


@pytest.mark.parametrize("isa", [i for i in COMPILED if i != "amx"])
def test_lane_runs_registered_jobs_in_any_order(isa):
    moe, g = small_moe(isa, 0)
    lane = DoorbellLane(isa)
    try:
        jobs = []
        for T in (1, 3, 7):
            x = torch.randn(T, D, generator=g).bfloat16()
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
            w = torch.rand(T, K, generator=g)
            out = torch.full((T, D), float("nan"), dtype=torch.bfloat16)
            job = moe.host_job(x, ids, w, out)
            jobs.append((lane.add(job), job, moe.forward(x, ids, w), out))
        assert [j[0] for j in jobs] == [1, 2, 3]
        for rep in range(3):  # replays: the same ids again and again, as a graph does
            for i, (jid, job, want, out) in enumerate(reversed(jobs)):
                out.fill_(float("nan"))
                lane.ring_from_host(jid, bell=i % 2)  # both doorbells (the second: deferred jobs)
                assert job.runs == rep + 1 and job.rc == 0 and job.failures == 0
                assert torch.equal(out, want)
        assert lane.served == 9
        lane.ring_from_host(999)  # an id nobody registered runs nothing but still releases the stream
        assert lane.served == 10
    finally:
        lane.close()


def test_set_repoints_an_id():
    isa = [i for i in COMPILED if i != "amx"][0] if COMPILED else pytest.skip("no compiled ISA")
    moe, g = small_moe(isa, 1)
    lane = DoorbellLane(isa)
    try:
        x = torch.randn(2, D, generator=g).bfloat16()
        ids = torch.tensor([[0, 1, 2, 3], [2, 3, 4, 5]], dtype=torch.int32)
        w = torch.rand(2, K, generator=g)
        a_out, b_out = torch.zeros(2, D, dtype=torch.bfloat16), torch.zeros(2, D, dtype=torch.bfloat16)
        a, b = moe.host_job(x, ids, w, a_out), moe.host_job(x, ids, w * 2, b_out)
        jid = lane.add(a)
        lane.set(jid, b)
        lane.ring_from_host(jid)
        assert a.runs == 0 and b.runs == 1 and torch.equal(b_out, moe.forward(x, ids, w * 2))
        with pytest.raises(RuntimeError, match="no id"):
            lane.set(jid + 1, a)
    finally:
        lane.close()


def test_host_job_counts_the_time_it_computes():
    """busy_s (the C function's own clock) grows with every run, by no more than the wall time around it."""
    import time

    isa = [i for i in COMPILED if i != "amx"][0] if COMPILED else pytest.skip("no compiled ISA")
    moe, g = small_moe(isa, 3)
    x = torch.randn(4, D, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(4)]).to(torch.int32)
    w = torch.rand(4, K, generator=g)
    job = moe.host_job(x, ids, w, torch.zeros(4, D, dtype=torch.bfloat16))
    assert job.busy_s == 0.0
    t0 = time.perf_counter()
    job.run()
    one = job.busy_s
    job.run()
    wall = time.perf_counter() - t0
    assert 0 < one < job.busy_s <= wall


def test_host_job_takes_int64_ids_as_the_router_writes_them():
    isa = [i for i in COMPILED if i != "amx"][0] if COMPILED else pytest.skip("no compiled ISA")
    moe, g = small_moe(isa, 2)
    x = torch.randn(3, D, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(3)])  # int64
    w = torch.rand(3, K, generator=g)
    out = torch.full((3, D), float("nan"), dtype=torch.bfloat16)
    job = moe.host_job(x, ids, w, out)
    job.run()
    assert job.rc == 0 and torch.equal(out, moe.forward(x, ids.to(torch.int32), w))
    ids[1, 2] = 1 << 40  # beyond int32: refused, not wrapped into a valid expert id
    job.run()
    assert job.failures == 1 and torch.isnan(out.float()).all()


@pytest.mark.parametrize("bell", [0, 1])
def test_lane_rearms_the_previous_id_so_the_stream_need_not(bell):
    """A stream that never rings one id twice in a row may skip its re-arm write (ring(rearm=False)): the lane
    clears the previous id's done word when it answers the next doorbell of the same bell, before it runs."""
    isa = [i for i in COMPILED if i != "amx"][0] if COMPILED else pytest.skip("no compiled ISA")
    lane = DoorbellLane(isa)
    try:
        a, b, c = 11, 12, 13  # unregistered ids: the lane runs nothing but answers
        lane.ring_from_host(a, bell=bell, rearm=False)
        assert lane.done_word(a) == 1  # nobody has re-armed it yet
        lane.ring_from_host(b, bell=bell, rearm=False)
        assert (lane.done_word(a), lane.done_word(b)) == (0, 1)  # the lane re-armed a on answering b
        lane.ring_from_host(1 - bell + 20, bell=1 - bell, rearm=False)  # the other doorbell keeps its own history
        assert lane.done_word(b) == 1
        for jid in (c, a, b, c):  # a graph's replays: ids cycle, never twice in a row
            lane.ring_from_host(jid, bell=bell, rearm=False)
            assert lane.done_word(jid) == 1 and sum(lane.done_word(j) for j in (a, b, c)) == 1
        assert lane.served == 7
    finally:
        lane.close()


def test_lane_is_full_exactly_at_its_capacity():
    """`full` turns true with the CAP-th job (host_lane then falls back to host functions): one later and the next
    capture's add() would raise instead of falling back."""
    isa = [i for i in COMPILED if i != "amx"][0] if COMPILED else pytest.skip("no compiled ISA")

    class TwoJobs(DoorbellLane):
        CAP = 2

    moe, g = small_moe(isa, 4)
    lane = TwoJobs(isa)
    try:
        x = torch.randn(1, D, generator=g).bfloat16()
        ids = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
        w = torch.rand(1, K, generator=g)
        jobs = [moe.host_job(x, ids, w, torch.zeros(1, D, dtype=torch.bfloat16)) for _ in range(3)]
        assert lane.add(jobs[0]) == 1 and not lane.full
        assert lane.add(jobs[1]) == 2 and lane.full
        with pytest.raises(RuntimeError, match="full"):
            lane.add(jobs[2])
        lane.ring_from_host(2)  # the last slot still runs
        assert jobs[1].runs == 1 and jobs[0].runs == 0
    finally:
        lane.close()
