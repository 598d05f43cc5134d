"""`make demo`: the figures a user came for come first, and the output fits a 110-column terminal."""

import re

import torch

from fxoffload.tools import demo


def test_demo_first_screen(monkeypatch, capsys):
    # The real demo compiles with Inductor twice (a minute on a CPU); aot_eager runs the same steps.
    monkeypatch.setenv("COLUMNS", "110")
    demo.main(["--steps", "4", "--inner", "aot_eager"])
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 110 for line in lines), "\n".join(line for line in lines if len(line) > 110)
    first = "\n".join(lines[:14])
    # The demo trains on the GPU where there is one, with the preset sized for it.
    preset = "small" if torch.cuda.is_available() else "tiny"
    for figure in (f"model : GPT preset {preset!r}", "peak memory of a steady step", "% less",
                   "step time, median of 20 after", "loss, last step", "saved tensors, "):
        assert figure in first, f"{figure!r} not in the first lines:\n{first}"  # fmt: skip
    counts = dict(re.findall(r"^offloaded \((\w+)\): (\d+) of \d+ saved tensors", first, re.M))
    assert set(counts) == {"auto", "all"} and int(counts["all"]) > 0, first
    # On a CPU the op calls run on the compute thread: "auto" keeps what they would slow, and says so.
    assert torch.cuda.is_available() or "reason op_time" in "\n".join(lines)
    text = "\n".join(lines)
    assert f"offloaded: {counts['all']} tensors" in text and "more kept" in text and "--all-rows" in text
    assert "decision" not in text  # the short table, not the full one
    assert "policy 'auto' offloads what hides" in text and "policy='all'" in text and "memory_budget=" in text


def test_the_closing_line_says_why_auto_was_planned_again():
    """What the first steps measured and ``auto`` did with it, from the reports: switched-off copies,
    a re-plan for stalls, for room, or for op calls that cost the step, or copies that hid."""
    from types import SimpleNamespace

    def backend(replans=(), switched=(), offloaded=()):
        return SimpleNamespace(reports=[SimpleNamespace(replans=replans, switched_off=switched, offloaded=offloaded)])

    calls = "measured in the first steps: each offloaded tensor's op calls cost 0.403 ms of the step (on a CPU ...)"
    said = "policy 'auto' offloads what hides behind compute and costs no time" + demo._first_steps(backend((calls,)))
    assert said.endswith("its offloads' op calls cost the step") and max(map(len, said.splitlines())) <= 110, said
    stalled = "measured in the first steps: the copies of bmm stalled the compute stream 1 ms a step"
    assert demo._first_steps(backend((stalled,), offloaded=("x",))).endswith("its copies stalled")
    assert demo._first_steps(backend(("measured ...: every copy hid, and ... has room for 1 MiB more",))).endswith(
        "with room for more"
    )
    assert "2 tensors measured stalling" in demo._first_steps(backend(switched=("a", "b")))
    assert demo._first_steps(backend(offloaded=("x",))) == "; its copies measured hiding in the first steps"
    assert demo._first_steps(backend()) == ""
