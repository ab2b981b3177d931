"""RestoreGuard and recover: a job never leaves a GPU at a lowered power limit or locked clock."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

import joules.devices.restore as restore_mod
from joules.devices.restore import (
    Change,
    RestoreGuard,
    default_journal_dir,
    process_alive,
    process_start_time,
    recover,
    recover_report,
)
from joules.devices.sim import SimGPU, Simulator
from joules.errors import DevicePermissionError
from joules.testing.processes import start_ready

JOULES = str(Path(sys.executable).parent / "joules")


def journals(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.json")) if directory.is_dir() else []


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=30)
    return p.pid


def write_journal(directory: Path, pid: int, gpus: list[dict[str, object]], host: str | None = None,
                  start: int | None = None, name: str = "job.json") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps({"format": 1, "host": host or socket.gethostname(), "pid": pid,
                                "process_start_time": start, "gpus": gpus}))
    return path


def entry(gpu: SimGPU, limit: float | None, locked: bool = False, applied: float | None = None
          ) -> dict[str, object]:
    """A journal's entry for ``gpu``; ``applied`` (the limit set last) as a guard writes it."""
    e: dict[str, object] = {"uuid": gpu.uuid, "index": gpu.index, "name": gpu.name,
                            "power_limit_w": limit, "sm_clock_locked": locked}
    if applied is not None:
        e["applied_power_limit_w"] = applied
    return e


def journal_gpus(path: Path) -> list[dict[str, object]]:
    """The GPU entries of a journal, without the times they were set (checked to be there)."""
    gpus = json.loads(path.read_text())["gpus"]
    for g in gpus:
        assert ("applied_at" in g) == ("applied_power_limit_w" in g)
        assert isinstance(g.pop("applied_at", 0.0), float)
    return gpus


@pytest.fixture
def sim() -> Simulator:
    return Simulator("A100x2")


@pytest.fixture
def jdir(tmp_path: Path) -> Path:
    return tmp_path / "restore"


