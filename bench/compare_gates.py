"""Are two run directories' figures the same? The gate, the predictions, and every quantize and validate metric except
times, memory and host latency, compared exactly (for "behaviour unchanged" across a refactor, runs on one machine).

    .venv/bin/python bench/compare_gates.py RUN_BEFORE RUN_AFTER
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MACHINE_BOUND = ("second", "peak", "latency", "host")  # keys whose values depend on the machine's load, not the numbers


def _figures(run: Path) -> dict:
    report = json.loads((run / "report.json").read_text())
    stages = {s["name"]: {k: v for k, v in (s.get("metrics") or {}).items() if not any(m in k for m in MACHINE_BOUND)}
              for s in report["stages"] if s["name"] in ("quantize", "validate")}
    return {"gate": report["gate"], "predictions": report["predictions"], **stages}


def main() -> int:
    before, after = (_figures(Path(arg)) for arg in sys.argv[1:3])
    differ = [key for key in {*before, *after} if before.get(key) != after.get(key)]
    for key in sorted(differ):
        one, other = before.get(key) or {}, after.get(key) or {}
        inner = [k for k in {*one, *other} if one.get(k) != other.get(k)]
        print(f"{key} differs: {', '.join(sorted(map(str, inner))) or 'whole'}")
    checks = {c["name"]: c["value"] for c in after["gate"]["checks"]}
    print("identical" if not differ else f"{len(differ)} part(s) differ", json.dumps(checks))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
