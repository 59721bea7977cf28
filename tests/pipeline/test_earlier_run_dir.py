"""A run directory an earlier compress wrote still reads: verified in full, shown, and re-gated from its stored
measurements (a checked-in run directory written at commit 81c160e)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from compress.cli.main import main

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "run-81c160e"


@pytest.fixture
def earlier_run(tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "run"))


def test_an_earlier_run_directory_verifies_shows_and_regates(capsys, earlier_run):
    assert main(["verify", str(earlier_run)]) == 0
    assert "every recorded file holds what compress wrote" in capsys.readouterr().out
    assert main(["show", str(earlier_run)]) == 0
    assert main(["validate", str(earlier_run), "target=jetson-agx-orin"]) in (0, 1)
    regated = json.loads(next(earlier_run.glob("validate-jetson-agx-orin-*.json")).read_text())
    assert regated["gate"]["verdict"] in ("PASS", "FAIL")


def test_an_earlier_run_directory_with_a_changed_file_still_fails_verification(capsys, earlier_run):
    report = earlier_run / "report.md"
    report.write_text(report.read_text() + "\nedited\n")
    assert main(["verify", str(earlier_run)]) == 2


def test_stage_records_read_through_one_type_and_refuse_what_it_does_not_know(tmp_path):
    from compress.core.errors import ProvenanceError
    from compress.core.stage_record import STAGE_RECORD_SCHEMA, StageFile

    assert StageFile.read(FIXTURE / "01_load" / "stage.json").output.read_in_place
    earlier = FIXTURE / "02_export_onnx" / "stage.json"
    record = StageFile.read(earlier)
    assert record.schema_version == 1  # written before the record was versioned
    assert record.output.kind == "onnx" and "model.onnx" in {Path(name).name for name in record.files}
    written = tmp_path / "stage.json"
    record.write(written)
    again = StageFile.read(written)
    assert again.schema_version == STAGE_RECORD_SCHEMA
    assert again.model_dump(exclude={"schema_version"}) == record.model_dump(exclude={"schema_version"})

    data = json.loads(earlier.read_text())
    renamed = {**data, "durations": data.pop("duration_s")}
    written.write_text(json.dumps(renamed))
    with pytest.raises(ProvenanceError, match=r"stage\.json is not a stage record \((duration_s|durations)"):
        StageFile.read(written)
    data = json.loads(earlier.read_text())
    data["output"]["sha256"] = 7
    written.write_text(json.dumps(data))
    with pytest.raises(ProvenanceError, match=r"output\.sha256"):
        StageFile.read(written)