@pytest.fixture
def sigterm_recorder() -> Iterator[list[int]]:
    """A Python SIGTERM handler that records calls; the original handler is put back after."""
    calls: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        calls.append(signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield calls
    finally:
        signal.signal(signal.SIGTERM, old)


# -- in-process -------------------------------------------------------------------------------
def test_restores_the_limit_the_gpu_had_not_its_default_or_max(sim: Simulator, jdir: Path) -> None:
    g = sim.gpus[0]
    assert g.default_power_limit_w() == 400.0 and g.power_limit_range_w() == (100.0, 400.0)
    g.set_power_limit_w(250.0)
    guard = RestoreGuard(sim.gpus, journal_dir=jdir, handle_signals=False)
    guard.set_power_limit_w(g, 200.0)
    guard.set_power_limit_w(g, 150.0)  # later changes keep the first original
    assert g.power_limit_w() == 150.0
    assert guard.changed == [Change(g.uuid, 0, g.name, 250.0, False)]
    [path] = journals(jdir)
    assert guard.journal_path == path
    data = json.loads(path.read_text())
    assert data["pid"] == os.getpid() and data["host"] == socket.gethostname()
    assert journal_gpus(path) == [entry(g, 250.0, applied=150.0)]
    assert data["process_start_time"] == process_start_time(os.getpid())
    assert guard.restore() == []
    assert g.power_limit_w() == 250.0
    assert sim.gpus[1].power_limit_w() == 400.0  # never touched
    assert guard.changed == [] and journals(jdir) == [] and guard.journal_path is None


def test_journal_is_written_before_the_device_changes(sim: Simulator, jdir: Path) -> None:
    g = sim.gpus[0]
    seen: list[tuple[float, list[object]]] = []
    g.on_change = lambda gpu: seen.append((
        gpu.power_limit_w(),
        [json.loads(p.read_text())["gpus"][0]["power_limit_w"] for p in journals(jdir)],
    ))
    guard = RestoreGuard(sim.gpus, journal_dir=jdir, handle_signals=False)
    guard.set_power_limit_w(g, 180.0)
    assert seen == [(180.0, [400.0])]
    guard.restore()


def test_locked_clocks_are_reset(sim: Simulator, jdir: Path) -> None:
    g0, g1 = sim.gpus
    with RestoreGuard(sim.gpus, journal_dir=jdir, handle_signals=False) as guard:
        guard.lock_sm_clock(g1, 210.0, 1005.0)
        guard.set_power_limit_w(g0, 300.0)
        assert g1.sm_clock_locked() == (210.0, 1005.0)
        assert guard.changed == [
            Change(g1.uuid, 1, g1.name, None, True), Change(g0.uuid, 0, g0.name, 400.0, False)]
        [path] = journals(jdir)
        assert journal_gpus(path) == [entry(g1, None, True), entry(g0, 400.0, applied=300.0)]
    assert g1.sm_clock_locked() is None and g1.power_limit_w() == 400.0
    assert g0.power_limit_w() == 400.0
    assert journals(jdir) == []


def test_restore_is_idempotent_and_the_guard_reusable(sim: Simulator, jdir: Path) -> None:
    g = sim.gpus[0]
    g.set_power_limit_w(320.0)
    guard = RestoreGuard(sim.gpus, journal_dir=jdir, handle_signals=False)
    guard.set_power_limit_w(g, 200.0)
    assert guard.restore() == [] and g.power_limit_w() == 320.0
    g.set_power_limit_w(310.0)  # someone else's change after the restore is not undone
    assert guard.restore() == [] and g.power_limit_w() == 310.0
    guard.set_power_limit_w(g, 120.0)  # a new change remembers the new original
    assert guard.changed[0].original_power_limit_w == 310.0
    guard.restore()
    assert g.power_limit_w() == 310.0 and journals(jdir) == []


def test_permission_error_changes_nothing_and_leaves_no_journal(sim: Simulator, jdir: Path) -> None:
    g = sim.gpus[0]
    g.set_power_limit_w(250.0)
    g.allow_control = False
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    guard = RestoreGuard(sim.gpus, journal_dir=jdir)
    with pytest.raises(DevicePermissionError):
        guard.set_power_limit_w(g, 200.0)
    with pytest.raises(DevicePermissionError):
        guard.lock_sm_clock(g, 210.0, 900.0)
    assert g.power_limit_w() == 250.0 and g.sm_clock_locked() is None
    assert guard.changed == [] and journals(jdir) == [] and guard.journal_path is None
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    with pytest.raises(ValueError, match="outside the allowed range"):
        guard.set_power_limit_w(sim.gpus[1], 50.0)
    assert guard.changed == [] and journals(jdir) == []


def test_permission_error_on_a_second_gpu_keeps_the_first(sim: Simulator, jdir: Path) -> None:
    g0, g1 = sim.gpus
    g1.allow_control = False
    guard = RestoreGuard(sim.gpus, journal_dir=jdir, handle_signals=False)
    guard.set_power_limit_w(g0, 200.0)
    with pytest.raises(DevicePermissionError):
        guard.set_power_limit_w(g1, 200.0)
    [path] = journals(jdir)
    assert journal_gpus(path) == [entry(g0, 400.0, applied=200.0)]
    guard.restore()
    assert g0.power_limit_w() == 400.0 and journals(jdir) == []


def test_one_gpu_failing_to_restore_does_not_stop_the_others(
    sim: Simulator, jdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    g0, g1 = sim.gpus
    g0.set_power_limit_w(300.0)
    g1.set_power_limit_w(275.0)
    guard = RestoreGuard(sim.gpus, journal_dir=jdir, handle_signals=False)
    guard.set_power_limit_w(g0, 150.0)
    guard.set_power_limit_w(g1, 125.0)
    guard.lock_sm_clock(g1, 210.0, 900.0)
    g0.allow_control = False  # e.g. the driver refuses now
    errors = guard.restore()
    assert len(errors) == 1 and errors[0].startswith("GPU 0") and "300 W" in errors[0]
    assert "GPU 0" in caplog.text
    assert g1.power_limit_w() == 275.0 and g1.sm_clock_locked() is None
    assert g0.power_limit_w() == 150.0
    # What failed stays in the journal, for `joules restore` after this process is gone.
    [path] = journals(jdir)
    assert journal_gpus(path) == [entry(g0, 300.0, applied=150.0)]
    g0.allow_control = True
    assert guard.restore() == []
    assert g0.power_limit_w() == 300.0 and journals(jdir) == []


def test_sigterm_restores_then_chains_to_previous_python_handler(
    sim: Simulator, jdir: Path, sigterm_recorder: list[int]
) -> None:
    g = sim.gpus[0]
    g.set_power_limit_w(250.0)
    ours = signal.getsignal(signal.SIGTERM)
    guard = RestoreGuard(sim.gpus, journal_dir=jdir)
    assert signal.getsignal(signal.SIGTERM) is ours  # nothing is installed before a change
    guard.set_power_limit_w(g, 200.0)
    assert signal.getsignal(signal.SIGTERM) == guard._handle_signal
    signal.raise_signal(signal.SIGTERM)
    assert sigterm_recorder == [signal.SIGTERM]
    assert g.power_limit_w() == 250.0 and journals(jdir) == []
    assert signal.getsignal(signal.SIGTERM) is ours  # put back


def test_sigint_with_default_handler_raises_keyboard_interrupt_after_restoring(
    sim: Simulator, jdir: Path
) -> None:
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        g = sim.gpus[1]
        guard = RestoreGuard(sim.gpus, journal_dir=jdir)
        guard.set_power_limit_w(g, 180.0)
        guard.lock_sm_clock(g, 210.0, 900.0)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert g.power_limit_w() == 400.0 and g.sm_clock_locked() is None
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, old)


def test_sig_ign_is_respected(sim: Simulator, jdir: Path) -> None:
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        guard = RestoreGuard(sim.gpus, journal_dir=jdir)
        guard.set_power_limit_w(sim.gpus[0], 180.0)
        signal.raise_signal(signal.SIGTERM)  # restores, and the process goes on
        assert sim.gpus[0].power_limit_w() == 400.0
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, old)


def test_several_guards_chain(sim: Simulator, jdir: Path, sigterm_recorder: list[int]) -> None:
    g0, g1 = sim.gpus
    a = RestoreGuard([g0], journal_dir=jdir)
    b = RestoreGuard([g1], journal_dir=jdir)
    a.set_power_limit_w(g0, 200.0)
    b.set_power_limit_w(g1, 210.0)
    assert len(journals(jdir)) == 2
    signal.raise_signal(signal.SIGTERM)
    assert sigterm_recorder == [signal.SIGTERM]
    assert (g0.power_limit_w(), g1.power_limit_w()) == (400.0, 400.0)
    assert journals(jdir) == []
    assert signal.getsignal(signal.SIGTERM) not in (a._handle_signal, b._handle_signal)


def test_guard_restored_first_stays_a_link_in_the_chain(
    sim: Simulator, jdir: Path, sigterm_recorder: list[int]
) -> None:
    g0, g1 = sim.gpus
    a = RestoreGuard([g0], journal_dir=jdir)
    b = RestoreGuard([g1], journal_dir=jdir)
    a.set_power_limit_w(g0, 200.0)
    b.set_power_limit_w(g1, 210.0)
    a.restore()  # b's handler is on top and chains to a's: a's stays, passing signals on
    assert g0.power_limit_w() == 400.0
    a.set_power_limit_w(g0, 220.0)  # a is still reachable through b: no second install
    signal.raise_signal(signal.SIGTERM)
    assert sigterm_recorder == [signal.SIGTERM]
    assert (g0.power_limit_w(), g1.power_limit_w()) == (400.0, 400.0)
    signal.raise_signal(signal.SIGTERM)  # everything is back to the recorder alone
    assert sigterm_recorder == [signal.SIGTERM] * 2


