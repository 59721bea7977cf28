"""Drive the pipeline from Python with the CLI's options.

    python examples/python_api.py [TARGET] [OUT_DIR] [MODEL]

``stage__option=value`` keyword arguments stand for ``stage.option=value`` on the command line.
"""

from __future__ import annotations

import sys

import compress
import compress.runtime


def main() -> int:
    target = sys.argv[1] if len(sys.argv) > 1 else "jetson-orin"
    out = sys.argv[2] if len(sys.argv) > 2 else "runs/python-api"
    model = sys.argv[3] if len(sys.argv) > 3 else "smollm2-135m-instruct"
    result = compress.run(
        target=target,
        recipe="baseline",
        model=model,
        out=out,
        progress=False,
        validate__eval_tokens=1024,
        validate__latency_new_tokens=8,
    )
    gate = result.report["gate"]
    print(f"gate: {gate['verdict']}")
    for check in gate["checks"]:
        print(
            f"  {check['name']}: {check['value']:.4g} (limit {check['limit']}, {check['verdict']}, {check['source']})"
        )
    answer = compress.runtime.load(result.run_dir).generate("What is the capital of France?", max_new_tokens=16)
    print(f"answer: {answer}")
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
