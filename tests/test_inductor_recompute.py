"""``memory_budget`` with ``recompute="inductor"``: torch's min-cut partitioner recomputes under its
own ``activation_memory_budget``, fxoffload offloads what hides on top (``compiler.inductor_recompute``).

Results never change (dropout included: its random draws are kept saved, and the test fails with
that rule broken on purpose), the budget is met in the code Inductor generated, the plan says which
tensors torch's partitioner recomputes, and where no activation budget meets the memory budget
fxoffload's own budget fit decides.
"""

import dataclasses
import logging
import warnings

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch import nn

import fxoffload
from fxoffload.planning.budget import BUDGET_TOLERANCE
from fxoffload.testing.models import example

from .conftest import assert_same, calls_cost_the_step, cpu_backend, train_step

D, N = 32, 1024  # small weights, large batch: activations dominate the peak
# A slow link: no offload hides, so what meets a budget is recomputation.
SLOW = {"bandwidth": "0.01GB", "compute_rates": {"flops": 1e13, "memory_bandwidth": 1e12}, "policy": "auto"}


@pytest.fixture(autouse=True)
def _eager_random():
    with inductor_config.patch(fallback_random=True):
        yield


class Dropouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = F.dropout(torch.relu(self.a(x)), 0.5, True)
        h = F.dropout(torch.tanh(self.b(h)), 0.5, True)
        return self.c(h).square().mean()


class Blocks(nn.Module):
    def __init__(self, blocks=3):
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(D, 4 * D, bias=False) for _ in range(blocks))
        self.down = nn.ModuleList(nn.Linear(4 * D, D, bias=False) for _ in range(blocks))

    def forward(self, x):
        for up, down in zip(self.up, self.down, strict=True):
            x = x + down(torch.sin(up(x)))
        return (x.sin() * x).mean()


def _backend(inner="aot_eager", **options):
    return cpu_backend(inner=inner, recompute="inductor", **{**SLOW, "offload_cpu": False, **options})


def _by_torch(report):
    return [r for r in report.saved if r.reason_code == "inductor_recompute"]


def test_dropout_draws_once_and_the_test_fails_with_the_rule_broken():
    """Under an activation budget torch's partitioner would recompute dropout with fresh random
    numbers (pytorch#190758); kept saved, the gradients are eager's. Broken on purpose, they are not."""
    torch.manual_seed(0)
    model, x = Dropouts(), (torch.randn(N, D),)
    eager = train_step(model, x)
    backend = _backend(memory_budget=0.8)
    assert_same(train_step(model, x, backend), eager, rtol=1e-4, atol=1e-6)
    (report,) = backend.reports
    assert "native_dropout.default(" not in report.bw_code

    torch._dynamo.reset()
    broken = _backend(memory_budget=0.8, broken_rule="random_ops_saved")
    with pytest.raises(AssertionError):
        assert_same(train_step(model, x, broken), eager, rtol=1e-4, atol=1e-6)
    (report,) = broken.reports
    assert "native_dropout.default(" in report.bw_code  # the backward draws again
    assert _by_torch(report), report.table()
    assert all("activation_memory_budget=" in r.reason for r in _by_torch(report)), report.table()


class KeptTokens(nn.Module):
    """Variable-length work: the first ``keep.sum().item()`` rows, and the rows a mask selects (sizes
    known only at run time)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x, keep):
        n = keep.sum().item()
        torch._check_is_size(n)
        torch._check(n <= x.shape[0])
        h = self.down(F.gelu(self.up(x[:n])))
        return h.square().mean() + self.down(self.up(x[keep.bool()])).mean()


def test_ops_binding_data_dependent_sizes_stay_saved_and_the_test_fails_with_the_rule_broken():
    """Under an activation budget torch's partitioner recomputes the ``.item()`` and the mask's
    ``nonzero`` in the backward; Inductor then cannot compile the forward (the symbols they bind are
    not among its outputs: ``PendingUnbackedSymbolNotFound``, as with ``backend="inductor"`` and
    ``activation_memory_budget`` alone). Kept saved, the graph compiles and its results are eager's."""
    torch.manual_seed(0)
    model, args = KeptTokens(), (torch.randn(N, D), (torch.rand(N) > 0.3).long())
    settings = torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)
    with settings:
        eager = train_step(model, args)
        backend = _backend("inductor", memory_budget=0.5)
        assert_same(train_step(model, args, backend), eager, rtol=1e-4, atol=1e-5)
        torch._dynamo.reset()
        broken = _backend("inductor", memory_budget=0.5, broken_rule="size_ops_saved")
        with pytest.raises(Exception, match="PendingUnbackedSymbolNotFound"):
            train_step(model, args, broken)
    (report,) = backend.reports
    assert "_local_scalar_dense.default(" not in report.bw_code and "nonzero.default(" not in report.bw_code