class _InterruptedGPU(SimGPU):
    """A GPU whose limit change is interrupted by SIGTERM half-way."""

    def set_power_limit_w(self, watts: float) -> None:
        if watts < 400.0:
            signal.raise_signal(signal.SIGTERM)
        super().set_power_limit_w(watts)


def test_signal_during_a_change_is_handled_after_it(jdir: Path, sigterm_recorder: list[int]) -> None:
    sim = Simulator("A100")
    g = _InterruptedGPU(sim.gpus[0].model, sim.clock)
    guard = RestoreGuard([g], journal_dir=jdir)
    guard.set_power_limit_w(g, 200.0)
    assert sigterm_recorder == [signal.SIGTERM]
    assert g.power_limit_w() == 400.0 and guard.changed == [] and journals(jdir) == []


def test_every_signal_held_during_a_change_is_handled(jdir: Path, sigterm_recorder: list[int]) -> None:
    # Ctrl-C and a scheduler's SIGTERM arrive together: the first handler raises
    # KeyboardInterrupt, and the SIGTERM must still reach the handler installed before.
    sim = Simulator("A100")
    gpu = sim.gpus[0]
    real = gpu.set_power_limit_w

    def set_power_limit_w(watts: float) -> None:
        real(watts)
        if watts < 400.0:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGTERM)

    gpu.set_power_limit_w = set_power_limit_w  # type: ignore[method-assign]
    guard = RestoreGuard([gpu], journal_dir=jdir)
    with pytest.raises(KeyboardInterrupt):
        guard.set_power_limit_w(gpu, 200.0)
    assert sigterm_recorder == [signal.SIGTERM]
    assert gpu.power_limit_w() == 400.0 and guard.changed == [] and journals(jdir) == []


def test_no_signal_handlers_outside_the_main_thread(sim: Simulator, jdir: Path) -> None:
    import threading

    before = signal.getsignal(signal.SIGTERM)
    guard = RestoreGuard(sim.gpus, journal_dir=jdir)
    t = threading.Thread(target=guard.set_power_limit_w, args=(sim.gpus[0], 200.0))
    t.start()
    t.join()
    assert signal.getsignal(signal.SIGTERM) is before
    assert sim.gpus[0].power_limit_w() == 200.0 and len(journals(jdir)) == 1
    guard.restore()
    assert sim.gpus[0].power_limit_w() == 400.0


def test_handlers_installed_ahead_protect_changes_made_from_another_thread(
    sim: Simulator, jdir: Path, sigterm_recorder: list[int]
) -> None:
    import threading

    g = sim.gpus[0]
    ours = signal.getsignal(signal.SIGTERM)
    guard = RestoreGuard(sim.gpus, journal_dir=jdir)
    assert guard.install_signal_handlers()
    t = threading.Thread(target=guard.lock_sm_clock, args=(g, 1005.0, 1005.0))
    t.start()
    t.join()
    assert g.sm_clock_locked() == (1005.0, 1005.0)
    signal.raise_signal(signal.SIGTERM)
    assert sigterm_recorder == [signal.SIGTERM]
    assert g.sm_clock_locked() is None and journals(jdir) == []
    # Held: still in place with nothing to restore, for the next change from the thread.
    assert signal.getsignal(signal.SIGTERM) == guard._handle_signal
    guard.uninstall_signal_handlers()
    assert signal.getsignal(signal.SIGTERM) is ours


def test_restore_that_partly_failed_keeps_the_hooks(
    sim: Simulator, jdir: Path, sigterm_recorder: list[int]
) -> None:
    g = sim.gpus[0]
    guard = RestoreGuard(sim.gpus, journal_dir=jdir)
    guard.set_power_limit_w(g, 200.0)
    g.allow_control = False  # the driver refuses the restore for a while
    assert len(guard.restore()) == 1
    g.allow_control = True
    guard.set_power_limit_w(g, 150.0)  # training goes on
    assert signal.getsignal(signal.SIGTERM) == guard._handle_signal
    signal.raise_signal(signal.SIGTERM)
    assert sigterm_recorder == [signal.SIGTERM]
    assert g.power_limit_w() == 400.0 and guard.changed == [] and journals(jdir) == []


