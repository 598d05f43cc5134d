"""The planner is a pure function: synthetic saved-tensor records in, decisions and reasons out."""

import dataclasses

import pytest
import torch

from fxoffload.analysis.graph import is_dense
from fxoffload.analysis.lifetimes import GraphLifetimes, SavedTensor
from fxoffload.options import OffloadOptions
from fxoffload.planning.plan import plan_offloads
from fxoffload.reasons import Action

KEEP, OFFLOAD = Action.KEEP, Action.OFFLOAD
from fxoffload.reasons import Action, Reason, ReasonCode

from .conftest import cpu_backend, train_step


def saved(name="t", nbytes=4 << 20, device="cuda", **kw) -> SavedTensor:
    base = dict(
        name=name, output_index=0, shape=(nbytes // 4,), stride=(1,), dtype=torch.float32,
        device=torch.device(device), nbytes=nbytes, producer="mm", storage=name, is_view=False,
        is_graph_input=False, is_static_input=False, is_user_output=False, is_dense=True,
        shares_storage_with=(), fw_position=3, fw_last_use=5, fw_last_user="u", fw_compute_after=10,
        bw_first_use=7, bw_first_user="g", bw_compute_before=10,
    )  # fmt: skip
    base.update(kw)
    return SavedTensor(**base)


def plan(records, **options):
    lifetimes = GraphLifetimes(tuple(records), 100, 100, ("cuda",))
    return plan_offloads(lifetimes, OffloadOptions.from_dict(options))


@pytest.mark.parametrize(
    "fields, code, sentence",
    [
        (dict(is_static_input=True, is_graph_input=True), "static_input", "parameter or buffer"),
        (dict(is_graph_input=True), "graph_input", "graph input"),
        (dict(is_user_output=True), "user_output", "returned to the caller"),
        (dict(shares_storage_with=("v",), storage="b"), "shared_storage", "also saved as v"),
        (dict(is_dense=False, stride=(2,)), "non_dense", "non-dense layout"),
        (dict(resolved_per_op="conjugate"), "lazy_view", "a lazy conjugate view: torch resolves it"),
        (dict(nbytes=1024), "min_bytes", "1.0 KiB < min_bytes (1.0 MiB)"),
        (dict(nbytes=0, shape=(0,)), "empty", "empty tensor"),
        (dict(device="cpu"), "cpu_tensor", "offload_cpu=True"),
        (dict(device="meta"), "meta_tensor", "meta tensor"),
        (dict(bw_first_use=-1), "unused_in_backward", "not used by the backward"),
    ],
)
def test_each_ineligible_case_is_kept_with_its_reason(fields, code, sentence):
    (d,) = plan([saved(**fields)], policy="all").decisions
    assert d.decision == KEEP and d.reason.code == code
    assert sentence in d.reason.text


def test_decisions_are_actions_equal_to_the_old_strings():
    p = plan([saved("a"), saved("b", nbytes=1024, output_index=1)], policy="all")
    a, b = p.decisions
    assert a.decision is Action.OFFLOAD and a.decision == "offload" and f"{a.decision}" == "offload"
    assert b.decision is Action.KEEP and str(b.decision) == "keep"
    assert {"offload": 1}[a.decision] == 1  # hashes as its string
    assert a.reason.code is ReasonCode.POLICY_ALL and str(a.reason) == a.reason.text
    assert a.recompute_refused is None


def test_reason_codes_are_one_enumerated_set():
    assert Reason("min_bytes", "x").code is ReasonCode.MIN_BYTES
    with pytest.raises(ValueError, match=r"unknown reason code 'too_big'; codes are: policy_none, cuda_graphs"):
        Reason("too_big", "x")
    assert all(c.value == c.name.lower() for c in ReasonCode)  # stable snake_case, one per member


def test_a_view_whose_base_is_not_saved_is_offloadable():
    (d,) = plan([saved(is_view=True, storage="relu")], policy="all").decisions
    assert d.decision == OFFLOAD


def test_auto_keeps_tensors_needed_again_at_once():
    late = saved("last_layer", fw_compute_after=1, bw_compute_before=2)
    early = saved("first_layer", output_index=1)
    decisions = {d.saved.name: d for d in plan([late, early], policy="auto", prefetch=4).decisions}
    assert decisions["first_layer"].decision == OFFLOAD
    assert decisions["first_layer"].reason.code == "idle_window"
    assert decisions["last_layer"].decision == KEEP and decisions["last_layer"].reason.code == "too_soon"
    assert "needed again too soon" in decisions["last_layer"].reason.text
    all_policy = {d.saved.name: d.decision for d in plan([late, early], policy="all").decisions}
    assert all_policy == {"last_layer": OFFLOAD, "first_layer": OFFLOAD}


def test_host_budget_takes_largest_first_deterministically():
    records = [saved(f"t{i}", nbytes=n << 20, output_index=i) for i, n in enumerate([2, 8, 4, 8])]
    lifetimes = GraphLifetimes(tuple(records), 100, 100, ("cuda",))
    options = OffloadOptions(policy="all")
    first = plan_offloads(lifetimes, options, host_bytes_available=13 << 20)
    assert [d.saved.name for d in first.offloaded] == ["t1", "t2"]  # 8 MiB then 4 MiB; the other 8 does not fit
    assert first.decisions[3].reason.code == ReasonCode.HOST_BUDGET
    assert first.decisions[3].reason.text.startswith("host_budget reached: 8.0 MiB of the 13.0 MiB left")
    assert first == plan_offloads(lifetimes, options, host_bytes_available=13 << 20)


def test_cpu_only_graph_is_left_unchanged_with_a_note():
    lifetimes = GraphLifetimes((saved(device="cpu"),), 10, 10, ("cpu",))
    p = plan_offloads(lifetimes, OffloadOptions(policy="all"))
    assert p.offloaded == () and "no accelerator tensors" in p.note
    assert p.decisions[0].reason.code == "no_accelerator" and p.decisions[0].reason.text == p.note


def test_policy_none_keeps_everything():
    p = plan([saved()], policy="none")
    assert p.offloaded == () and p.decisions[0].reason == Reason("policy_none", "policy='none'")


def test_a_disabled_graph_keeps_everything_with_the_disabling_reason():
    lifetimes = GraphLifetimes((saved(),), 10, 10, ("cuda",))
    why = Reason(ReasonCode.CUDA_GRAPHS, "CUDA graphs are on")
    p = plan_offloads(lifetimes, OffloadOptions(policy="all"), disabled_reason=why)
    assert p.decisions[0].reason is why and p.note == "CUDA graphs are on"
    (d,) = plan_offloads(lifetimes, OffloadOptions(policy="all"), disabled_reason="off for a test").decisions
    assert d.reason == Reason(ReasonCode.DISABLED, "off for a test")


def test_is_dense():
    assert is_dense(torch.empty(4, 6).t())
    assert is_dense(torch.empty(2, 3, 4, 5).permute(0, 2, 3, 1))
    assert not is_dense(torch.empty(4, 6)[:, :3])
    assert not is_dense(torch.empty(4, 1).expand(4, 6))


def test_cuda_graph_modes_turn_offloading_off_with_a_reason():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    x = (torch.randn(4, 16),)
    backend = cpu_backend(mode="reduce-overhead")
    got = train_step(lambda_module(model), x, backend)
    ref = train_step(lambda_module(model), x)
    torch.testing.assert_close(got[0], ref[0])
    (report,) = backend.reports
    assert report.offloaded == () and "CUDA graphs" in report.note
    assert {r.reason_code for r in report.saved} == {"cuda_graphs"}


def lambda_module(seq):
    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = seq

        def forward(self, x):
            return self.seq(x).sum()

    return Wrap()


def test_saved_tensor_records_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        saved().nbytes = 1


def test_a_recompute_chain_holds_its_source_from_when_the_next_link_is_rebuilt():
    """sin = sin(mm), both recomputed: mm is off the device until just before sin is rebuilt (sin's
    first use comes first), not until its own first use; a link with no recomputed reader keeps
    its own interval."""
    from fxoffload.planning.budget import estimated_interval as _estimated_interval, recompute_ends as _recompute_ends
    from fxoffload.analysis.recompute import RecomputeOption

    fw_points = 20
    mm = saved("mm", fw_last_use=5, bw_first_use=15)
    sin = saved("sin", fw_last_use=6, bw_first_use=4)
    other = saved("other", fw_last_use=6, bw_first_use=9)
    options = {
        "mm": RecomputeOption("mm", "mm", 1e-5, ()),
        "sin": RecomputeOption("sin", "sin", 1e-6, ("mm",)),
        "other": RecomputeOption("other", "relu", 1e-6, ("kept",)),
    }
    ends = _recompute_ends(options, {t.name: t for t in (mm, sin, other)}, fw_points)
    assert ends["sin"] == _estimated_interval(sin, fw_points)[1] == fw_points + 4 - 1
    assert ends["mm"] == ends["sin"] - 1
    assert ends["other"] == _estimated_interval(other, fw_points)[1]
    # Without its reader recomputed, mm keeps its own interval.
    alone = _recompute_ends({"mm": options["mm"]}, {"mm": mm}, fw_points)
    assert alone["mm"] == fw_points + 15 - 1


def test_every_reason_code_is_documented():
    from pathlib import Path

    guide = (Path(__file__).parent.parent / "docs" / "user-guide.md").read_text()
    section = guide.split("## Reason codes", 1)[1].split("\n## ", 1)[0]
    missing = [c.value for c in ReasonCode if f"`{c.value}`" not in section]
    assert not missing, f"add these codes to the table in docs/user-guide.md: {missing}"


def test_a_missed_aim_names_the_budget_and_what_the_fit_aimed_at():
    """Planned again for a lower target after the code missed (``budget_target``), an unreachable aim is
    said as the user's memory_budget and the predicted peak aimed at; where the fit aims at the budget
    itself, the budget alone is named."""
    from fxoffload.analysis.cost import DeviceRates
    from fxoffload.analysis.memory import MemoryPoint, MemoryTimeline
    from fxoffload.planning.decisions import PlanCosts

    mib = 1 << 20
    rates = DeviceRates("test", flops=1e12, memory_bandwidth=1e11, d2h=1e9, h2d=1e9, launch=0.0)
    points = tuple(
        MemoryPoint("forward" if i < 10 else "backward", f"n{i}", {"other": 2 * mib, "saved": 4 * mib if 3 <= i <= 17 else 0})
        for i in range(20)
    )  # fmt: skip
    starts = tuple(i * 1e-3 for i in range(11))
    costs = PlanCosts(rates, starts, starts, MemoryTimeline(points))
    lifetimes = GraphLifetimes((saved("t", fw_last_use=3, bw_first_use=7),), 10, 10, ("cuda",))
    options = OffloadOptions(policy="auto", min_bytes=0, memory_budget="5MiB")
    with pytest.warns(RuntimeWarning) as said:
        planned = plan_offloads(lifetimes, options, costs=costs, budget_target=mib)
    (message,) = [str(w.message) for w in said]
    assert message.startswith(
        "fxoffload: memory_budget 5.0 MiB (aiming the predicted peak at 1.0 MiB) cannot be reached: the smallest "
        "predicted peak is 6.0 MiB (at forward node n3)"
    ), message
    assert (planned.memory_budget, planned.budget_target) == (5 * mib, mib)
    with pytest.warns(RuntimeWarning, match=r"memory_budget 1.0 MiB cannot be reached: the smallest"):
        plan_offloads(lifetimes, options.replace(memory_budget=mib), costs=costs)
