"""``compress verify RUN_DIR``: is this run directory, byte for byte, what compress wrote?

For release pipelines that copy run directories between machines: every file a stage or a report
recorded is hashed in full (time stamps prove nothing after a copy), each stage record is checked
against the manifest, and a run with a TensorRT Edge-LLM bundle has the bundle's chain of custody
checked again: its ONNX initializers against the quantized model's numbers, and its plugin nodes
against the kernels' contracts.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from compress.backends.edgellm.bundle import check_custody
from compress.core.artifact import EDGELLM_BUNDLE, HF_MODEL
from compress.core.errors import MissingBackendError, StageError
from compress.core.rundir import RunDir, locked, read_in_place_problem


@dataclass
class Verification:
    """What ``compress verify`` found: the differences from what compress wrote, and a custody check it could not
    run."""

    problems: list[str] = field(default_factory=list)
    not_checked: str | None = None
    tensors_compared: int = 0
    model: str | None = None  # the model the run read in place, as found now (it is not part of the run directory)


def verify_run(run_dir: Path) -> Verification:
    """Check every recorded file of ``run_dir`` in full and, where the run made an Edge-LLM bundle, its custody."""
    run = RunDir(run_dir)
    run.require_manifest()
    with locked(run.path, shared=True):
        result = Verification(run.strays() + run.problems(full=True), model=_model_read_in_place(run))
        bundle = run.stage_producing(EDGELLM_BUNDLE)
        if bundle is None or result.problems:
            return result
        folder, record = bundle
        with tempfile.TemporaryDirectory(prefix="compress-verify-") as work:
            try:
                custody = check_custody(
                    run.output_path(HF_MODEL, "a quantized model"), folder / record.output.path, Path(work)
                )
            except MissingBackendError as exc:
                result.not_checked = f"the bundle's custody was not checked: {exc}"
            except StageError as exc:
                result.problems.append(str(exc))
            else:
                result.tensors_compared = len(custody["compared"])
    return result


def _model_read_in_place(run: RunDir) -> str | None:
    """What became of the model the run read in place (None when the run copied it): still what the run read, changed,
    or not on this machine."""
    for _, record in run.stages():
        if record is not None and record.output.read_in_place:
            problem = read_in_place_problem(record, full=True)
            return problem or f"the model read in place, {record.output.path}, still holds what the run read"
    return None
