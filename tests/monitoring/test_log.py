"""``WindowLog``: appending to a file a killed job left with a cut-off last line."""

from __future__ import annotations

import csv
import json
import os
import signal
import threading
from pathlib import Path

import pytest

from joules.monitoring.log import WindowLog
from joules.monitoring.measurement import DeviceEnergy, Measurement, Source


def window(name: str, gpu_j: float, start: float) -> Measurement:
    return Measurement(
        name=name,
        start_time=start,
        elapsed_s=1.5,
        gpu={0: DeviceEnergy(gpu_j, Source.COUNTER, 0.5, False, "GPU-a")},
        cpu={0: DeviceEnergy(40.0, Source.SAMPLED, 0.2, True, "h/cpu0")},
        host="h",
    )


def test_jsonl_records_after_a_cut_off_line_stay_whole(tmp_path: Path) -> None:
    path = tmp_path / "windows.jsonl"
    earlier = window("earlier", 100.0, 10.0)
    partial = json.dumps(window("killed", 120.0, 11.5).to_dict())[:45]
    path.write_text(json.dumps(earlier.to_dict()) + "\n" + partial)
    ours, next_one = window("ours", 130.0, 20.0), window("next", 140.0, 21.5)

    log = WindowLog(path)
    log.write(ours)
    log.write(next_one)
    log.close()

    lines = path.read_text().splitlines()
    assert len(lines) == 4
    assert lines[1] == partial  # the broken line stays as it was
    records = [Measurement.from_dict(json.loads(line)) for i, line in enumerate(lines) if i != 1]
    assert records == [earlier, ours, next_one]


@pytest.mark.parametrize("suffix", ["jsonl", "csv"])
def test_writers_that_opened_a_file_ending_in_a_cut_off_line_end_it_once(tmp_path: Path, suffix: str) -> None:
    # Ranks of a job reopen a log a killed run left cut off; each opened it before any wrote:
    # the line is ended once, with no blank line after it (a JSONL reader breaks on one).
    path = tmp_path / f"windows.{suffix}"
    first = WindowLog(path)
    first.write(window("earlier", 100.0, 10.0))
    first.close()
    with path.open("a") as f:
        f.write('{"name": "kil' if suffix == "jsonl" else "killed,h,1.")
    logs = [WindowLog(path) for _ in range(3)]
    for log in logs:
        log._open()  # as when they all open it at once
    for i, log in enumerate(logs):
        log.write(window(f"rank{i}", 100.0 + i, 10.0 + i))
        log.close()
    lines = path.read_text().splitlines()
    assert "" not in lines and len(lines) == (5 if suffix == "jsonl" else 6)


def test_csv_row_after_a_cut_off_line_stays_whole(tmp_path: Path) -> None:
    path = tmp_path / "windows.csv"
    columns = WindowLog.csv_columns([0], [0], [])
    first = WindowLog(path, columns=columns)
    first.write(window("earlier", 100.0, 10.0))
    first.close()
    with path.open("a", newline="") as f:
        f.write("killed,h,11.5,1.5,16")  # a row cut off mid-number, without its newline
    cut = path.read_bytes()

    log = WindowLog(path, columns=columns)
    other_devices = Measurement("gpu1", 15.0, 1.0, gpu={1: DeviceEnergy(9.0, Source.COUNTER)}, host="h")
    with pytest.raises(ValueError, match="other devices"):
        log.write(other_devices)
    assert path.read_bytes() == cut  # nothing is written for a refused row
    ours = window("ours", 130.0, 20.0)
    log.write(ours)
    log.close()

    with path.open(newline="") as f:
        raw = list(csv.reader(f))
    assert raw[0] == columns and sum(r == columns for r in raw) == 1  # the header was found, not rewritten
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["name"] for r in rows] == ["earlier", "killed", "ours"]
    row = rows[2]
    assert None not in row and all(row[c] for c in columns)  # every cell, none spilled over
    assert row["host"] == "h"
    assert float(row["start_time"]) == 20.0 and float(row["elapsed_s"]) == 1.5
    assert float(row["gpu0_energy_j"]) == 130.0 and row["gpu0_source"] == "counter"
    assert float(row["cpu0_energy_j"]) == 40.0 and row["cpu0_source"] == "sampled+corrected"
    assert float(row["total_energy_j"]) == pytest.approx(ours.total_energy_j)
    assert float(row["uncertainty_j"]) == pytest.approx(ours.uncertainty_j)


def test_a_log_write_that_fails_warns_and_the_measurement_is_still_returned(tmp_path: Path) -> None:
    from joules.devices.sim import Constant, Simulator
    from joules.monitoring import EnergyMonitor

    sim = Simulator("A100")
    path = tmp_path / "runs.jsonl"
    monitor = EnergyMonitor(devices=sim.devices(), log=path)
    sim.set_workload(Constant(1.0))
    monitor.begin_window("a")
    sim.advance(1.0)
    assert monitor.end_window("a").gpu_energy_j[0] > 0
    monitor._log.close()  # type: ignore[union-attr]
    path.unlink()
    path.mkdir()  # the file is gone and cannot be made again: every write fails
    monitor.begin_window("b")
    sim.advance(1.0)
    with pytest.warns(RuntimeWarning, match="window 'b' not written to the window log"):
        m = monitor.end_window("b")
    assert m.gpu_energy_j[0] == pytest.approx(sim.gpus[0].power_w(), rel=0.05)
    assert monitor.last["b"] is m
    monitor.close()


