"""Run every ``benchmarks/bench_*.py`` (their ``main([])``), collecting JSON under benchmarks/results/.

Usage: ``python benchmarks/run_all.py [name ...]`` (names without the ``bench_`` prefix select a subset).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    """Run the selected benchmarks; return a process exit code (1 if any failed)."""
    selected = set(argv if argv is not None else sys.argv[1:])
    failed = []
    summary = {}
    for path in sorted(HERE.glob("bench_*.py")):
        name = path.stem.removeprefix("bench_")
        if selected and name not in selected:
            continue
        print(f"\n=== {path.name} ===", flush=True)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        start = time.perf_counter()
        try:
            spec.loader.exec_module(module)
            module.main([])
            summary[name] = {"ok": True, "seconds": round(time.perf_counter() - start, 2)}
        except Exception as exc:  # keep going: one broken benchmark must not hide the others
            failed.append(name)
            summary[name] = {"ok": False, "error": repr(exc)}
            print(f"FAILED: {exc!r}", flush=True)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "run_all.json").write_text(json.dumps(summary, indent=2))
    print("\nbenchmarks:", ", ".join(f"{k}={'ok' if v['ok'] else 'FAILED'}" for k, v in summary.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
