import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_runtime_probe_runs_as_typed(tmp_path):
    """`python scripts/runtime_probe.py ...` on a 2-layer target: a row per method, outputs identical to plain
    greedy, the runtime's own time and the reads per round measured, one read per greedy round where promised."""
    out = tmp_path / "probe.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "runtime_probe.py"), "--layers", "2", "--hidden", "64",
           "--vocab", "512", "--prompts", "1", "--prompt-len", "16", "--max-new-tokens", "12", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    results = json.loads(out.read_text())
    rows = {r["method"]: r for r in results["methods"]}
    assert set(rows) == {"eagle3-chain", "eagle3-tree", "eagle3-dynamic", "eagle3-dynamic-tensor", "medusa", "lookup",
                         "peagle", "dflash", "dflash-dynamic", "dflash-dynamic-tensor", "layerskip", "layerskip-nostop",
                         "draft-model",
                         "lookahead", "suffix", "hybrid"}
    assert results["plain_step_ms"] > 0
    for name, r in rows.items():
        assert r["identical"], name
        assert r["own_ms_per_round"] > 0 and 0 < r["own_share"] < 1 and r["rounds"] > 0
        assert 10 < r["torch_calls_per_round"] < 1000, (name, r["torch_calls_per_round"])
        # every drafter kind: one read per round (a dynamic tree grown with tensor ops, EAGLE's or DFlash's, reads its
        # shape with the verification); the host versions (a CPU's default) EAGLE's one per level, DFlash's one more;
        # LayerSkip's early stop on a CPU one per drafted token; a greedy hybrid with a fixed tree stacks its drafts
        # unread (hybrid.stack_drafts)
        if name not in ("eagle3-dynamic", "dflash-dynamic", "layerskip"):
            assert r["reads_per_round"] == 1.0, (name, r["reads_per_round"])
    assert rows["eagle3-dynamic"]["reads_per_round"] > 2.0 and rows["layerskip"]["reads_per_round"] > 1.0
    assert 1.0 < rows["dflash-dynamic"]["reads_per_round"] <= 2.0
    # the drafters with modules spend time in them; P-EAGLE drafts in one pass a round (the prompt's round none)
    for name in ("eagle3-chain", "medusa", "peagle", "dflash", "draft-model", "hybrid"):
        assert rows[name]["draft_ms_per_round"] > 0, name
    assert 0.5 < rows["peagle"]["draft_passes_per_round"] <= 1.0 < rows["eagle3-chain"]["draft_passes_per_round"]
    assert "own ms/round" in res.stdout and "medusa" in res.stdout


def test_runtime_probe_refuses_an_unknown_method():
    cmd = [sys.executable, str(ROOT / "scripts" / "runtime_probe.py"), "--methods", "medusa,beam"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "unknown method(s) ['beam']" in res.stderr


def test_torch_calls_are_counted_outside_the_timed_calls_only():
    """``counted_calls``: a torch call or tensor method outside the meter's timed calls counts, one inside a metered
    module's forward does not, nor does reading an attribute such as ``.shape``."""
    import torch

    from headway.bench.runtime_probe import Meter, counted_calls, metered

    layer, x = torch.nn.Linear(4, 4), torch.ones(2, 4)
    meter = Meter()
    with metered(meter, [layer]), counted_calls(meter):
        y = x + 1  # 1
        y.sum()  # 2
        _ = y.shape, y.device
        layer(y)  # F.linear inside the forward: not counted
        torch.cat([y, y])  # 3
    assert meter.torch_calls == 3
