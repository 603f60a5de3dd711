"""tools/budgets.py: a recorded bench run read against the host and device budgets (no GPU)."""

import copy
import json
import pathlib

from tests.tool_loader import load_tool

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run():
    return json.loads((ROOT / "docs" / "bench.json").read_text())


def test_the_recorded_run_against_itself_holds_every_budget(capsys):
    """docs/bench.json against itself: each op with decode cases gets its host medians, no
    device time moved, and (the run's host figures being within budget) exit status 0."""
    tool, run = load_tool("budgets"), _run()
    medians, misses = tool.read(run, run)
    ops = {c["op"] for c in run["cases"] if c.get("decode") and "host_us" in c["ropekv"]}
    assert set(medians) == ops and ops
    assert not [m for m in misses if m.startswith("device")]
    path = str(ROOT / "docs" / "bench.json")
    assert tool.main([path, path]) == (1 if misses else 0)
    assert ("all budgets hold" in capsys.readouterr().out) == (not misses)


def test_each_budget_flags_its_figure():
    """A case 3% slower, a decode call above 12 us, a first call above 150 us and an op whose
    CuPy median passes 8 us are each reported; a case only the new run has is not compared."""
    tool, old = load_tool("budgets"), _run()
    new = copy.deepcopy(old)
    decode = [c for c in new["cases"] if c.get("decode") and "host_us" in c["ropekv"]]
    slow, busy, first = decode[0], decode[1], decode[2]
    slow["ropekv"]["us"] *= 1.03
    busy["ropekv"]["host_us_torch"] = 12.5
    first["ropekv"]["first_us"] = 151.0
    op = decode[-1]["op"]
    for c in decode:
        if c["op"] == op:
            c["ropekv"]["host_us"] = 8.5
    extra = copy.deepcopy(slow)
    extra["name"] += " (new case)"
    new["cases"].append(extra)
    medians, misses = tool.read(old, new)
    assert medians[op]["host_us"] == 8.5
    text = "\n".join(misses)
    assert f"device {slow['name']}:" in text and "(1.030x)" in text
    assert f"host {busy['name']}: host_us_torch 12.5" in text
    assert f"first call {first['name']}: first_us 151.0" in text
    rounds = first["ropekv"].get("first_rounds", {}).get("first_us")
    if rounds:  # each round's figure beside the median: an op's edge shows as alternating rounds
        assert f"(rounds {' '.join(f'{us:.0f}' for us in rounds)})" in text
    assert f"host {op}: median host_us 8.5" in text
    assert extra["name"] not in text


def test_a_run_whose_peers_compiled_does_not_count():
    """A run in which FlashInfer built its modules (its ``peer_builds``) is flagged whatever its
    figures: host times taken after in-process builds read slower."""
    tool, old = load_tool("budgets"), _run()
    new = copy.deepcopy(old)
    new["peer_builds"] = {"flashinfer": [51.2, 2]}
    _, misses = tool.read(old, new)
    assert [m for m in misses if m.startswith("run: flashinfer compiled for 51 s in 2 cases")]
    new["peer_builds"] = {}
    _, misses = tool.read(old, new)
    assert not [m for m in misses if m.startswith("run:")]


def test_host_drift_sets_the_peers_beside_ropekv():
    """Each op's and each peer's median host time per call in both runs, ropekv's lines first:
    a run whose peers' host times moved with ropekv's shows it (the host moved, not the code)."""
    tool, old = load_tool("budgets"), _run()
    new = copy.deepcopy(old)
    for c in new["cases"]:
        if c.get("decode"):
            c["ropekv"]["host_us"] = c["ropekv"].get("host_us", 0) * 2
            for r in (c.get("peers") or {}).values():
                if isinstance(r, dict) and "host_us" in r:
                    r["host_us"] *= 2
    lines = tool.host_drift(old, new)
    ops = sorted({c["op"] for c in old["cases"] if c.get("decode") and "host_us" in c["ropekv"]})
    assert [line.split(":")[0] for line in lines[: len(ops)]] == [f"ropekv {op}" for op in ops]
    assert all(line.endswith("(2.00x)") for line in lines)
    peers = [line for line in lines if not line.startswith("ropekv ")]
    assert peers  # the recorded run times peers' host calls (FlashInfer, cuBLAS, ...)
    assert tool.host_drift(old, old) and all(
        line.endswith("(1.00x)") for line in tool.host_drift(old, old)
    )
