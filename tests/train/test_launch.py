"""The work split of the offline scripts: one process without a launcher, rank-strided units."""

import types

from headway.train.launch import launch_state, my_units, rank_and_world, wait_for_everyone


def test_without_a_launcher_one_process_owns_everything(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launch_state() is None
    assert rank_and_world(None) == (0, 1) and list(my_units(5, None)) == [0, 1, 2, 3, 4]
    wait_for_everyone(None)  # nothing to wait for


def test_ranks_own_disjoint_strided_units():
    ranks = [types.SimpleNamespace(process_index=r, num_processes=3) for r in range(3)]
    shares = [list(my_units(8, s)) for s in ranks]
    assert shares == [[0, 3, 6], [1, 4, 7], [2, 5]]
    assert sorted(u for share in shares for u in share) == list(range(8))
