"""Simulated GPU settings that outlive a process (JOULES_SIM_STATE)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from joules.devices.discovery import discover
from joules.devices.sim import Constant, Simulator


def test_settings_are_kept_in_the_state_file(tmp_path: Path) -> None:
    state = tmp_path / "sub" / "state.json"
    first = Simulator("A100x2", state_file=state)
    assert not state.exists()  # nothing is written before a change
    first.gpus[0].set_power_limit_w(250.0)
    first.gpus[1].lock_sm_clock(210.0, 1005.0)
    data = json.loads(state.read_text())["gpus"]
    assert data["0"] == {"uuid": first.gpus[0].uuid, "name": "NVIDIA A100-SXM4-40GB",
                         "power_limit_w": 250.0, "sm_clock_lock_mhz": None}
    assert data["1"]["power_limit_w"] == 400.0 and data["1"]["sm_clock_lock_mhz"] == [210.0, 1005.0]

    second = Simulator("A100x2", state_file=state)
    assert second.gpus[0].power_limit_w() == 250.0
    assert second.gpus[1].sm_clock_locked() == (210.0, 1005.0)
    assert second.gpus[1].relative_speed(0.0) == 1005.0 / 1410.0  # the lock caps the clock
    second.gpus[1].reset_sm_clock()
    assert Simulator("A100x2", state_file=state).gpus[1].sm_clock_locked() is None
    assert Simulator("A100x2").gpus[0].power_limit_w() == 400.0  # without the file: defaults


def test_writers_merge_their_gpus(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    a = Simulator("A100x2", state_file=state)
    b = Simulator("A100x2", state_file=state)  # another process, created at the same time
    a.gpus[0].set_power_limit_w(300.0)
    b.gpus[1].set_power_limit_w(275.0)
    c = Simulator("A100x2", state_file=state)
    assert [g.power_limit_w() for g in c.gpus] == [300.0, 275.0]


def test_other_models_and_bad_files_are_ignored(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    Simulator("A100", state_file=state).gpus[0].set_power_limit_w(150.0)
    assert Simulator("H100", state_file=state).gpus[0].power_limit_w() == 700.0  # another uuid
    state.write_text("{broken")
    sim = Simulator("A100", state_file=state)
    assert sim.gpus[0].power_limit_w() == 400.0
    sim.gpus[0].set_power_limit_w(200.0)  # replaces the broken file
    assert json.loads(state.read_text())["gpus"]["0"]["power_limit_w"] == 200.0
    uuid = sim.gpus[0].uuid
    for lock in ([None, None], ["a", "b"], [True, 1410]):  # a malformed entry is ignored
        state.write_text(json.dumps({"gpus": {"0": {"uuid": uuid, "power_limit_w": True,
                                                    "sm_clock_lock_mhz": lock}}}))
        gpu = Simulator("A100", state_file=state).gpus[0]
        assert gpu.power_limit_w() == 400.0 and gpu.sm_clock_locked() is None


def test_discover_passes_joules_sim_state(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    Simulator("A100x2", state_file=state).gpus[1].set_power_limit_w(220.0)
    devices = discover(sim="A100x2", env={"JOULES_SIM_STATE": str(state)}, refresh=True)
    assert [g.power_limit_w() for g in devices.gpus] == [400.0, 220.0]
    code = ("from joules.devices.discovery import discover; g = discover().gpus[1]; "
            "print(g.power_limit_w()); g.set_power_limit_w(180)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={"JOULES_SIM": "A100x2", "JOULES_SIM_STATE": str(state), "PATH": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout == "220.0\n"
    assert json.loads(state.read_text())["gpus"]["1"]["power_limit_w"] == 180.0


def test_processes_sharing_a_state_file_see_each_others_changes(tmp_path: Path) -> None:
    # Two simulators on one file stand for two processes: as on a real GPU, each sees the
    # one setting the GPU has, and a change of one setting keeps the other's.
    state = tmp_path / "state.json"
    a, b = Simulator("A100x2", state_file=state), Simulator("A100x2", state_file=state)
    b.gpus[0].set_power_limit_w(250.0)
    assert a.gpus[0].power_limit_w() == 250.0
    a.gpus[0].lock_sm_clock(210, 1200)
    b.gpus[1].set_power_limit_w(300.0)
    assert b.gpus[0].sm_clock_locked() == (210.0, 1200.0)
    assert a.gpus[1].power_limit_w() == 300.0  # another GPU's change, after GPU 0 looked
    c = Simulator("A100x2", state_file=state)
    assert c.gpus[0].power_limit_w() == 250.0 and c.gpus[0].sm_clock_locked() == (210.0, 1200.0)
    b.gpus[0].reset_sm_clock()
    assert a.gpus[0].sm_clock_locked() is None and a.gpus[0].power_limit_w() == 250.0
    # The power model follows the limit another process set.
    a.set_workload(Constant(1.0))
    a.advance(1.0)
    assert a.gpus[0].true_power_w() == pytest.approx(250.0, rel=0.02)


@pytest.mark.parametrize("existing", [False, True])
def test_a_change_written_between_a_look_and_a_write_is_taken_up(tmp_path: Path, existing: bool) -> None:
    """B looked at the file, A set 250 W, then B locked its clock: B's write kept A's limit in the
    file, but B took the file as seen without taking the limit up (and, where the file was new,
    wrote its own 400 W over it): B, then A, saw 400 W."""
    state = tmp_path / "state.json"
    if existing:
        Simulator("A100", state_file=state).gpus[0].set_power_limit_w(400.0)
    a = Simulator("A100", state_file=state).gpus[0]
    b = Simulator("A100", state_file=state).gpus[0]
    save_b = b.on_change

    def a_writes_first(gpu: object) -> None:  # A's change lands as B is about to write
        a.set_power_limit_w(250.0)
        save_b(gpu)  # type: ignore[misc]

    b.on_change = a_writes_first
    b.lock_sm_clock(300, 900)
    b.on_change = save_b
    assert (b.power_limit_w(), b.sm_clock_locked()) == (250.0, (300.0, 900.0))
    assert (a.power_limit_w(), a.sm_clock_locked()) == (250.0, (300.0, 900.0))


def test_a_number_too_large_for_a_float_is_ignored(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    gpu = Simulator("A100", state_file=state).gpus[0]
    gpu.set_power_limit_w(300.0)
    state.write_text(state.read_text().replace("300.0", "1" + "0" * 400))
    assert Simulator("A100", state_file=state).gpus[0].power_limit_w() == 400.0  # (the default)


def test_a_setting_set_again_to_the_value_last_seen_is_recorded(tmp_path: Path) -> None:
    """A looked at the file (300 W), B set 250 W, then A set 300 W again: A's set, the last,
    was taken for no change, and the file (and A) kept B's 250 W."""
    state = tmp_path / "state.json"
    a = Simulator("A100", state_file=state).gpus[0]
    a.set_power_limit_w(300.0)
    b = Simulator("A100", state_file=state).gpus[0]
    refresh_a = a.on_read

    def b_writes_after_a_looked(gpu: object) -> None:
        refresh_a(gpu)  # type: ignore[misc]
        b.set_power_limit_w(250.0)

    a.on_read = b_writes_after_a_looked
    a.set_power_limit_w(300.0)
    a.on_read = refresh_a
    assert a.power_limit_w() == b.power_limit_w() == 300.0
