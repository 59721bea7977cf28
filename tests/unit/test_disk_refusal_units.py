"""The plan's disk refusal prints its sizes in a unit that shows them, on a tiny file system too."""

from __future__ import annotations

from compress.pipeline.resources import Machine, StageEstimate, fit_problem, readable_bytes


def test_a_tiny_file_system_s_refusal_shows_both_sizes():
    machine = Machine(memory_bytes=24e9, available_bytes=20e9, swap_bytes=0.0, free_disk_bytes=2_000_000)
    problem = fit_problem([StageEstimate("quantize", 1e8, 40_000_000, 10.0)], machine, "tiny")
    assert problem is not None and "40.0 MB" in problem and "2.0 MB free" in problem and "0.0 GB" not in problem


def test_sizes_take_the_largest_unit_that_shows_them():
    assert [readable_bytes(n) for n in (12, 1_500, 2_500_000, 3.25e9)] == ["12 bytes", "1.5 kB", "2.5 MB", "3.2 GB"]