def test_inductor_code_meets_the_budget_and_matches_inductor():
    torch.manual_seed(0)
    model, x = Blocks(), (torch.randn(N, D),)
    backend = _backend("inductor", memory_budget=0.7, verify_peak=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a missed budget warns
        got = train_step(model, x, backend)
    assert_same(got, train_step(model, x, "inductor"), rtol=1e-5, atol=1e-7)
    (report,) = backend.reports
    assert _by_torch(report), report.table()
    assert report.compiled_memory().peak.total <= report.memory_budget, report.summary()
    # Each tensor torch recomputes is no longer an output of the forward graph's code.
    for row in _by_torch(report):
        assert f"{row.name}," not in report.fw_code.split("return")[-1], row.name


def test_the_replans_of_a_compile_price_on_the_partitions_torch_made_once(monkeypatch):
    """The plans a compile makes again for another target (its code peaked off the budget) price on
    the partitions torch's partitioner made for its first plan (2.4 s each for a 12-block GPT on this
    CPU, superlinear in the blocks): each activation budget is partitioned once, and again only where
    a plan keeps it (its graphs are the ones compiled, on the joint graph traced again). Results are
    Inductor's."""
    budgets = []
    call = fxoffload._compat.call_partitioner

    def counted(*args, **kwargs):
        if kwargs.get("activation_memory_budget") is not None:
            budgets.append(kwargs["activation_memory_budget"])
        return call(*args, **kwargs)

    monkeypatch.setattr(fxoffload._compat, "call_partitioner", counted)
    torch.manual_seed(0)
    model, x = Blocks(), (torch.randn(N, D),)
    backend = _backend("inductor", memory_budget=0.7, offload_cpu=True)
    got = train_step(model, x, backend)
    (report,) = backend.reports
    assert len(report.replans) == 2, report.replans  # two more plans, each priced on every partition
    assert len(set(budgets)) >= 3 and len(budgets) <= len(set(budgets)) + len(report.replans), budgets
    assert_same(got, train_step(model, x, "inductor"), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("recompute", ["inductor", "fxoffload"])
def test_recomputation_is_priced_at_the_backwards_measured_speed(recompute, monkeypatch):
    """Where the device ran the backward at a third of the model's time (``Measured.corrected``:
    ``PlanCosts.scale``, by which the stalls are timed too), what the backward recomputes costs a
    third as well: torch's partitions' recomputation and fxoffload's own options."""
    from fxoffload.compiler import inductor_recompute, offload_pass

    costs, plans_on, options = offload_pass._Context.costs, inductor_recompute._plans_on, offload_pass.recompute_options

    def priced(scale):
        seen = []

        def scaled(self, *args):
            return dataclasses.replace(costs(self, *args), scale=(1.0, scale))

        def partition_priced(part, *args):
            here = plans_on(part, *args)
            seen.append(here[0].recompute_s)  # what its plans are charged for recomputing
            return here

        def options_priced(*args, **kwargs):
            found, refused = options(*args, **kwargs)
            seen.extend(o.seconds for o in found.values())
            return found, refused

        monkeypatch.setattr(offload_pass._Context, "costs", scaled)
        monkeypatch.setattr(inductor_recompute, "_plans_on", partition_priced)
        monkeypatch.setattr(offload_pass, "recompute_options", options_priced)
        torch._dynamo.reset()
        torch.manual_seed(0)
        backend = cpu_backend(recompute=recompute, **{**SLOW, "offload_cpu": False, "memory_budget": 0.7})
        train_step(Blocks(), (torch.randn(N, D),), backend)
        monkeypatch.undo()
        return seen

    model, measured = priced(1.0), priced(1 / 3)
    # torch's partitions recompute tensors the first backward read saved: priced (a name the first
    # backward held as a placeholder was once taken for a node it computes, and cost nothing).
    assert len(model) == len(measured) and sum(model) > 0, (model, measured)
    assert measured == pytest.approx([s / 3 for s in model]), (model, measured)


def test_the_least_recomputation_that_meets_the_budget_is_kept():
    """A looser budget recomputes fewer saved tensors than a tighter one."""
    torch.manual_seed(0)
    model, x = Blocks(), (torch.randn(N, D),)
    recomputed = {}
    for budget in (0.9, 0.7):
        torch._dynamo.reset()
        backend = _backend(memory_budget=budget)
        train_step(model, x, backend)
        (report,) = backend.reports
        recomputed[budget] = sum(r.nbytes for r in _by_torch(report))
    assert 0 < recomputed[0.9] < recomputed[0.7], recomputed


@pytest.mark.parametrize("lower", ["torch's", "fxoffload's"])
def test_an_unreachable_budget_keeps_the_lower_of_torchs_partitions_and_fxoffloads_fit(lower, caplog):
    """At memory_budget 0.05 no partition of torch's meets the budget, and fxoffload's own fit is
    asked; the lower of the two on the memory model is kept, the budget said to be missed, with
    eager's results. ``Blocks`` (no offloading): the fit predicts 4.1 MiB at best, torch's activation
    budget 0.2 2.1 MiB, and torch's partition is kept. The example MLP (offloads, min_bytes 0): the
    fit 1.0 MiB, torch's 1.1 MiB, and the fit decides."""
    torch.manual_seed(0)
    if lower == "torch's":
        (model, x), backend = (Blocks(), (torch.randn(N, D),)), _backend(memory_budget=0.05)
    else:
        options = {"inner": "aot_eager", "recompute": "inductor", "offload_cpu": True, "min_bytes": 0}
        (model, x), backend = example("mlp"), fxoffload.backend(memory_budget=0.05, **options)
    with caplog.at_level(logging.INFO, logger="fxoffload"), pytest.warns(RuntimeWarning, match="cannot be reached"):
        got = train_step(model, x, backend)
    said = [r.getMessage() for r in caplog.records if r.name.endswith("offload_pass") and "own budget fit" in r.getMessage()]
    assert len(said) == 1, said
    (report,) = backend.reports
    assert report.predicted_peak_after > report.memory_budget
    if lower == "torch's":
        assert said[0].endswith("that partition is kept") and _by_torch(report), (said, report.table())
    else:
        assert "own budget fit decides" in said[0] and not _by_torch(report), (said, report.table())
    assert_same(got, train_step(model, x), rtol=1e-4, atol=1e-6)


def test_torchs_activation_budget_is_set_for_the_partition_only():
    before = functorch_config.activation_memory_budget
    torch.manual_seed(0)
    train_step(Blocks(), (torch.randn(N, D),), _backend(memory_budget=0.7))
    assert functorch_config.activation_memory_budget == before


def test_a_target_is_not_raised_where_the_budget_chose_nothing():
    """The offloads that hide meet the budget alone: the code well under it is no reason to plan again
    for a raised target (nothing the budget chose could be undone; it compiled the same plan twice)."""
    from fxoffload.testing.models import GPT, PRESETS, gpt_batch

    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    model, batch = GPT(cfg), gpt_batch(cfg, 8)
    # The op calls free, as an accelerator's host issues them: the offloads that hide meet the budget alone.
    backend = fxoffload.backend(
        offload_cpu=True, min_bytes="16KiB", memory_budget=0.6, recompute="inductor", op_time=0.0
    )
    torch.compile(model, backend=backend)(*batch).backward()
    (report,) = backend.reports
    assert report.offloaded and not _by_torch(report), report.table()
    assert not {r.reason_code for r in report.saved} & {"budget_offload", "budget_recompute"}, report.table()
    assert report.compiled_memory().peak.total < 0.9 * report.memory_budget
    assert report.replans == (), report.replans


def test_just_past_torchs_reach_offloads_on_top_of_its_recompute(caplog):
    """A budget that torch's partitioner with the offloads that hide just misses: an un-hidden offload
    on top of its recomputation meets it (the cheaper way), not fxoffload's own fit from the start
    (0.57: torch's partitions bottom out at 2.1 MiB in the code, the budget is 2.06 MiB)."""
    torch.manual_seed(0)
    model, x = Blocks(), (torch.randn(N, D),)
    backend = _backend("inductor", memory_budget=0.57, offload_cpu=True)
    with caplog.at_level(logging.INFO, logger="fxoffload"), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a missed budget warns
        got = train_step(model, x, backend)
    assert_same(got, train_step(model, x, "inductor"), rtol=1e-5, atol=1e-7)
    assert not any("fxoffload's own budget fit decides" in r.getMessage() for r in caplog.records)
    (report,) = backend.reports
    codes = {r.reason_code for r in report.saved}
    assert {"inductor_recompute", "budget_offload"} <= codes and "budget_recompute" not in codes, report.table()
    assert report.compiled_memory().peak.total <= report.memory_budget, report.summary()


# Copies that hide (a fast link, compute priced slow): what decides between them and torch's
# recomputation is what their op calls cost the compute stream.
HIDES = {"bandwidth": "100GB", "compute_rates": {"flops": 1e10, "memory_bandwidth": 1e10}, "policy": "auto"}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("op_time", [0.0, 0.1])
def test_offloads_that_hide_are_priced_by_their_op_calls(op_time, bf16, caplog):
    """Free op calls: the offloads that hide meet the budget at no cost, nothing is recomputed, and no
    other partition of torch's is made (none could cost less). At 0.1 s a tensor, torch's
    recomputation alone is the cheaper plan that meets it (with hidden copies priced free, as
    before, the offloads were kept and the calls paid every step)."""
    torch.manual_seed(0)
    model, x = Blocks(), (torch.randn(N, D),)
    backend = cpu_backend(inner="inductor", recompute="inductor", memory_budget=0.85, op_time=op_time,
                          **{**HIDES, "offload_cpu": True})  # fmt: skip
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with caplog.at_level(logging.INFO, logger="fxoffload"), warnings.catch_warnings(), amp:
        warnings.simplefilter("error", RuntimeWarning)  # a missed budget warns
        got = train_step(model, x, backend)
    with amp:
        expected = train_step(model, x, "inductor")
    assert_same(got, expected, rtol=1e-5, atol=1e-7)
    (report,) = backend.reports
    assert report.compiled_memory().peak.total <= report.memory_budget * (1 + BUDGET_TOLERANCE), report.summary()
    assert ("bfloat16" in report.table()) == bf16  # autocast reached the saved tensors
    chosen = [r.getMessage() for r in caplog.records if "plans priced, on" in r.getMessage()]
    assert chosen, [r.getMessage() for r in caplog.records]
    if op_time == 0.0:
        assert report.offloaded and not _by_torch(report), report.table()
        assert all("on 1 of torch's partitions" in m for m in chosen), chosen
        assert "fxoffload" in report.fw_code and "fxoffload" in report.bw_code  # Inductor's code copies
        return
    assert not report.offloaded and _by_torch(report), report.table()
    assert "fxoffload" not in report.fw_code + report.bw_code  # no copy in the code that runs
    kept = [r for r in report.saved if r.reason_code == "recompute_cheaper"]
    assert kept and all("activation_memory_budget=" in r.reason for r in kept), report.table()


def test_a_budgets_offloads_priced_again_where_their_calls_cost_more(monkeypatch):
    """No copy stalls (forced); the first steps measure both phases host-bound (the host's windows
    forced to the device's) and the calls' host time at 50 ms a tensor each way (forced): the plan's
    offloads cost the step far more than it priced them, so the plans that meet the budget are priced
    again with that price, and torch's recomputation alone meets it more cheaply. With the calls at the
    price planned (the same steps, ``calls_over_price`` answering no), the offloads stay."""
    from fxoffload.compiler import watch

    from fxoffload.planning.measured import Measured

    calls_cost_the_step(monkeypatch, 5e-2)
    # Compute as the model priced it: the first steps' ratio rests on one offload's windows here, and
    # under a suite beside it measured the backward at 108x the model (torch 2.11, 2026-12-02), which
    # priced recomputation dearer than the calls this test makes dear.
    for scale in ("fw_scale", "bw_scale"):
        monkeypatch.setattr(Measured, scale, property(lambda self: 1.0))
    reports = {}
    for dearer in (True, False):
        if not dearer:
            monkeypatch.setattr(watch, "calls_over_price", lambda plan, m: False)
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, x = Blocks(), (torch.randn(N, D),)
        options = {**HIDES, "offload_cpu": True}
        backend = cpu_backend(inner="aot_eager", recompute="inductor", memory_budget=0.7, **options)
        compiled = torch.compile(model, backend=backend)
        for _ in range(5):
            compiled(*x).backward()
        (reports[dearer],) = backend.reports
    assert reports[False].offloaded and not reports[False].replans, reports[False].table()
    report = reports[True]
    (why,) = [r for r in report.replans if r.startswith("measured in the first steps")]
    assert "the host bound the forward and backward" in why and "stalled" not in why, why
    assert not report.offloaded and _by_torch(report), report.table()
    assert "recompute_cheaper" in {r.reason_code for r in report.saved}, report.table()


def test_verify_peak_compiles_the_graph_unchanged_without_torchs_recompute():
    """To judge a plan, ``verify_peak`` compiles its graph without offloading: no budget, and so no
    ``recompute="inductor"`` (which needs one). It kept that option, and the compile raised
    "recompute='inductor' says what recomputes to meet a memory_budget, and none is set" (a
    stack of convolutions at 60%, as a new user's UNet)."""
    from .conftest import ConvStack

    torch.manual_seed(0)
    model, x = ConvStack(), torch.randn(2, 3, 16, 16)
    backend = _backend("inductor", memory_budget=0.6, verify_peak=True, offload_cpu=True)
    compiled = torch.compile(model, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the budget's verdict: not what this test is about
        compiled(x).backward()
    (report,) = backend.reports
    # Lowered once, for the budget's fraction (a fraction of that code's peak); verify_peak reuses it.
    assert [c.what for c in report.timings.spent].count(
        "the code without offloading, for memory_budget's fraction, not built"
    ) == 1, report.timings.spent
    assert "verify_peak: the code without offloading, not built" not in [c.what for c in report.timings.spent]
    # The plan kept, the report says what Inductor's code peaks at without it, above the plan's code.
    assert report.unchanged_code_peak > report.compiled_memory().peak_bytes
    peak = fxoffload.sizes.fmt_bytes(report.unchanged_code_peak)
    assert f"peak of Inductor's code without offloading: {peak} (lowered for its code alone" in report.summary()
    # That code, lowered for itself alone, is the code Inductor runs: the forward's output strides
    # (channels-last copies of the weights, saved) told to the backward's lowering as a whole compile
    # tells them (``_compat._report_output_strides``). Not told, its backward re-laid the weights out
    # and peaked higher than Inductor's own (820.3 against 737.6 KiB on a UNet).
    torch._dynamo.reset()
    inductors = fxoffload.backend(offload_cpu=True, policy="none")  # Inductor's code, replayed
    torch.compile(model, backend=inductors)(x).backward()
    assert report.unchanged_code_peak == inductors.reports[0].compiled_memory().peak_bytes
