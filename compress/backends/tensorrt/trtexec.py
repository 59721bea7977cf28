"""Building an engine with ``trtexec`` where TensorRT's Python API is not installed (JetPack ships ``trtexec``)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from compress.backends.tensorrt.plan import BuildPlan, BuildResult
from compress.core.errors import StageError
from compress.core.rundir import TRTEXEC_LOG

JETPACK_TRTEXEC = Path("/usr/src/tensorrt/bin/trtexec")


def find_trtexec() -> Path | None:
    """``trtexec`` on PATH, or where JetPack installs it."""
    found = shutil.which("trtexec")
    if found:
        return Path(found)
    return JETPACK_TRTEXEC if JETPACK_TRTEXEC.is_file() else None


def build_with_trtexec(plan: BuildPlan, engine_dir: Path, trtexec: Path) -> BuildResult:
    """Build with ``trtexec`` (one profile, see :attr:`BuildPlan.trtexec_profile`) where TensorRT's Python API is
    absent."""
    command = [str(trtexec), *plan.trtexec_args()[1:]]
    log_path = engine_dir / TRTEXEC_LOG
    with log_path.open("w") as out:
        code = subprocess.run(command, cwd=engine_dir, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    text = log_path.read_text(errors="replace")
    if code != 0 or not (engine_dir / plan.engine_file).is_file():
        raise StageError(f"trtexec failed (exit {code}); see {log_path}")
    version = re.search(r"TensorRT version: (\S+)", text)
    return {"tensorrt_version": version.group(1) if version else "unknown", "builder": "trtexec",
            "engine_bytes": (engine_dir / plan.engine_file).stat().st_size}
