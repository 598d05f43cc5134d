"""A user's own policy: a function of each saved tensor's TensorInfo, or offload_modules patterns.

Synthetic records for the rules (what the user may override, what not), then the built-in GPT and a
tiny Hugging Face Llama for what the function sees, what the plan does, and parity with eager.
"""

import copy
import fnmatch
import re
import warnings

import pytest
import torch

import fxoffload
from fxoffload.analysis.lifetimes import GraphLifetimes
from fxoffload.testing.models import GPT, GPTConfig, gpt_batch
from fxoffload.options import OffloadOptions
from fxoffload.planning.plan import plan_offloads
from fxoffload.planning.policy import TensorInfo
from fxoffload.reasons import Action
from fxoffload.analysis.recompute import RecomputeOption

from .conftest import assert_same, returned_names, routed_tokens, train_step
from .test_plan import saved

FAST = dict(offload_cpu=True, inner="aot_eager")


def _plan(records, recompute=None, refused=None, host_bytes_available=None, **options):
    lifetimes = GraphLifetimes(tuple(records), 100, 100, ("cuda",))
    p = plan_offloads(
        lifetimes, OffloadOptions.from_dict(options), recompute=recompute, recompute_refused=refused,
        host_bytes_available=host_bytes_available,
    )  # fmt: skip
    return {d.saved.name: d for d in p.decisions}


def _by_name(**choices):
    def policy(t):
        return choices.get(t.name)

    return policy


# --- the rules, on synthetic records ---------------------------------------------------------------


def test_a_user_keep_is_never_overridden():
    d = _plan([saved("a"), saved("b", output_index=1)], policy=_by_name(a="keep"))
    assert d["a"].decision == "keep" and d["a"].reason.code == "user_policy"
    assert d["a"].reason.text == "the policy function policy asked to keep"
    assert d["b"].decision == "offload" and d["b"].reason.code == "idle_window"  # None: auto decides


