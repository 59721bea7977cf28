"""An installed wheel works without the source tree: its recipes, targets and shipped text are package data.

The wheel is built from this checkout and installed (not editable) into a fresh virtual
environment whose only other packages are this environment's dependencies; the commands run from
a folder outside the checkout, so nothing can be found through the source tree.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The interpreter of a fresh venv with the compress wheel installed in it."""
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(root / "dist"),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    wheel = next((root / "dist").glob("compress-*.whl"))
    env = root / "venv"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True, timeout=600)
    # The dependencies (torch, transformers, ...) come from this environment, listed after the wheel's own files.
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def _compress(python: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "compress", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_installed_wheel_is_the_one_imported(installed, tmp_path):
    proc = subprocess.run(
        [str(installed), "-c", "import compress; print(compress.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert not Path(proc.stdout.strip()).is_relative_to(REPO)


def test_ls_recipes_and_targets_from_the_wheel(installed, tmp_path):
    recipes = _compress(installed, tmp_path, "ls", "recipes")
    assert recipes.returncode == 0, recipes.stderr
    assert {"default", "smoke", "int8", "int4", "encoder-int8", "thor-fp8"} <= {
        line.split()[0] for line in recipes.stdout.splitlines()
    }
    targets = _compress(installed, tmp_path, "ls", "targets")
    assert targets.returncode == 0, targets.stderr
    assert "jetson-orin-nano-8gb" in targets.stdout and "jetson-agx-thor" in targets.stdout


def test_dry_run_plans_with_the_shipped_text(installed, tmp_path):
    proc = _compress(installed, tmp_path, "run", "target=jetson-orin", "recipe=smoke", "--dry-run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(proc.stdout)
    assert [s["name"] for s in plan["stages"]][0] == "load" and plan["recipe"] == "smoke"
    shipped = [Path(item["path"]) for item in plan["calibration"] + plan["evaluation"]]
    assert shipped and all(path.is_file() and not path.is_relative_to(REPO) for path in shipped)
    assert {item["domain"] for item in plan["evaluation"]} >= {"austen", "learned", "government"}
