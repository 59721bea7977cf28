"""``quantization.json`` is written and read through one type: an earlier file (no schema version, no per-linear
precision) still reads with the file's precision and group, and a file with a key it does not know is refused."""

from __future__ import annotations

import json

import pytest

from compress.core.errors import UsageError
from compress.transforms.quantize.saved import QUANT_CONFIG_FILE, QUANTIZATION_SCHEMA, QuantizationFile

EARLIER = {
    "method": "int4", "config": {"method": "int4", "group_size": 64}, "precision": "int4", "format": "int",
    "weight_bits": 4, "group_size": 64, "activations": "float", "kv_cache": None,
    "linears": {"model.layers.0.mlp.down_proj": {"input_scale": None, "input_format": "int8", "sqnr_db": 21.5,
                                                 "migration_ratio": None, "rotation": 0, "global_scale": None}},
}


def test_an_earlier_file_reads_with_the_files_precision_and_is_rewritten_versioned(tmp_path):
    (tmp_path / QUANT_CONFIG_FILE).write_text(json.dumps(EARLIER))
    saved = QuantizationFile.read(tmp_path)
    assert saved.schema_version == 1 and saved.linear_precision("model.layers.0.mlp.down_proj") == "int4"
    assert saved.kv_cache_scales() is None and not saved.is_mixed()
    saved.write(tmp_path)
    again = json.loads((tmp_path / QUANT_CONFIG_FILE).read_text())
    assert again["schema_version"] == QUANTIZATION_SCHEMA
    assert QuantizationFile.read(tmp_path).model_dump(exclude={"schema_version"}) == saved.model_dump(
        exclude={"schema_version"})


def test_a_float_folder_has_none_and_an_unknown_or_missing_key_is_refused(tmp_path):
    assert QuantizationFile.read(tmp_path) is None
    (tmp_path / QUANT_CONFIG_FILE).write_text(json.dumps({**EARLIER, "groupsize": 64}))
    with pytest.raises(UsageError, match=r"quantization\.json is not a quantization this compress reads \(groupsize"):
        QuantizationFile.read(tmp_path)
    (tmp_path / QUANT_CONFIG_FILE).write_text(json.dumps({k: v for k, v in EARLIER.items() if k != "precision"}))
    with pytest.raises(UsageError, match=r"\(precision: field required\)"):
        QuantizationFile.read(tmp_path)
