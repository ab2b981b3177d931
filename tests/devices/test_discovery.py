"""Which backend :func:`joules.devices.discovery.discover` picks, what it reports and caches."""

from __future__ import annotations

from pathlib import Path

import pytest

import joules.devices.amd as amd
from joules.devices.discovery import discover
from joules.devices.sim import Simulator
from joules.testing import fake_pynvml


def test_the_cache_is_per_visible_gpu_selection(tmp_path: Path) -> None:
    sim = Simulator("A100x2,nocpu")
    root = str(tmp_path / "no-powercap")
    with fake_pynvml.installed(sim):
        a = discover(env={"CUDA_VISIBLE_DEVICES": "0"}, rapl_root=root, refresh=True)
        b = discover(env={"CUDA_VISIBLE_DEVICES": "1"}, rapl_root=root)
        again = discover(env={"CUDA_VISIBLE_DEVICES": "0"}, rapl_root=root)
    assert [g.physical_index for g in a.gpus] == [0]
    assert [g.physical_index for g in b.gpus] == [1]
    assert again is a


def test_an_amd_machine_reports_no_nvml_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in = Simulator("A100,nocpu").gpus  # GPUs that amdsmi found
    monkeypatch.setattr(amd, "discover_amd", lambda env=None, **kw: (stand_in, []))
    root = str(tmp_path / "no-powercap")
    with fake_pynvml.installed([], init_error=12):  # NVML_ERROR_LIBRARY_NOT_FOUND
        ds = discover(env={}, rapl_root=root, refresh=True)
        assert ds.backend == "amdsmi" and ds.gpus == stand_in
        assert not [p for p in ds.problems if p.device == "nvml"]
        # With no AMD GPU either, NVML's problem is what the user needs to see.
        monkeypatch.setattr(amd, "discover_amd", lambda env=None, **kw: ([], []))
        ds = discover(env={}, rapl_root=root, refresh=True)
    assert ds.backend == "none"
    assert any(p.device == "nvml" and "libnvidia-ml" in p.message for p in ds.problems)
