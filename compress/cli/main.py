"""The ``compress`` command line.

    compress run target=jetson-orin [recipe=default] [model=...] [out=DIR] [stage.option=value ...]
    compress ls targets|recipes|stages
    compress show RUN_DIR
    compress validate RUN_DIR [target=NAME] [power=MODE] [--require-measured] [--on-device]
    compress build-engine RUN_DIR
    compress verify RUN_DIR
    compress predict target=NAME model_config=PATH [precision=fp16] [power=MODE] [prompt_len=N]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from pathlib import Path

from compress.core.errors import (
    EXIT_NOT_MEASURED,
    EXIT_PASS,
    EXIT_STAGE_ERROR,
    EXIT_USAGE,
    CompressError,
    Interrupted,
    MissingBackendError,
    first_line,
    forget_pending_interrupts,
    stop_signals_handled,
)

EPILOG = """examples:
  compress run target=jetson-orin                       full pipeline on the embedded default model
  compress run target=jetson-orin recipe=baseline       no compression: the reference every report compares against
  compress run target=jetson-orin recipe=smoke out=runs/smoke
  compress run target=rtx-4090 model=path/to/hf-folder validate.eval_tokens=4096 budgets.max_ppl_increase_pct=3
  compress run target=jetson-orin --dry-run             print the resolved config and the stage plan
  compress ls targets
  compress show runs/jetson-orin-nano-8gb-default-smollm2-135m-instruct
  compress validate RUN_DIR target=jetson-agx-orin-64gb
  compress verify RUN_DIR                               every recorded file, in full, and the bundle's custody

exit codes: 0 gate PASS, 1 gate FAIL, 2 usage or input error, 3 gate NOT_MEASURED, 4 stage error,
            130 / 143 stopped by SIGINT / SIGTERM (the run is marked failed; rerun to resume)
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compress",
        description="Compress a Hugging Face model into a validated edge engine.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and the result")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run", help="run a recipe for a target", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    run.add_argument(
        "pairs",
        nargs="*",
        metavar="key=value",
        help="target=, recipe=, model=, out=, calib=, eval=, power=, seed=, device=, stage.option=, budgets.key=",
    )
    run.add_argument("--dry-run", action="store_true", help="print the resolved config and stage plan; do no work")
    run.add_argument("--require-measured", action="store_true", help="predicted checks count as NOT_MEASURED")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    run.add_argument("--force", action="store_true",
                     help="out= holds a compress run of another plan: replace the stage folders its manifest records")

    ls = sub.add_parser("ls", help="list targets, recipes or stages")
    ls.add_argument("what", choices=["targets", "recipes", "stages"])

    show = sub.add_parser("show", help="summarise a run directory")
    show.add_argument("run_dir", type=Path)

    validate = sub.add_parser("validate", help="re-gate a finished run against a target without recomputing the model")
    validate.add_argument("run_dir", type=Path)
    validate.add_argument("pairs", nargs="*", metavar="key=value", help="target=, power=, budgets.key=")
    validate.add_argument("--require-measured", action="store_true")
    validate.add_argument(
        "--on-device", action="store_true", help="measure latency with the run's TensorRT engine on this GPU"
    )

    build = sub.add_parser("build-engine", help="build a run's TensorRT engine on this device from its build plan")
    build.add_argument("run_dir", type=Path)

    verify = sub.add_parser(
        "verify", help="check every file a run recorded, in full, and its Edge-LLM bundle's custody (exit 0 or 2)"
    )
    verify.add_argument("run_dir", type=Path)

    predict = sub.add_parser("predict", help="predict decode speed, TTFT, memory and energy for a decoder config")
    predict.add_argument(
        "pairs", nargs="+", metavar="key=value", help="target=, model_config=, precision=, power=, prompt_len="
    )
    return parser


