"""CPU smoke run of benchmarks/multigpu_nccl.py: the multi-GPU validation script under torchrun on 4 gloo
ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "multigpu_nccl.py"


def test_multigpu_script_passes_every_check_on_gloo(tmp_path):
    out = tmp_path / "multigpu.json"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",  # the gloo path even on a machine with GPUs
        "NEREUS_PG_TIMEOUT": "120",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        str(SCRIPT), "--quick", "--device", "cpu", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["backend"] == "gloo" and result["world"] == 4
    assert result["env"] == {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    failed = [c["name"] for c in result["checks"] if not c["passed"]]
    assert not failed and result["all_passed"], failed
    names = [c["name"] for c in result["checks"]]
    for prefix in ("forward/", "state/gqa_tied/", "state/qwen2/", "ppo/", "timing/"):
        assert any(n.startswith(prefix) for n in names), f"no {prefix} checks"
    for op in ("split", "merge", "extend", "destroy"):
        assert any(n.startswith("state/") and f"/{op} " in n for n in names), f"no state check after {op}"
    rows = {r["transition"]: r for r in result["timing"]["rows"]}
    assert set(rows) == {"Extend 2->4 GPUs", "Merge TP1x2->TP2", "Split TP2->TP1x2"}
    for row in rows.values():
        assert row["median_s"] > 0 and row["first_s"] > 0 and row["l_tran_s"] >= 0
        assert len(row["samples_s"]) == result["timing"]["repeats"]
    # The executor moved exactly the bytes the brain priced, plus AdamW steps and counters.
    extend = rows["Extend 2->4 GPUs"]
    assert (
        0 < extend["gb_moved_predicted"] <= extend["gb_moved_measured"] <= extend["gb_moved_predicted"] * 1.01
    )
    ppo = result["ppo"]
    assert len(ppo["plans"]) == 3 and ppo["plans"][0] != ppo["plans"][1] != ppo["plans"][2]