def test_restore_that_partly_failed_still_restores_at_exit(
    sim: Simulator, jdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exit_hooks: list[object] = []
    monkeypatch.setattr(restore_mod.atexit, "register", exit_hooks.append)
    monkeypatch.setattr(restore_mod.atexit, "unregister", exit_hooks.remove)
    g = sim.gpus[0]
    guard = RestoreGuard(sim.gpus, journal_dir=jdir, handle_signals=False)
    guard.set_power_limit_w(g, 200.0)
    g.allow_control = False
    guard.restore()
    g.allow_control = True
    guard.set_power_limit_w(g, 150.0)
    assert exit_hooks == [guard._at_exit]
    guard._at_exit()  # what the interpreter runs at exit
    assert g.power_limit_w() == 400.0 and exit_hooks == []


def guards(g: SimGPU, *dirs: Path) -> list[RestoreGuard]:
    """One guard over ``g`` per journal directory (signal handling off)."""
    return [RestoreGuard([g], journal_dir=d, handle_signals=False) for d in dirs]


@pytest.mark.parametrize("first", ["a", "b"])
def test_two_guards_on_one_gpu_put_back_the_limit_it_had_before_both(
    sim: Simulator, jdir: Path, first: str
) -> None:
    g = sim.gpus[0]
    g.set_power_limit_w(300.0)
    a, b = guards(g, jdir, jdir)
    a.set_power_limit_w(g, 200.0)
    b.set_power_limit_w(g, 250.0)  # sees 200 W, but a's journal records 300 W before it
    assert b.changed[0].original_power_limit_w == 300.0
    for guard in (a, b) if first == "a" else (b, a):
        guard.restore()
    assert g.power_limit_w() == 300.0 and journals(jdir) == []


def test_the_original_of_a_dead_or_other_host_journal_is_not_taken(sim: Simulator, jdir: Path) -> None:
    g = sim.gpus[0]
    g.set_power_limit_w(250.0)  # e.g. the admin's limit since that job
    write_journal(jdir, dead_pid(), [entry(g, 300.0)], name="dead.json")
    write_journal(jdir, os.getpid(), [entry(g, 350.0)], host="some-other-host", name="other.json")
    guard = RestoreGuard([g], journal_dir=jdir, handle_signals=False, recover_stale=False)
    guard.set_power_limit_w(g, 200.0)
    assert guard.changed[0].original_power_limit_w == 250.0
    guard.restore()
    assert g.power_limit_w() == 250.0


# -- several guards on one GPU: the one that restores first leaves it to the others --------------
def two_dirs(jdir: Path, dirs: str) -> tuple[Path, Path]:
    return (jdir, jdir) if dirs == "same" else (jdir, jdir.parent / "other-restore")


@pytest.mark.parametrize("dirs", ["same", "different"])
@pytest.mark.parametrize("first", ["a", "b"])
def test_a_guard_restoring_first_leaves_the_limit_the_other_set(
    sim: Simulator, jdir: Path, dirs: str, first: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=restore_mod.__name__)
    g = sim.gpus[0]
    g.set_power_limit_w(300.0)
    dir_a, dir_b = two_dirs(jdir, dirs)
    a, b = guards(g, dir_a, dir_b)
    a.set_power_limit_w(g, 250.0)
    b.set_power_limit_w(g, 200.0)  # sees 250 W; a (whatever its directory) had 300 W before
    assert b.changed[0].original_power_limit_w == 300.0
    one, other, kept = (a, b, 200.0) if first == "a" else (b, a, 250.0)
    assert one.restore() == []
    assert g.power_limit_w() == kept  # the one still running keeps the limit it set
    assert one.changed == [] and one.journal_path is None
    assert "left at" in caplog.text and "it puts back 300 W" in caplog.text
    # Its journal still holds the original, for a recovery if it is killed.
    assert other.journal_path is not None
    assert journal_gpus(other.journal_path) == [entry(g, 300.0, applied=kept)]
    assert other.restore() == []
    assert g.power_limit_w() == 300.0
    assert journals(dir_a) == journals(dir_b) == []


@pytest.mark.parametrize("dirs", ["same", "different"])
def test_the_limit_left_is_the_one_the_running_guard_set_last(
    sim: Simulator, jdir: Path, dirs: str
) -> None:
    g = sim.gpus[0]
    g.set_power_limit_w(300.0)
    dir_a, dir_b = two_dirs(jdir, dirs)
    a, b, c = guards(g, dir_a, dir_b, dir_a)
    a.set_power_limit_w(g, 250.0)
    b.set_power_limit_w(g, 200.0)
    c.set_power_limit_w(g, 220.0)
    b.set_power_limit_w(g, 190.0)  # b set it last
    a.set_power_limit_w(g, 260.0)  # a changes it again, and ends
    a.restore()
    assert g.power_limit_w() == 190.0  # not a's 260 W, nor c's older 220 W
    b.restore()
    assert g.power_limit_w() == 220.0
    c.restore()
    assert g.power_limit_w() == 300.0


@pytest.mark.parametrize("dirs", ["same", "different"])
@pytest.mark.parametrize("first", ["a", "b"])
def test_a_clock_locked_by_another_running_guard_stays_locked(
    sim: Simulator, jdir: Path, dirs: str, first: str
) -> None:
    g = sim.gpus[0]
    dir_a, dir_b = two_dirs(jdir, dirs)
    a, b = guards(g, dir_a, dir_b)
    a.lock_sm_clock(g, 210.0, 900.0)
    a.set_power_limit_w(g, 250.0)
    b.lock_sm_clock(g, 1005.0, 1005.0)
    one, other = (a, b) if first == "a" else (b, a)
    assert one.restore() == []
    # Left to the other guard, at the range that guard locked (the GPU was at b's, locked
    # last: b leaving first left it there, and a took it for its own 210-900 MHz).
    assert g.sm_clock_locked() == ((1005.0, 1005.0) if first == "a" else (210.0, 900.0))
    assert other.holds_sm_clock(g, g.sm_clock_locked())
    assert one.changed == []
    assert other.restore() == []
    assert g.sm_clock_locked() is None and g.power_limit_w() == 400.0
    assert journals(dir_a) == journals(dir_b) == []


def test_a_restore_failing_keeps_the_guard_holding_the_gpu(sim: Simulator, jdir: Path) -> None:
    g = sim.gpus[0]
    g.set_power_limit_w(300.0)
    a, b = guards(g, jdir, jdir)
    a.set_power_limit_w(g, 250.0)
    b.set_power_limit_w(g, 200.0)
    g.allow_control = False
    assert len(b.restore()) == 1  # b holds on to its change
    g.allow_control = True
    assert a.restore() == [] and g.power_limit_w() == 200.0  # left to b, which still has it
    assert b.restore() == [] and g.power_limit_w() == 300.0


class _SlowGPU(SimGPU):
    """A GPU whose limit changes take a while, so that restores in two threads overlap."""

    slow = False

    def set_power_limit_w(self, watts: float) -> None:
        if self.slow:
            time.sleep(0.1)
        super().set_power_limit_w(watts)


def test_guards_restoring_at_once_do_not_both_leave_the_gpu_to_the_other(jdir: Path) -> None:
    sim = Simulator("A100")
    g = _SlowGPU(sim.gpus[0].model, sim.clock)
    g.set_power_limit_w(300.0)
    guards = [RestoreGuard([g], journal_dir=jdir, handle_signals=False) for _ in range(2)]
    guards[0].set_power_limit_w(g, 250.0)
    guards[1].set_power_limit_w(g, 200.0)
    g.slow = True
    start = threading.Barrier(2)

    def restore(guard: RestoreGuard) -> None:
        start.wait()
        guard.restore()

    threads = [threading.Thread(target=restore, args=(guard,)) for guard in guards]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert g.power_limit_w() == 300.0 and journals(jdir) == []


class _SignalOnceGPU(SimGPU):
    """A GPU whose next limit change, once armed, is interrupted by SIGTERM."""

    armed = False

    def set_power_limit_w(self, watts: float) -> None:
        if self.armed:
            self.armed = False
            signal.raise_signal(signal.SIGTERM)
        super().set_power_limit_w(watts)


def test_signal_while_a_guard_hands_a_gpu_over_is_handled_after_it(
    jdir: Path, sigterm_recorder: list[int]
) -> None:
    sim = Simulator("A100")
    g = _SignalOnceGPU(sim.gpus[0].model, sim.clock)
    g.set_power_limit_w(300.0)
    a = RestoreGuard([g], journal_dir=jdir)
    b = RestoreGuard([g], journal_dir=jdir)  # its handler is on top, and chains to a's
    a.set_power_limit_w(g, 250.0)
    b.set_power_limit_w(g, 200.0)
    g.armed = True
    a.restore()  # SIGTERM lands while a leaves the GPU to b: b restores after, not half-way
    assert sigterm_recorder == [signal.SIGTERM]
    assert g.power_limit_w() == 300.0 and journals(jdir) == []


def test_a_running_job_of_an_older_version_gets_the_gpu_as_it_is(sim: Simulator, jdir: Path) -> None:
    parent = os.getppid()  # some running process of this host stands for that job
    if process_start_time(parent) is None:
        pytest.skip("no /proc here")
    g = sim.gpus[0]
    g.set_power_limit_w(280.0)
    # Its journal has no limit set last (older journals do not record one).
    path = write_journal(jdir, parent, [entry(g, 300.0)], start=process_start_time(parent))
    guard = RestoreGuard([g], journal_dir=jdir, handle_signals=False, recover_stale=False)
    guard.set_power_limit_w(g, 250.0)
    assert guard.changed[0].original_power_limit_w == 300.0
    assert guard.restore() == []
    assert g.power_limit_w() == 250.0 and journals(jdir) == [path]  # left for that job to restore


def test_recovery_leaves_a_gpu_that_a_running_guard_holds(sim: Simulator, jdir: Path) -> None:
    g0, g1 = sim.gpus
    g0.set_power_limit_w(150.0)
    g1.set_power_limit_w(150.0)
    g1.lock_sm_clock(210.0, 900.0)
    guard = RestoreGuard(sim.gpus, journal_dir=jdir.parent / "elsewhere", handle_signals=False)
    guard.set_power_limit_w(g0, 200.0)
    guard.lock_sm_clock(g1, 1005.0, 1005.0)
    write_journal(jdir, dead_pid(), [entry(g0, 300.0, applied=150.0), entry(g1, 275.0, True)])
    lines = recover(sim.gpus, jdir)
    assert len(lines) == 2
    assert "power limit left at 200 W" in lines[0] and "guard in this process" in lines[0]
    assert "SM clock locked at 1005-1005 MHz for another joules guard" in lines[1]
    assert "150 W -> 275 W" in lines[1]
    assert (g0.power_limit_w(), g1.power_limit_w(), g1.sm_clock_locked()) == (200.0, 275.0, (1005.0, 1005.0))
    assert journals(jdir) == []
    guard.restore()
    assert g0.power_limit_w() == 150.0 and g1.sm_clock_locked() is None


def test_default_journal_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("JOULES_STATE_DIR", str(tmp_path / "s"))
    assert default_journal_dir() == tmp_path / "s" / "restore"
    monkeypatch.delenv("JOULES_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "x"))
    assert default_journal_dir() == tmp_path / "x" / "joules" / "restore"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert default_journal_dir() == tmp_path / "h" / ".local" / "state" / "joules" / "restore"


def test_process_alive() -> None:
    me = os.getpid()
    assert process_alive(me) and process_alive(me, process_start_time(me))
    assert not process_alive(dead_pid())
    assert not process_alive(0) and not process_alive(-1)
    start = process_start_time(me)
    if start is not None:  # Linux: a reused pid is told apart by its start time
        assert not process_alive(me, start + 1)


# -- recover ----------------------------------------------------------------------------------
def test_recover_restores_what_a_dead_process_left(sim: Simulator, jdir: Path) -> None:
    g0, g1 = sim.gpus
    g0.set_power_limit_w(150.0)
    g1.set_power_limit_w(125.0)
    g1.lock_sm_clock(210.0, 900.0)
    write_journal(jdir, dead_pid(), [entry(g0, 300.0), entry(g1, 275.0, True)])
    lines = recover(sim.gpus, jdir)
    assert len(lines) == 2
    assert "power limit 150 W -> 300 W" in lines[0]
    assert "SM clock unlocked" in lines[1] and "125 W -> 275 W" in lines[1]
    assert (g0.power_limit_w(), g1.power_limit_w(), g1.sm_clock_locked()) == (300.0, 275.0, None)
    assert journals(jdir) == []
    assert recover(sim.gpus, jdir) == []


@pytest.mark.parametrize("stamp", ["created", "written"])
def test_recover_applies_the_oldest_original_last(sim: Simulator, jdir: Path, stamp: str) -> None:
    g = sim.gpus[0]
    g.set_power_limit_w(150.0)
    # Two killed jobs lowered the GPU; the later one recorded the earlier one's 200 W as its
    # original (journals without the original of a running job). The older journal sorts
    # first by name, so recovering in name order would end at 200 W.
    times = {"created": (1000.0, 2000.0),
             "written": ("2024-05-01T10:00:00+0000", "2024-05-01T11:00:00+0000")}[stamp]
    for name, when, limit in (("a.json", times[0], 400.0), ("b.json", times[1], 200.0)):
        path = write_journal(jdir, dead_pid(), [entry(g, limit)], name=name)
        path.write_text(json.dumps({**json.loads(path.read_text()), stamp: when}))
    lines = recover(sim.gpus, jdir)
    assert len(lines) == 2 and "150 W -> 200 W" in lines[0] and "200 W -> 400 W" in lines[1]
    assert g.power_limit_w() == 400.0 and journals(jdir) == []


def test_recover_leaves_live_and_other_host_journals_alone(sim: Simulator, jdir: Path) -> None:
    g = sim.gpus[0]
    g.set_power_limit_w(150.0)
    me = os.getpid()
    write_journal(jdir, me, [entry(g, 300.0)], start=process_start_time(me), name="live.json")
    write_journal(jdir, dead_pid(), [entry(g, 300.0)], host="some-other-host", name="other.json")
    report = recover_report(sim.gpus, jdir)
    assert sorted(x.kind for x in report) == ["live", "other-host"]
    assert all(x.ok for x in report)
    assert g.power_limit_w() == 150.0 and len(journals(jdir)) == 2


def test_recover_treats_a_reused_pid_as_dead(sim: Simulator, jdir: Path) -> None:
    start = process_start_time(os.getpid())
    if start is None:
        pytest.skip("no /proc here")
    g = sim.gpus[0]
    g.set_power_limit_w(150.0)
    write_journal(jdir, os.getpid(), [entry(g, 300.0)], start=start - 1)
    assert [x.kind for x in recover_report(sim.gpus, jdir)] == ["restored"]
    assert g.power_limit_w() == 300.0


def test_recover_keeps_gpus_not_present(sim: Simulator, jdir: Path) -> None:
    g0, g1 = sim.gpus
    g1.set_power_limit_w(125.0)
    elsewhere = {"uuid": "GPU-not-here", "index": 7, "name": "NVIDIA H100", "power_limit_w": 700.0,
                 "sm_clock_locked": False}
    path = write_journal(jdir, dead_pid(), [elsewhere, entry(g1, 275.0)])
    report = recover_report([g1], jdir)
    assert [x.kind for x in report] == ["kept", "restored"]
    assert "GPU-not-here" in report[0].message
    assert g1.power_limit_w() == 275.0
    assert json.loads(path.read_text())["gpus"] == [elsewhere]  # only what is left to do
    assert [x.kind for x in recover_report(sim.gpus, jdir)] == ["kept"]


def test_recover_reports_and_keeps_corrupt_journals(sim: Simulator, jdir: Path) -> None:
    jdir.mkdir()
    (jdir / "broken.json").write_text("{not json")
    write_journal(jdir, 0, [entry(sim.gpus[0], 300.0)], name="bad-pid.json")
    report = recover_report(sim.gpus, jdir)
    assert [x.kind for x in report] == ["corrupt", "corrupt"]
    assert not any(x.ok for x in report)
    assert len(journals(jdir)) == 2


def test_a_journal_with_an_impossible_pid_is_corrupt_and_stops_nothing(sim: Simulator, jdir: Path) -> None:
    guard = RestoreGuard(sim.gpus, journal_dir=jdir, handle_signals=False)
    for g in sim.gpus:
        guard.set_power_limit_w(g, 250.0)
    write_journal(jdir, 2**64, [entry(sim.gpus[0], 300.0)], name="other.json")  # beyond any pid
    assert guard.restore() == []
    assert [g.power_limit_w() for g in sim.gpus] == [400.0, 400.0]
    assert [x.kind for x in recover_report(sim.gpus, jdir)] == ["corrupt"]
    assert not process_alive(2**64)


def test_recover_failure_is_reported_and_kept(sim: Simulator, jdir: Path) -> None:
    g = sim.gpus[0]
    g.set_power_limit_w(150.0)
    g.allow_control = False
    path = write_journal(jdir, dead_pid(), [entry(g, 300.0)])
    [line] = recover_report(sim.gpus, jdir)
    assert line.kind == "failed" and not line.ok and "no permission" in line.message
    assert path.exists() and g.power_limit_w() == 150.0


def test_new_guard_heals_what_a_killed_job_left(sim: Simulator, jdir: Path) -> None:
    g = sim.gpus[0]
    g.set_power_limit_w(150.0)
    write_journal(jdir, dead_pid(), [entry(g, 300.0)])
    guard = RestoreGuard(sim.gpus, journal_dir=jdir, handle_signals=False)
    assert len(guard.recovered) == 1 and "150 W -> 300 W" in guard.recovered[0]
    assert g.power_limit_w() == 300.0 and journals(jdir) == []
    guard.set_power_limit_w(g, 200.0)
    assert guard.changed[0].original_power_limit_w == 300.0
    guard.restore()
    untouched = RestoreGuard(sim.gpus, journal_dir=jdir, recover_stale=False)
    assert untouched.recovered == []


def test_journal_write_failure_does_not_stop_the_change(
    sim: Simulator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    guard = RestoreGuard(sim.gpus, journal_dir=blocker / "restore", handle_signals=False)
    guard.set_power_limit_w(sim.gpus[0], 200.0)
    assert "cannot write the restore journal" in caplog.text
    guard.restore()
    assert sim.gpus[0].power_limit_w() == 400.0


# -- real processes ---------------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import signal, sys, time
    from joules.devices.discovery import discover
    from joules.devices.restore import RestoreGuard

    if sys.argv[1] == "nohup":
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    gpus = discover().gpus
    guard = RestoreGuard(gpus)
    guard.set_power_limit_w(gpus[0], 150)
    guard.set_power_limit_w(gpus[1], 125)
    guard.lock_sm_clock(gpus[1], 210, 900)
    print("ready", flush=True)
    mode = sys.argv[1]
    if mode == "exit":
        sys.exit(0)
    if mode == "raise":
        raise RuntimeError("training crashed")
    time.sleep(60)
""")


@pytest.fixture
def shared(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A state file with GPU limits 300 W and 275 W, and the environment that shares it."""
    state = tmp_path / "state.json"
    pre = Simulator("A100x2", state_file=state)
    pre.gpus[0].set_power_limit_w(300.0)
    pre.gpus[1].set_power_limit_w(275.0)
    env = dict(os.environ, JOULES_SIM="A100x2", JOULES_SIM_STATE=str(state), JOULES_STATE_DIR=str(tmp_path))
    return state, env


def recorded(state: Path) -> tuple[float, float, list[float] | None]:
    gpus = json.loads(state.read_text())["gpus"]
    return gpus["0"]["power_limit_w"], gpus["1"]["power_limit_w"], gpus["1"]["sm_clock_lock_mhz"]


def start_child(mode: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return start_ready([sys.executable, "-c", CHILD, mode], env, "ready", timeout_s=30)


@pytest.mark.parametrize("mode", ["exit", "raise"])
def test_child_that_ends_restores(mode: str, shared: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    state, env = shared
    p = start_child(mode, env)
    _, err = p.communicate(timeout=30)
    if mode == "exit":
        assert p.returncode == 0, err
    else:
        assert p.returncode == 1 and "RuntimeError: training crashed" in err
    assert recorded(state) == (300.0, 275.0, None)
    assert journals(tmp_path / "restore") == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_child_interrupted_restores(signum: int, shared: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    state, env = shared
    p = start_child("wait", env)
    try:
        assert recorded(state) == (150.0, 125.0, [210.0, 900.0])
        [path] = journals(tmp_path / "restore")
        # The child runs: its journal is not touched by a recovery elsewhere.
        assert [x.kind for x in recover_report(Simulator("A100x2", state_file=state).gpus,
                                               tmp_path / "restore")] == ["live"]
        assert recorded(state) == (150.0, 125.0, [210.0, 900.0]) and path.exists()
        p.send_signal(signum)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
    assert p.returncode == -signum, err  # still "killed by the signal" for whoever waits on it
    if signum == signal.SIGINT:
        assert "KeyboardInterrupt" in err
    assert recorded(state) == (300.0, 275.0, None)
    assert journals(tmp_path / "restore") == []


def test_a_hang_up_under_nohup_leaves_the_job_running_with_its_settings(
        shared: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    state, env = shared
    p = start_child("nohup", env)
    try:
        p.send_signal(signal.SIGHUP)  # ignored: the job goes on, and so do its settings
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(timeout=1.0)
        assert recorded(state) == (150.0, 125.0, [210.0, 900.0])
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
    assert p.returncode == -signal.SIGTERM
    assert recorded(state) == (300.0, 275.0, None)


@pytest.mark.parametrize("how", ["recover", "cli"])
def test_child_sigkilled_is_recovered_from_its_journal(
    how: str, shared: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    state, env = shared
    p = start_child("wait", env)
    p.kill()
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL
    assert recorded(state) == (150.0, 125.0, [210.0, 900.0])  # SIGKILL cannot be caught
    [path] = journals(tmp_path / "restore")
    data = json.loads(path.read_text())
    assert data["pid"] == p.pid
    assert [(g["index"], g["power_limit_w"], g["sm_clock_locked"]) for g in data["gpus"]] == [
        (0, 300.0, False), (1, 275.0, True)]
    if how == "recover":
        lines = recover(Simulator("A100x2", state_file=state).gpus, tmp_path / "restore")
        assert len(lines) == 2 and "150 W -> 300 W" in lines[0] and "125 W -> 275 W" in lines[1]
    else:
        r = subprocess.run([JOULES, "restore", "--sim", "A100x2"], env=env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        assert "150 W -> 300 W" in r.stdout and "125 W -> 275 W" in r.stdout
    assert recorded(state) == (300.0, 275.0, None)
    assert journals(tmp_path / "restore") == []


def test_journal_records_pid_and_start_time_of_the_writer(jdir: Path) -> None:
    sim = Simulator("A100")
    guard = RestoreGuard(sim.gpus, journal_dir=jdir, handle_signals=False)
    guard.set_power_limit_w(sim.gpus[0], 200.0)
    [path] = journals(jdir)
    assert path.name == f"{socket.gethostname()}-{os.getpid()}-{guard._id}.json"
    assert restore_mod.process_alive(os.getpid(), json.loads(path.read_text())["process_start_time"])
    guard.restore()


TWO_JOBS_CHILD = textwrap.dedent("""
    import os, sys, time
    from joules.devices.discovery import discover
    from joules.devices.restore import RestoreGuard

    gpus = discover().gpus
    guard = RestoreGuard(gpus)
    guard.set_power_limit_w(gpus[0], float(sys.argv[1]))
    print("ready", flush=True)
    while not os.path.exists(sys.argv[2]):  # until the parent says the job is done
        time.sleep(0.02)
""")


def test_two_processes_lowering_one_gpu_leave_it_as_it_was(
    shared: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    state, env = shared
    def job(limit: str, done: Path) -> subprocess.Popen[str]:
        return start_ready([sys.executable, "-c", TWO_JOBS_CHILD, limit, str(done)], env, "ready",
                           timeout_s=30)

    a = job("200", tmp_path / "a-done")
    b = None
    try:
        b = job("150", tmp_path / "b-done")
        assert recorded(state)[0] == 150.0
        for p, done in ((a, "a-done"), (b, "b-done")):  # the first job ends first
            (tmp_path / done).touch()
            _, err = p.communicate(timeout=30)
            assert p.returncode == 0, err
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    assert recorded(state)[0] == 300.0
    assert journals(tmp_path / "restore") == []

def test_a_job_ending_first_leaves_the_gpu_to_a_running_job_until_it_is_killed(
    shared: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    state, env = shared
    jdir = tmp_path / "restore"
    g = Simulator("A100x2", state_file=state).gpus[0]
    a = RestoreGuard([g], journal_dir=jdir, handle_signals=False)
    a.set_power_limit_w(g, 250.0)
    b = start_ready([sys.executable, "-c", TWO_JOBS_CHILD, "200", str(tmp_path / "b-done")], env, "ready",
                    timeout_s=30)
    try:
        assert recorded(state)[0] == 200.0
        a.set_power_limit_w(g, 260.0)  # a changes it again, after b
        assert a.restore() == []
        assert recorded(state)[0] == 200.0  # the limit b set, b still runs
        [path] = journals(jdir)
        assert json.loads(path.read_text())["pid"] == b.pid
        assert journal_gpus(path) == [entry(g, 300.0, applied=200.0)]  # a's original
        b.kill()
        b.wait(timeout=30)
    finally:
        if b.poll() is None:
            b.kill()
            b.wait(timeout=10)
    [line] = recover(Simulator("A100x2", state_file=state).gpus, jdir)
    assert "200 W -> 300 W" in line
    assert recorded(state)[0] == 300.0 and journals(jdir) == []


def test_recovering_a_killed_job_leaves_the_gpu_to_a_running_one(
    shared: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    state, env = shared
    jdir = tmp_path / "restore"
    a = start_ready([sys.executable, "-c", TWO_JOBS_CHILD, "250", str(tmp_path / "a-done")], env, "ready",
                    timeout_s=30)
    try:
        g = Simulator("A100x2", state_file=state).gpus[0]
        b = RestoreGuard([g], journal_dir=jdir, handle_signals=False)
        b.set_power_limit_w(g, 200.0)
        assert b.changed[0].original_power_limit_w == 300.0  # from a's journal
        a.kill()
        a.wait(timeout=30)
    finally:
        if a.poll() is None:
            a.kill()
            a.wait(timeout=10)
    # A job starting now recovers what a left, but b still runs: the GPU stays at b's limit.
    c = RestoreGuard([g], journal_dir=jdir, handle_signals=False)
    assert len(c.recovered) == 1 and "power limit left at 200 W" in c.recovered[0]
    assert recorded(state)[0] == 200.0 and journals(jdir) == [b.journal_path]
    b.restore()
    assert recorded(state)[0] == 300.0 and journals(jdir) == []



SIGNAL_CHILD = textwrap.dedent("""
    import signal, sys
    from joules.devices.discovery import discover
    from joules.devices.restore import RestoreGuard
    from joules.errors import DevicePermissionError

    mode = sys.argv[1]
    g0, g1 = discover().gpus

    def user_handler(signum, frame):  # e.g. a framework's checkpoint-on-SIGTERM handler
        print("user handler", flush=True)
        sys.exit(143)

    signal.signal(signal.SIGTERM, user_handler)
    a = RestoreGuard([g0])
    b = RestoreGuard([g1])
    a.set_power_limit_w(g0, 200.0)
    real = type(g1).set_power_limit_w

    def interrupted(self, watts):  # SIGTERM lands while b changes g1
        if self is g1:
            signal.raise_signal(signal.SIGTERM)
            if mode == "failed-change":
                raise DevicePermissionError("no permission")
        real(self, watts)

    if mode == "restore":
        b.set_power_limit_w(g1, 250.0)
        type(g1).set_power_limit_w = interrupted
        b.restore()  # e.g. b's with block ends normally
    else:
        type(g1).set_power_limit_w = interrupted
        try:
            b.set_power_limit_w(g1, 250.0)  # b's first change fails
        except DevicePermissionError:
            pass
    print("not reached", flush=True)
""")


@pytest.mark.parametrize("mode", ["restore", "failed-change"])
def test_signal_while_a_guard_restores_reaches_the_earlier_handlers(
    mode: str, shared: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    state, env = shared
    r = subprocess.run([sys.executable, "-c", SIGNAL_CHILD, mode], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 143, r.stderr  # the user's handler ran, after every guard restored
    assert r.stdout == "user handler\n"
    assert recorded(state)[:2] == (300.0, 275.0)
    assert journals(tmp_path / "restore") == []


def test_a_job_killed_after_another_guard_was_made_is_not_taken_for_the_original(
        shared: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    # Job B's guard is made while job A runs (A's journal is live then, left alone); A is then
    # killed before B's first change. B must not take A's lowered limit for the original.
    state, env = shared
    p = start_child("wait", env)
    gpus = Simulator("A100x2", state_file=state).gpus
    guard = RestoreGuard(gpus, journal_dir=tmp_path / "restore", handle_signals=False)
    p.kill()
    p.wait(timeout=30)
    guard.set_power_limit_w(gpus[0], 200.0)
    assert [c.original_power_limit_w for c in guard.changed] == [300.0]
    assert any("left by process" in line for line in guard.recovered)
    assert guard.restore() == []
    assert recorded(state) == (300.0, 275.0, None)  # A's changes put back, then B's
    assert journals(tmp_path / "restore") == []


FORKING = textwrap.dedent("""
    import os, sys
    from joules.devices.discovery import discover
    from joules.devices.restore import RestoreGuard

    gpus = discover().gpus
    guard = RestoreGuard(gpus)
    guard.set_power_limit_w(gpus[0], 150)
    pid = os.fork()
    if pid == 0:  # a worker: its copy of the guard holds nothing of the parent's
        try:
            with guard:
                guard.set_power_limit_w(discover().gpus[1], 125)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    print("ready", flush=True)
    import time; time.sleep(60)
""")


def test_a_forked_child_neither_restores_nor_takes_over_its_parents_changes(
        shared: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    state, env = shared
    p = start_ready([sys.executable, "-c", FORKING], env, "ready", timeout_s=30)
    try:
        # The child put back its own change only; the parent's stands, in its own journal.
        assert recorded(state)[:2] == (150.0, 275.0)
        [path] = journals(tmp_path / "restore")
        assert json.loads(path.read_text())["pid"] == p.pid
        assert [x.kind for x in recover_report(Simulator("A100x2", state_file=state).gpus,
                                               tmp_path / "restore")] == ["live"]
    finally:
        p.kill()
        p.wait(timeout=10)
    recover_report(Simulator("A100x2", state_file=state).gpus, tmp_path / "restore")
    assert recorded(state)[:2] == (300.0, 275.0)
