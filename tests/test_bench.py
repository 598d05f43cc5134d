"""The benchmark harness keeps working (a CPU smoke run: tiny preset, one timed step)."""

import json

from bench.__main__ import main


def test_bench_smoke(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--preset", "tiny", "--steps", "1", "--warmup", "0", "--batch", "2",
                 "--methods", "eager,fxoffload-all", "--json", str(out)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    assert [r["method"] for r in data["rows"]] == ["eager", "fxoffload-all"]
    assert data["rows"][1]["offloaded_MiB"] > 0
    assert "CPU" in data["conditions"]["device"]
    assert "fxoffload-all" in capsys.readouterr().out
