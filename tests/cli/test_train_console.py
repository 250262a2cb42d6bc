"""What ``nereus-train`` prints: the real entry point in a subprocess, its console read back."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from tests.helpers import nereus_train

MOVE = re.compile(r"^step (\d+) transition \[.*?\]: (.+?); .*took ([\d.e+-]+) s, moved ")
LAYOUT_CHANGE = re.compile(r"\w+ \(\d+,\d+,\d+\)->\(\d+,\d+,\d+\)")


@pytest.mark.distributed
def test_embedded_default_console_shows_each_transition_once_and_cleanly(tmp_path):
    # The embedded default with its pool change early (a rank goes at step 2, comes back at 5); the
    # preset's memory, since 8 steps are too few for the "auto" memory to leave a 3-GPU plan.
    out = nereus_train(
        tmp_path,
        "trainer.max_steps=8",
        "resources.counts=[4,4,3,3,3,4]",
        "task.gpu_memory=null",
        cwd=tmp_path,
    ).stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    lines = out.splitlines()

    moves = [m for m in map(MOVE.match, lines) if m]
    assert summary["transitions"] >= 1  # the pool change was crossed and acted on
    assert [int(m.group(1)) for m in moves] == summary["transition_steps"]  # one step numbering
    for m in moves:  # which model-stages changed, from which (dp,tp,pp) to which, and how long it took
        assert LAYOUT_CHANGE.search(m.group(2)) and float(m.group(3)) > 0

    log_lines = [line for line in lines[: next(i for i, ln in enumerate(lines) if ln.startswith("RL step"))]]
    repeated = {line: n for line, n in Counter(log_lines).items() if n > 1 and re.search(r"[A-Za-z]", line)}
    assert not repeated  # each record once (Hydra's handler, not also Lightning's)
    assert out.count("Initializing distributed") == 1 and out.count("fused pack/unpack kernels off") == 1
    assert "WARNING" not in out and "Warning" not in out  # the CPU path is the expected one

    bar = next(line for line in lines if line.startswith("RL step"))
    assert " 8/8 " in bar and "reward" in out and f"transitions: {len(moves)}" in out
    assert "run summary" in out and "what changed" in out
    for m in moves:
        assert re.search(rf"│\s+{m.group(1)} │", out)
    assert str(tmp_path / "decisions.jsonl") in out and str(tmp_path / "run.png") in out

    file_log = (tmp_path / "train.log").read_text()  # Hydra's file log keeps every rank's records
    assert all(m.group(0) in file_log for m in moves) and "[rank 3]" in file_log


def test_help_lists_only_the_groups_nereus_train_uses(tmp_path):
    out = nereus_train(tmp_path, "algorithm=grpo", "--help", cwd=tmp_path).stdout
    groups = re.findall(r"^  ([\w/]+)=(\S+)  \(options: ", out, flags=re.M)
    assert ("algorithm", "grpo") in groups and {"actor", "trainer", "controller", "task"} <= dict(
        groups
    ).keys()
    assert not [g for g, _ in groups if g.startswith(("plan", "trace", "hydra"))]
    assert out.startswith("nereus-train") and "max_steps" in out