def test_a_user_keep_is_not_overridden_by_memory_budget_either():
    """Under a budget the fit may offload or recompute tensors auto left; not one the user kept."""
    from fxoffload.planning.decisions import PlanCosts
    from fxoffload.analysis.cost import DeviceRates
    from fxoffload.analysis.memory import MemoryPoint, MemoryTimeline

    rates = DeviceRates("test", d2h=1e6, h2d=1e6, flops=1e12, memory_bandwidth=1e12)
    live = [(100 << 20) if 2 <= i <= 17 else 0 for i in range(20)]  # a and b: last use to reload
    phase = ["forward"] * 10 + ["backward"] * 10
    points = tuple(MemoryPoint(phase[i], f"n{i}", {"saved": live[i]}) for i in range(20))
    starts = tuple(float(i) * 1e-6 for i in range(11))
    costs = PlanCosts(rates, starts, starts, MemoryTimeline(points))
    records = [saved(n, output_index=i, fw_last_use=1, bw_first_use=8) for i, n in enumerate("ab")]
    lifetimes = GraphLifetimes(tuple(records), 10, 10, ("cuda",))
    option = {n: RecomputeOption(n, "mm", 1e-9, ()) for n in ("a", "b")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # 1 KiB cannot be reached
        options = OffloadOptions(policy=_by_name(a="keep"), memory_budget="1KiB")
        p = plan_offloads(lifetimes, options, costs=costs, recompute=option)
    d = {x.saved.name: x for x in p.decisions}
    assert d["a"].decision == "keep" and d["a"].reason.code == "user_policy"
    assert d["b"].decision != "keep", "the budget acts on the tensor the user left to it"


def test_a_user_offload_overrides_min_bytes_not_the_hard_rules():
    records = [
        saved("small", nbytes=1024),
        saved("ret", is_user_output=True, output_index=1),
        saved("param", is_static_input=True, is_graph_input=True, output_index=2),
        saved("soon", fw_compute_after=0, bw_compute_before=0, output_index=3),
    ]
    d = _plan(records, policy=lambda t: "offload")
    assert d["small"].decision == "offload" and d["small"].reason.code == "user_policy"
    assert d["soon"].decision == "offload", "auto's window rule is the planner's judgement, not a hard rule"
    refused = (("ret", "user_output", "returned to the caller"), ("param", "static_input", "parameter"))
    for name, code, why in refused:
        assert d[name].decision == "keep" and d[name].reason.code == code
        prefix = "the policy function <lambda> asked to offload, but it stays on the device: "
        assert d[name].reason.text.startswith(prefix)
        assert why in d[name].reason.text


def test_user_offloads_take_the_host_budget_first():
    records = [saved("mine", nbytes=2 << 20), saved("big", nbytes=8 << 20, output_index=1),
               saved("late", nbytes=4 << 20, output_index=2)]  # fmt: skip
    mine = _by_name(mine="offload", late="offload")
    d = _plan(records, host_bytes_available=10 << 20, policy=mine, min_bytes=0)
    assert d["late"].decision == d["mine"].decision == "offload"
    assert d["big"].decision == "keep" and d["big"].reason.code == "host_budget"
    d = _plan(records, host_bytes_available=5 << 20, policy=mine)
    assert d["late"].decision == "offload"
    assert d["mine"].decision == "keep" and d["mine"].reason.code == "host_budget"
    text = "asked to offload, but it stays on the device: host_budget reached: 4.0 MiB of the 5.0 MiB"
    assert text in d["mine"].reason.text


def test_a_user_recompute_needs_a_recompute_option():
    option = RecomputeOption("a", "mm", 1e-6, ("src",))
    refusal = fxoffload.reasons.Reason("random_op", "random op: recomputing would draw different numbers")
    records = [saved(n, output_index=i) for i, n in enumerate(("a", "b", "c", "src"))]
    asks = _by_name(a="recompute", b="recompute", c="recompute")
    d = _plan(records, {"a": option}, {"b": refusal}, policy=asks)
    assert d["a"].decision == "recompute" and d["a"].recompute is option
    assert d["a"].reason.code == "user_policy"
    assert d["b"].decision == "keep" and d["b"].reason.code == "random_op"
    assert d["b"].recompute_refused is refusal
    assert "asked to recompute, but it stays on the device: random op" in d["b"].reason.text
    assert d["c"].decision == "keep" and d["c"].reason.code == "user_recompute_unavailable"
    # What it is rebuilt from stays on the device, whatever auto would have done.
    assert d["src"].decision == "keep" and d["src"].reason.code == "recompute_source"
    assert d["src"].reason.text == "kept on the device: a recomputed from it"


def test_offload_modules_and_a_function_together():
    records = [
        saved("fc", module_path="blocks.0.mlp.fc"),
        saved("qkv", module_path="blocks.0.attn.qkv", output_index=1),
        saved("top", output_index=2),
    ]
    d = _plan(records, offload_modules=("*.mlp.*",), policy=_by_name(fc="keep"), min_bytes="1GiB")
    assert d["fc"].decision == "keep" and d["fc"].reason.code == "user_policy"  # the function comes first
    assert d["qkv"].decision == "keep" and d["qkv"].reason.code == "min_bytes"
    d = _plan(records, offload_modules=("*.mlp.*", "*.qkv"), min_bytes="1GiB")
    assert d["fc"].reason.code == d["qkv"].reason.code == "user_module"
    why = "produced by blocks.0.mlp.fc, which matches offload_modules pattern '*.mlp.*'"
    assert d["fc"].reason.text == why
    assert d["top"].decision == "keep", "no module path matches no pattern"


@pytest.mark.parametrize("returned", ["Offload", 1, True, "all"])
def test_a_policy_returning_something_else_raises(returned):
    message = (
        rf"the policy function <lambda> returned {re.escape(repr(returned))} for saved tensor t "
        r"\(no module\); return 'offload', 'keep', 'recompute'"
    )
    with pytest.raises(ValueError, match=message):
        _plan([saved()], policy=lambda t: returned)


def test_actions_are_accepted_as_returns():
    assert fxoffload.Action is Action
    d = _plan([saved("a"), saved("b", output_index=1)], policy=_by_name(a=Action.KEEP, b=Action.OFFLOAD))
    assert (d["a"].decision, d["b"].decision) == ("keep", "offload")


# --- real models -----------------------------------------------------------------------------------


def _gpt():
    torch.manual_seed(0)
    cfg = GPTConfig(dropout=0.0)
    return GPT(cfg), gpt_batch(cfg, 4)


def test_gpt_policy_sees_each_saved_tensor_and_the_plan_does_what_it_asks():
    model, batch = _gpt()
    seen: list[TensorInfo] = []

    def policy(t: TensorInfo):
        seen.append(t)
        if t.module_path.startswith("blocks.1."):
            return "offload"
        return "keep" if t.module_path.startswith("blocks.0.") else None

    backend = fxoffload.backend(policy=policy, min_bytes=0, **FAST)
    got = train_step(model, batch, backend)
    assert_same(got, train_step(model, batch), rtol=1e-4, atol=1e-5)
    (report,) = backend.reports
    rows = {r.name: r for r in report.saved}
    info = {t.name: t for t in seen}
    assert info.keys() == rows.keys(), "called once for every saved tensor"
    assert all(type(t) is fxoffload.TensorInfo for t in seen), "the type a user's annotation names"
    for name, t in info.items():
        r = rows[name]
        assert (t.shape, str(t.dtype), t.nbytes, t.producer, t.module_path) == (
            r.shape, f"torch.{r.dtype}", r.nbytes, r.producer, r.module_path
        )
    paths = {t.module_path for t in seen}
    assert {"blocks.0.fc", "blocks.1.fc", "blocks.0.ln2", "blocks.1.qkv"} <= paths, paths
    fc = [t for t in seen if t.module_path == "blocks.0.fc" and t.producer == "addmm"]
    assert fc and fc[0].shape == (4 * 64, 4 * 64), "the fc output: (batch*seq, 4*dim)"
    for r in report.saved:
        if r.module_path.startswith("blocks.1."):
            assert r.decision == "offload" or r.reason.startswith("the policy function"), r
            assert r.reason_code == "user_policy" or r.decision == "keep"
        elif r.module_path.startswith("blocks.0."):
            assert r.decision == "keep" and r.reason_code == "user_policy", r
        else:
            assert r.reason_code not in ("user_policy", "user_module"), r
    assert any(r.module_path.startswith("blocks.1.") and r.decision == "offload" for r in report.saved)


def test_gpt_policy_recompute_is_carried_out_by_the_partitioner():
    model, batch = _gpt()

    def policy(t):  # the fc layers' outputs (before GELU): one addmm each, from a kept input
        return "recompute" if t.module_path.endswith(".fc") and t.producer == "addmm" else None

    backend = fxoffload.backend(policy=policy, min_bytes=0, **FAST)
    got = train_step(model, batch, backend)
    assert_same(got, train_step(model, batch), rtol=1e-4, atol=1e-5)
    (report,) = backend.reports
    assert [r.module_path for r in report.recomputed] == ["blocks.0.fc", "blocks.1.fc"], report.table()
    assert all(r.reason_code == "user_policy" and r.recomputed_from for r in report.recomputed)
    assert not {r.name for r in report.recomputed} & returned_names(report.fw_code), "still saved"
    for r in report.recomputed:
        assert re.search(rf"\b{r.name} = torch.ops.aten.addmm", report.bw_code), "rebuilt in the backward"
        for source in r.recomputed_from.split(", "):
            row = next(x for x in report.saved if x.name == source)
            assert row.decision == "keep" and row.reason_code == "recompute_source", row
    # Refusals are on the rows of what could not be recomputed, with their codes.
    refused = {r.recompute_refused_code for r in report.saved if r.recompute_refused_code}
    assert {"graph_input", "shared_storage"} <= refused, refused



def _llama():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from .test_hf import SEQ, VOCAB, llama

    torch.manual_seed(0)
    return llama().train(), torch.randint(0, VOCAB, (2, SEQ)), transformers


def _hf_train(model, ids, backend):
    model = copy.deepcopy(model)
    fn = model if backend is None else torch.compile(model, backend=backend)
    loss = fn(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()[None], {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_llama_offload_modules_offloads_exactly_the_matching_tensors():
    model, ids, _ = _llama()
    seen = []
    backend = fxoffload.backend(offload_modules=("*.mlp.*",), min_bytes="1GiB", **FAST)
    spy = fxoffload.backend(policy=lambda t: seen.append(t), **FAST)  # records, decides nothing
    got = _hf_train(model, ids, backend)
    assert_same(got, _hf_train(model, ids, None), rtol=1e-4, atol=1e-5)
    (report,) = backend.reports
    matching = {r.name for r in report.saved if fnmatch.fnmatchcase(r.module_path, "*.mlp.*")}
    assert len(matching) >= 8, report.table()  # gate, up and down projections of both layers
    assert {r.name for r in report.offloaded} == matching, report.table()
    assert {r.reason_code for r in report.offloaded} == {"user_module"}
    paths = {r.module_path for r in report.offloaded}
    assert {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.up_proj"} <= paths
    torch._dynamo.reset()
    _hf_train(model, ids, spy)
    by_path = {t.module_path: t for t in seen if t.producer == "mm"}
    gate = by_path["model.layers.0.mlp.gate_proj"]
    assert gate.shape == (2 * 32, 128) and gate.dtype == torch.float32 and gate.nbytes == 64 * 128 * 4


def test_llama_policy_function_parity_and_plan():
    model, ids, _ = _llama()

    def policy(t):
        if ".self_attn." in t.module_path:
            return "offload"
        return "keep"

    backend = fxoffload.backend(policy=policy, **FAST)
    got = _hf_train(model, ids, backend)
    assert_same(got, _hf_train(model, ids, None), rtol=1e-4, atol=1e-5)
    (report,) = backend.reports
    attn = {r.name for r in report.saved if ".self_attn." in r.module_path and r.reason_code == "user_policy"}
    assert attn and {r.name for r in report.offloaded} == attn, report.table()
    assert all(r.decision == "keep" for r in report.saved if r.name not in attn)


def test_a_policy_function_is_told_which_sizes_depend_on_the_data():
    """A routed expert's activations (``torch.where``'s count) reach a policy function with their
    estimated sizes named, so a rule on ``nbytes`` can tell an estimate from a size."""
    model, args, settings = routed_tokens()
    seen = []
    backend = fxoffload.backend(offload_cpu=True, inner="aot_eager", policy=lambda t: seen.append(t))
    with settings:
        train_step(model, args, backend)
    routed = [t for t in seen if t.data_dependent_dims]
    assert routed and all(t.data_dependent_dims == (0,) and t.shape[0] == 256 for t in routed), seen
    assert any(t.producer == "placeholder" and not t.data_dependent_dims for t in seen)
