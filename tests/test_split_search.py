"""placement.split_search at its edges: a token count equal to a table's length is past it (the caller grows
the tables and asks again), and a split that only ties the best one so far does not ship more experts."""

from __future__ import annotations

import numpy as np

from placement.split_search import best_split, lane_times, table_sum

CPU_T = np.array([0.0, 1.0, 2.0, 3.0])  # seconds per expert by tokens 0..3
SHIP_G = np.array([0.0, 0.125, 0.125, 0.125])


def test_a_count_at_a_tables_length_is_past_it():
    ship = np.zeros(2, dtype=np.bool_)
    k, cpu, gpu = best_split(np.array([3, 1]), CPU_T, SHIP_G, 0.25, 0.0, 0.0, -1, 0.0, 0.0, ship)
    assert k >= 0 and cpu >= 0  # 3 = the last entry
    assert best_split(np.array([4, 1]), CPU_T, SHIP_G, 0.25, 0.0, 0.0, -1, 0.0, 0.0, ship)[0] == -1
    ship[:] = False  # everything on the CPU lane: 3.0 + 1.0 s
    assert lane_times(np.array([3, 1]), ship, CPU_T, SHIP_G, 0.25, 0.0, 0.0, -1, 0.0)[0] == 4.0
    assert lane_times(np.array([4, 1]), ship, CPU_T, SHIP_G, 0.25, 0.0, 0.0, -1, 0.0) == (-1.0, -1.0)
    assert table_sum(CPU_T, np.array([3, 1])) == 4.0
    assert table_sum(CPU_T, np.array([4, 1])) == -1.0


def test_a_tie_keeps_the_split_that_ships_fewer():
    """Two cold experts whose CPU time is nothing but the lane's fixed 1 s: shipping one ties the all-CPU split
    (the lane still runs for the other), shipping both ends the GPU lane at exactly 1 s. All in binary-exact
    seconds, so the tie is exact: the all-CPU split stays."""
    cpu_t = np.array([0.0, 0.0])
    ship_g = np.array([0.0, 0.125])
    ship = np.ones(2, dtype=np.bool_)
    k, cpu, gpu = best_split(np.array([1, 1]), cpu_t, ship_g, 0.4375, 1.0, 0.0, -1, 0.0, 0.0, ship)
    assert (k, cpu, gpu) == (0, 1.0, 0.0) and not ship.any()
