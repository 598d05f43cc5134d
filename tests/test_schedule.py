"""The transfer schedule and the incremental hidden-set check agree with a brute-force schedule."""

import random

from fxoffload.cost import DeviceRates
from fxoffload.schedule import HiddenSetChecker, schedule_transfers

from .test_plan import saved

RATES = DeviceRates("test", flops=1e12, memory_bandwidth=1e11, d2h=1e9, h2d=1e9, launch=0.0)


def test_one_copy_by_hand():
    # forward: 10 nodes of 1 ms; the tensor's last use is node 3, so its copy may start at 4 ms.
    fw = [i * 1e-3 for i in range(11)]
    bw = [i * 1e-3 for i in range(11)]
    t = saved("x", nbytes=2_000_000, fw_last_use=3, bw_first_use=6)  # 2 ms each way at 1 GB/s
    (timing,) = schedule_transfers([t], fw, bw, RATES).timings
    assert (timing.offload_start, timing.offload_end) == (4e-3, 6e-3)
    assert timing.fw_wait_after == 5  # node 5 ends at 6 ms, when the copy is done
    assert abs(timing.reload_start - 4e-3) < 1e-12 and abs(timing.reload_end - 6e-3) < 1e-12
    assert timing.bw_issue_after == 3  # nodes 0..3 end by 4 ms: issue after node 3, no earlier
    assert timing.stall == 0 and abs(timing.fw_window - 6e-3) < 1e-12 and abs(timing.bw_window - 6e-3) < 1e-12


def test_copies_share_the_link_and_stall_when_they_do_not_fit():
    fw = [i * 1e-3 for i in range(11)]
    bw = [i * 1e-3 for i in range(11)]
    a = saved("a", nbytes=4_000_000, fw_last_use=5, bw_first_use=9, output_index=0)
    b = saved("b", nbytes=4_000_000, fw_last_use=5, bw_first_use=9, output_index=1)
    s = schedule_transfers([a, b], fw, bw, RATES)
    # forward: both released at 6 ms, 8 ms of copies on one link, the forward ends at 10 ms: 4 ms stall
    # backward: both needed at 9 ms; 8 ms of reloads from 0 ms fit.
    assert abs(s.stall - 4e-3) < 1e-9


def test_incremental_check_matches_brute_force():
    rng = random.Random(0)
    for trial in range(40):
        n_fw, n_bw = rng.randint(5, 30), rng.randint(5, 30)
        fw = [0.0]
        for _ in range(n_fw):
            fw.append(fw[-1] + rng.uniform(0.1, 2) * 1e-3)
        bw = [0.0]
        for _ in range(n_bw):
            bw.append(bw[-1] + rng.uniform(0.1, 2) * 1e-3)
        cands = [
            saved(f"t{i}", nbytes=rng.randint(1, 4) * 500_000, fw_last_use=rng.randrange(n_fw),
                  bw_first_use=rng.randrange(n_bw), output_index=i)
            for i in range(rng.randint(1, 12))
        ]  # fmt: skip
        checker = HiddenSetChecker(cands, fw, bw, RATES)
        chosen = []
        for t in sorted(cands, key=lambda t: -t.nbytes):
            expected = schedule_transfers(chosen + [t], fw, bw, RATES, max_inflight=0).stall < 1e-12
            assert checker.try_add(t) == expected, f"trial {trial}, {t.name}"
            if expected:
                chosen.append(t)


def test_schedule_is_deterministic():
    fw = [i * 1e-3 for i in range(11)]
    cands = [saved(f"t{i}", nbytes=1_000_000, fw_last_use=i, bw_first_use=9 - i, output_index=i) for i in range(8)]
    forward = schedule_transfers(cands, fw, fw, RATES).by_name()
    assert forward == schedule_transfers(list(reversed(cands)), fw, fw, RATES).by_name()


def test_min_tree_matches_a_list():
    """The segment tree behind the budget fit: built in O(n), range add, range min, argmin."""
    from fxoffload.schedule import _MinTree

    rng = random.Random(0)
    for n in (1, 2, 7, 64, 100):
        values = [rng.uniform(-10, 10) for _ in range(n)]
        tree = _MinTree.of(values)
        for _ in range(50):
            lo = rng.randrange(n)
            hi = rng.randrange(lo, n)
            delta = rng.uniform(-5, 5)
            tree.add(lo, hi, delta)
            for i in range(lo, hi + 1):
                values[i] += delta
            a = rng.randrange(n)
            b = rng.randrange(a, n)
            assert abs(tree.min(a, b) - min(values[a : b + 1])) < 1e-9
            assert values[tree.argmin()] == min(values)