def _setup_logging(quiet: bool) -> None:
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_compress_console", False)]:
        root.removeHandler(old)
    handler = logging.StreamHandler(sys.stderr)
    handler._compress_console = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("compress: %(message)s"))
    handler.setLevel(logging.WARNING if quiet else logging.INFO)
    root.setLevel(logging.DEBUG)
    root.addHandler(handler)
    for noisy in ("transformers", "torch", "onnxscript", "onnx_ir", "urllib3", "filelock", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except ImportError:
        pass


# The commands import what they run when they run: torch and transformers load in seconds, which `compress ls`,
# `show`, `predict` and --help never need.


def _cmd_run(args: argparse.Namespace) -> int:
    from compress.core.config import split_overrides  # lazy: see above
    from compress.pipeline.execute import execute  # lazy: see above
    from compress.pipeline.plan import RunOptions, build_plan  # lazy: see above

    options = RunOptions.from_pairs(split_overrides(args.pairs), require_measured=args.require_measured,
                                    progress=not args.no_progress and sys.stderr.isatty(), dry_run=args.dry_run,
                                    force=args.force)
    plan = build_plan(options)
    if args.dry_run:
        print(json.dumps(plan.describe(), indent=2))
        if plan.fit_problem:
            print(f"compress: warning: {plan.fit_problem}", file=sys.stderr)
        return 0
    result = execute(plan)
    gate = result.report["gate"]
    print(f"{gate['verdict']}: {result.run_dir / 'report.md'}")
    for check in gate["checks"]:
        print(f"  {check['verdict']:<12} {check['name']}: {check['value']} (limit {check['limit']}, {check['source']})")
    return result.exit_code


def _cmd_ls(args: argparse.Namespace) -> int:
    from compress.core.config import available_recipes, available_targets, load_recipe, load_target  # lazy: see above

    if args.what == "targets":
        for name in available_targets():
            target = load_target(name)
            aliases = f" (aliases: {', '.join(target.aliases)})" if target.aliases else ""
            print(f"{target.name:<24} {target.description}{aliases}")
    elif args.what == "recipes":
        for name in available_recipes():
            recipe = load_recipe(name)
            print(f"{recipe.name:<16} {' -> '.join(s.name for s in recipe.stages)}  {recipe.description}")
    else:
        from compress.pipeline.stage import all_stages  # lazy: see above

        for stage in all_stages().values():
            kinds = "|".join(stage.takes())
            models = "/".join(f"{kind}s" for kind in stage.model_kinds)
            print(f"{stage.name:<20} {kinds} -> {stage.output_kind} ({models}): {stage.summary}")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from compress.core.rundir import RunDir  # lazy: see above

    run = RunDir(args.run_dir)
    manifest = run.manifest()
    run.require_intact()
    print(f"run:     {run.path}")
    print(f"status:  {manifest['status']}" + (f" ({manifest['error']})" if manifest.get("error") else ""))
    print(f"target:  {manifest['target']} ({manifest['power_mode']})")
    print(f"recipe:  {manifest['recipe']['name']}")
    print(f"model:   {manifest['model']['spec']}")
    for entry, record in run.stages():
        summary = record.summary if record else ""
        print(f"  {entry['dir']:<22} {entry['status']:<9} {summary}".rstrip())
    report = run.report() if manifest["status"] == "finished" else None
    if report is not None:
        print(f"gate:    {report['gate']['verdict']}")
        for check in report["gate"]["checks"]:
            print(
                f"  {check['verdict']:<12} {check['name']}: {check['value']} (limit {check['limit']}, "
                f"{check['source']})"
            )
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from compress.core.config import split_overrides  # lazy: see above
    from compress.pipeline.revalidate import revalidate  # lazy: see above

    report, written = revalidate(args.run_dir, split_overrides(args.pairs), require_measured=args.require_measured,
                                 on_device=args.on_device)
    if report.get("on_device"):
        print(f"on-device measurement: {report['on_device']['status']}")
    print(f"{report['gate']['verdict']}: {written}")
    for check in report["gate"]["checks"]:
        print(f"  {check['verdict']:<12} {check['name']}: {check['value']} (limit {check['limit']}, {check['source']})")
    return report["exit_code"]


def _cmd_verify(args: argparse.Namespace) -> int:
    from compress.pipeline.verify import verify_run  # lazy: see above

    result = verify_run(args.run_dir)
    for problem in result.problems:
        print(f"  {problem}")
    if result.problems:
        if result.model:
            print(f"  {result.model} (not part of the run directory)")
        print(f"{args.run_dir}: {len(result.problems)} problem(s); this is not what compress wrote")
        return EXIT_USAGE
    custody = (
        f"; the Edge-LLM bundle holds the quantized numbers ({result.tensors_compared} tensors)"
        if result.tensors_compared
        else ""
    )
    print(f"{args.run_dir}: every recorded file holds what compress wrote{custody}")
    if result.model:
        print(f"{args.run_dir}: {result.model} (not part of the run directory)")
    if result.not_checked:
        print(f"compress: {result.not_checked}", file=sys.stderr)
        return EXIT_NOT_MEASURED
    return EXIT_PASS


def _cmd_predict(args: argparse.Namespace) -> int:
    from compress.cli.predict import predict_command  # lazy: see above
    from compress.core.config import split_overrides  # lazy: see above

    print(json.dumps(predict_command(split_overrides(args.pairs)), indent=2))
    return 0


def _cmd_build_engine(args: argparse.Namespace) -> int:
    from compress.pipeline.device import build_on_device  # lazy: see above

    try:
        manifest = build_on_device(args.run_dir)
    except MissingBackendError as exc:
        print(f"compress: engine not built: {exc}", file=sys.stderr)
        return EXIT_NOT_MEASURED
    print(json.dumps(manifest, indent=2))
    return 0


COMMANDS = {
    "build-engine": _cmd_build_engine,
    "run": _cmd_run,
    "ls": _cmd_ls,
    "show": _cmd_show,
    "validate": _cmd_validate,
    "predict": _cmd_predict,
    "verify": _cmd_verify,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``compress`` console script."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # key=value words may follow flags (`run --dry-run target=x`); argparse leaves those in ``extra``.
    leftover = [word for word in extra if not (hasattr(args, "pairs") and "=" in word and not word.startswith("-"))]
    if leftover:
        parser.error(f"unrecognized arguments: {' '.join(leftover)}")
    if hasattr(args, "pairs"):
        args.pairs = list(args.pairs) + [word for word in extra if word not in leftover]
    _setup_logging(args.quiet)
    forget_pending_interrupts()
    try:
        with stop_signals_handled():
            return COMMANDS[args.command](args)
    except CompressError as exc:
        print(f"compress: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Interrupted as exc:
        print(f"compress: {exc}; rerun the same command to resume", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("compress: interrupted (SIGINT); rerun the same command to resume", file=sys.stderr)
        return 130
    except Exception as exc:  # TensorRT, CUDA or a library failing outside a stage: exit 4, never the gate's FAIL code
        logging.getLogger("compress").debug("unexpected failure", exc_info=exc)
        print(f"compress: error: {type(exc).__name__}: {first_line(exc)}", file=sys.stderr)
        return EXIT_STAGE_ERROR
    finally:
        forget_pending_interrupts()


def _exit() -> None:
    sys.exit(main())


if __name__ == "__main__":
    _exit()
