"""Answer a prompt with a compress run's output, streaming tokens to stdout.

    python examples/chat_on_device.py RUN_DIR --prompt "What is the capital of France?" [--max-new-tokens 64] [--greedy]

Uses the TensorRT engine when the run has one built for this GPU, else ONNX Runtime.
"""

from __future__ import annotations

import argparse
import sys

import compress.runtime
from compress.core.errors import CompressError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--greedy", action="store_true", help="greedy decoding (default: sampling)")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    try:
        model = compress.runtime.load(args.run_dir)
    except CompressError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"[{model.backend}]", file=sys.stderr)
    for piece in model.stream(args.prompt, max_new_tokens=args.max_new_tokens, greedy=args.greedy, seed=args.seed):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
