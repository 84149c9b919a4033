"""scripts/device_check.sh, the accelerator check, as its CPU smoke run (--quick): every phase runs and the figures
land in a results file's device-check block, newest first, without touching the rest of the file."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_device_check_quick_records_a_section(tmp_path):
    results = tmp_path / "results.md"
    results.write_text("# Results\n\nearlier text\n")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), "--quick", "--results", str(results),
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    sys.path.insert(0, str(ROOT / "scripts"))
    import device_check

    device_check.record(results, "### a later run\n")  # a second run goes first in the same block
    assert res["attention"]["rc"] == 0 and "passed" in res["attention"]["summary"]
    assert {(row["model"], row["method"]) for row in res["rows"]} == {("zoo", "ar"), ("llama-3.2-1b", "ar")}
    assert all(row["tokens_per_s"] > 0 and row["compile_s"] > 0 for row in res["rows"])
    assert {v["k"] for v in res["verify"]} == {1, 2}
    load = res["load"]  # the serving engine under load: 2 closed-loop clients on 2 slots against generate's batches
    assert [(r["method"], r["clients"]) for r in load["rows"]] == [("ar", 2)]
    assert load["rows"][0]["tokens_per_s"] > 0 and load["rows"][0]["x_fixed"] > 0 and load["static_x_fixed"] > 0
    assert 0 < load["rows"][0]["fill_ceiling"] <= 1
    text = results.read_text()
    assert text.startswith("# Results\n\nearlier text\n") and text.count("## Accelerator check") == 1
    assert text.count("CPU smoke run (--quick)") == 1 and "| zoo | ar | 1 |" in text
    assert "The serving engine under closed-loop load" in text and "| ar | 2 |" in text
    assert text.index("### a later run") < text.index("CPU smoke run")