def test_several_writers_of_one_new_csv_file_write_one_header(tmp_path: Path) -> None:
    # Ranks of one job logging to one file, each with its own log object, made while it was empty.
    path = tmp_path / "windows.csv"
    columns = WindowLog.csv_columns([0], [0], [])
    logs = [WindowLog(path, columns=columns) for _ in range(4)]
    for log in logs:
        log._open()  # as when they all open it at once, before any header is there
    for i, log in enumerate(logs):
        log.write(window(f"rank{i}", 100.0 + i, 10.0 + i))
    for log in logs:
        log.write(window("again", 1.0, 20.0))
        log.close()
    rows = list(csv.reader(path.open(newline="")))
    assert [r[0] for r in rows].count("name") == 1 and len(rows) == 9
    other = WindowLog(path)  # another writer's header is checked too, once the file has one
    with pytest.raises(ValueError, match="other devices"):
        other.write(Measurement("gpu1", 15.0, 1.0, gpu={1: DeviceEnergy(9.0, Source.COUNTER)}, host="h"))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_writes_while_a_parent_thread_held_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "windows.jsonl"
    log = WindowLog(path)
    log.write(window("parent", 1.0, 1.0))
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with log._lock:
            taken.set()
            release.wait(20)

    threading.Thread(target=hold, daemon=True).start()
    assert taken.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: its lock is free, its file its own
        signal.alarm(10)
        try:
            log.write(window("child", 2.0, 2.0))
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    release.set()
    assert os.waitstatus_to_exitcode(status) == 0  # not killed by the alarm: it did not hang
    names = [json.loads(line)["name"] for line in path.read_text().splitlines()]
    assert names == ["parent", "child"]


@pytest.mark.parametrize("suffix", ["jsonl", "csv"])
def test_a_record_cut_short_by_a_full_disk_leaves_no_trace(tmp_path: Path, suffix: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk mid-record left the record's rest in a buffer, written at the writer's next
    write after other ranks' records: a CSV row without its total and a stray row, or two
    broken JSONL lines."""
    import errno

    path = tmp_path / f"windows.{suffix}"
    rank0, rank1 = WindowLog(path), WindowLog(path)
    rank0.write(window("w1", 100.0, 10.0))
    real_write = os.write
    full = [True]

    def write(fd: int, data: bytes) -> int:  # the disk fills after 20 bytes of rank 0's record
        if fd == rank0._fd and full[0]:
            full[0] = False
            real_write(fd, bytes(data[:20]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(OSError, match="No space"):
        rank0.write(window("w2", 100.0, 11.0))
    rank1.write(window("r1", 100.0, 12.0))  # space freed; another rank writes, then rank 0 again
    rank0.write(window("w3", 100.0, 13.0))
    rank0.close()
    rank1.close()
    if suffix == "jsonl":
        names = [json.loads(line)["name"] for line in path.read_text().splitlines()]
    else:
        rows = list(csv.reader(path.open(newline="")))
        assert {len(r) for r in rows} == {len(rows[0])}  # every row whole
        names = [r[0] for r in rows[1:]]
    assert names == ["w1", "r1", "w3"]


@pytest.mark.parametrize("suffix", ["jsonl", "csv"])
def test_a_log_moved_away_or_deleted_is_made_again(tmp_path: Path, suffix: str) -> None:
    """A log rotated (moved) or deleted while the job ran lost every later window, behind one
    warning: it is made again at its path (a CSV file with its header)."""
    import shutil

    path = tmp_path / "logs" / f"windows.{suffix}"
    log = WindowLog(path, columns=WindowLog.csv_columns([0], [0], []))
    log.write(window("w1", 100.0, 10.0))
    path.rename(tmp_path / f"rotated.{suffix}")
    log.write(window("w2", 100.0, 11.0))
    shutil.rmtree(tmp_path / "logs")  # the folder too
    log.write(window("w3", 100.0, 12.0))
    log.close()
    for p, names in ((tmp_path / f"rotated.{suffix}", ["w1"]), (path, ["w3"])):
        if suffix == "jsonl":
            assert [json.loads(line)["name"] for line in p.read_text().splitlines()] == names
        else:
            assert [r["name"] for r in csv.DictReader(p.open(newline=""))] == names


def test_a_csv_log_emptied_in_place_gets_its_header_again(tmp_path: Path) -> None:
    """logrotate's copytruncate empties the file it keeps: the rows after it had no header."""
    path = tmp_path / "windows.csv"
    log = WindowLog(path)
    log.write(window("w1", 100.0, 10.0))
    os.truncate(path, 0)
    log.write(window("w2", 100.0, 11.0))
    log.close()
    assert [r["name"] for r in csv.DictReader(path.open(newline=""))] == ["w2"]
