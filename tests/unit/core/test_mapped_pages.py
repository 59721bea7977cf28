"""A mapped checkpoint's pages are handed back after use, read again unchanged, and never lose a write."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from compress.core.mapped_pages import PAGE, MappedPages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages are handed back on Linux only")


def resident_pages(tensor: torch.Tensor) -> int:
    """How many of the pages wholly inside ``tensor`` this process holds (``/proc/self/pagemap``'s present bit)."""
    first = tensor.data_ptr()
    start, end = -(-first // PAGE) * PAGE, (first + tensor.numel() * tensor.element_size()) // PAGE * PAGE
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(start // PAGE * 8)
        flags = memoryview(pagemap.read((end - start) // PAGE * 8)).cast("Q")
    return sum(1 for entry in flags if entry & (1 << 63))


def mapped_tensors(path: Path, count: int, numel: int) -> list[torch.Tensor]:
    """``count`` float32 tensors lying one after another in a privately mapped file (as a loaded checkpoint's do)."""
    values = torch.arange(count * numel, dtype=torch.float32)
    path.write_bytes(values.numpy().tobytes())
    mapped = torch.from_file(str(path), shared=False, size=count * numel, dtype=torch.float32)
    return list(mapped.split(numel))


def test_a_mapped_tensors_pages_are_handed_back_and_read_again_unchanged(tmp_path):
    tensors = mapped_tensors(tmp_path / "weights.bin", 4, 256 * PAGE // 4)
    sums = [float(t.sum()) for t in tensors]  # every page read
    assert all(resident_pages(t) == 256 for t in tensors)
    with MappedPages(tensors) as pages:
        assert len(pages) == 4 and pages.managed_bytes() == 4 * 256 * PAGE
        assert [float(t.sum()) for t in tensors] == sums  # read-only now, still readable
        pages.release(tensors[:2])
        assert [resident_pages(t) for t in tensors] == [0, 0, 256, 256]  # only the released tensors' pages went
        assert [float(t.sum()) for t in tensors] == sums  # read again from the file
    assert float(tensors[0].add_(1).sum()) == sums[0] + tensors[0].numel()  # writable again after the context


def test_a_page_written_to_before_is_never_handed_back(tmp_path):
    tensors = mapped_tensors(tmp_path / "weights.bin", 2, 16 * PAGE // 4)
    tensors[0][5] = -1.0  # its own copy of that page now: discarding it would lose the write
    with MappedPages(tensors) as pages:
        assert len(pages) == 1
        pages.release(tensors)
        assert float(tensors[0][5]) == -1.0
        assert resident_pages(tensors[1]) == 0
    assert (torch.from_file(str(tmp_path / "weights.bin"), shared=False, size=1, dtype=torch.float32) == 0).all()


def test_a_write_into_managed_pages_faults_instead_of_being_lost(tmp_path):
    script = textwrap.dedent(f"""
        import torch
        from compress.core.mapped_pages import PAGE, MappedPages
        mapped = torch.from_file({str(tmp_path / "weights.bin")!r}, shared=False, size=4 * PAGE, dtype=torch.float32)
        with MappedPages([mapped]) as pages:
            assert len(pages) == 1
            mapped[PAGE] = 7.0
    """)
    (tmp_path / "weights.bin").write_bytes(bytes(16 * PAGE))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=Path(__file__).parents[3])
    assert run.returncode == -signal.SIGSEGV, run.stderr


def test_tensors_not_mapped_from_a_file_are_left_alone():
    held = torch.ones(64 * PAGE // 4)
    with MappedPages([held, torch.zeros(0)]) as pages:
        assert len(pages) == 0
        pages.release([held])
    assert float(held.sum()) == held.numel()
