"""The transfer schedule and the incremental hidden-set check agree with a brute-force schedule."""

import random

from fxoffload.analysis.cost import DeviceRates
from fxoffload.planning.schedule import HiddenSetChecker, schedule_transfers

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
    from fxoffload.planning.trees import MinTree as _MinTree

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


def test_a_margin_checks_copies_as_if_the_link_were_slower_and_waits_for_them():
    """copy_margin=0.5: hidden means hidden at 1.5x the copy time (a link 1.5x slower), and the wait
    goes where that longer copy would be done; the stall is still predicted at the copy's own time."""
    import dataclasses

    rng = random.Random(1)
    margin = dataclasses.replace(RATES, copy_margin=0.5)
    slower = dataclasses.replace(RATES, d2h=RATES.d2h / 1.5, h2d=RATES.h2d / 1.5)
    fw = [i * 1e-3 for i in range(21)]
    cands = [saved(f"t{i}", nbytes=rng.randint(1, 6) * 500_000, fw_last_use=rng.randrange(20),
                   bw_first_use=rng.randrange(20), output_index=i) for i in range(12)]  # fmt: skip
    a, b = HiddenSetChecker(cands, fw, fw, margin), HiddenSetChecker(cands, fw, fw, slower)
    picks = [a.try_add(t) for t in cands]
    assert picks == [b.try_add(t) for t in cands] and 0 < sum(picks) < len(cands)
    # one 2 ms copy released at 4 ms: the wait goes after the node ending at 7 ms (3 ms later), not 6 ms
    (t,) = schedule_transfers([saved("x", nbytes=2_000_000, fw_last_use=3, bw_first_use=6)], fw, fw, margin).timings
    assert t.fw_wait_after == 6 and t.bw_issue_after == 2 and t.stall == 0
    assert (t.offload_start, t.offload_end) == (4e-3, 6e-3)  # predicted at the link's own speed


def test_cpu_prices_float32_matmuls_at_what_two_cores_reach():
    """float32 matmuls on a CPU at 1e11 FLOP/s (a tenth of ``CPU_RATES.flops``, the half-precision
    figure as on a GPU). At 1e10, GPT tiny's matmuls were priced 4-5x slower than measured, and the
    windows they span too long for policy="auto" to hide what it picked."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxoffload.analysis.cost import CPU_RATES, node_time

    gm = make_fx(torch.mm, tracing_mode="fake")(torch.randn(512, 64), torch.randn(64, 256))
    (mm,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert abs(node_time(mm, CPU_RATES) - (2 * 512 * 64 * 256 / 1e11 + CPU_RATES.launch)) < 1e-12
