"""The worker's allocator tuning: numpy stops asking for huge pages where faults in them would stall."""

from __future__ import annotations

from pathlib import Path

import pytest
from numpy._core import multiarray

from elasticdl_strategy.transport import allocator


@pytest.mark.parametrize(
    "defrag, stalls",
    [
        ("always defer defer+madvise [madvise] never", True),
        ("[always] defer defer+madvise madvise never", True),
        ("always defer [defer+madvise] madvise never", True),
        ("always [defer] defer+madvise madvise never", False),
        ("always defer defer+madvise madvise [never]", False),
        ("", False),
        (None, False),
    ],
)
def test_which_defrag_modes_stall(defrag, stalls):
    assert allocator.stalls_on_huge_page_faults(defrag) is stalls


@pytest.fixture
def untuned(monkeypatch):
    monkeypatch.setattr(allocator, "_tuned", False)
    monkeypatch.delenv("EDL_TUNE_MALLOC", raising=False)
    monkeypatch.setattr(allocator, "_raise_malloc_thresholds", lambda: True)  # not this test process's malloc
    before = multiarray._get_madvise_hugepage()
    multiarray._set_madvise_hugepage(True)
    yield
    multiarray._set_madvise_hugepage(before)


def _kernel_says(tmp_path: Path, monkeypatch, defrag: str) -> None:
    path = tmp_path / "defrag"
    path.write_text(defrag + "\n")
    monkeypatch.setattr(allocator, "THP_DEFRAG", str(path))


def test_numpy_stops_advising_huge_pages_where_faults_stall(untuned, tmp_path, monkeypatch):
    _kernel_says(tmp_path, monkeypatch, "always defer defer+madvise [madvise] never")
    allocator.tune_for_streaming()
    assert multiarray._get_madvise_hugepage() is False


def test_numpy_keeps_huge_pages_where_faults_do_not_stall(untuned, tmp_path, monkeypatch):
    _kernel_says(tmp_path, monkeypatch, "always [defer] defer+madvise madvise never")
    allocator.tune_for_streaming()
    assert multiarray._get_madvise_hugepage() is True


def test_opting_out_leaves_numpy_alone(untuned, tmp_path, monkeypatch):
    _kernel_says(tmp_path, monkeypatch, "always defer defer+madvise [madvise] never")
    monkeypatch.setenv("EDL_TUNE_MALLOC", "0")
    allocator.tune_for_streaming()
    assert multiarray._get_madvise_hugepage() is True
