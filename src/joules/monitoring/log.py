"""Append every measurement window to a JSONL or CSV file."""

from __future__ import annotations

import csv
import io
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from joules.devices.base import renew_locks_after_fork
from joules.filelock import exclusive
from joules.monitoring.measurement import Measurement


class WindowLog:
    """Appends measurements to ``path``; the format follows the suffix (``.jsonl`` or ``.csv``).

    Each record is written to the file at once (no buffer), so a killed job loses nothing
    already measured, and whole: one that cannot be written to the end (a full disk) is taken
    out again, and the write raises. A measurement written after :meth:`close` is appended too
    (the file is opened for it and closed again). Thread-safe. A file that ends in a cut-off
    line (a job killed while writing it) gets a newline before the next record, so that the
    broken line does not take that record with it. A file moved away (rotated) or deleted
    meanwhile is made again at ``path``; a CSV file emptied meanwhile gets its header again.

    Several monitors, in one process or several (one per rank), may append to one file: a CSV
    file's header is written once, by whichever writes first (under an exclusive lock on the
    file), and every other writer checks its devices against it.

    A CSV file has one column per device, so every row must have the same devices. Given
    ``columns`` (:meth:`csv_columns` of the devices measured), a CSV file that already has
    other columns is refused at once, before anything is measured, rather than losing the
    cells that have no column (the order does not matter).

    Raises:
        ValueError: The suffix is neither ``.jsonl`` nor ``.csv``, or an existing CSV file's
            header does not have exactly ``columns``.
    """

    def __init__(self, path: str | Path, columns: Sequence[str] | None = None) -> None:
        self.path = Path(path)
        if self.path.suffix not in (".jsonl", ".csv"):
            raise ValueError(f"window log needs a .jsonl or .csv file name, got {self.path}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fd: int | None = None
        renew_locks_after_fork(self, WindowLog._after_fork_in_child)
        self._closed = False
        self._csv_columns: list[str] | None = None
        if columns is not None and self.path.suffix == ".csv":
            existing = self._existing_header()
            if existing is not None and set(existing) != set(columns):
                raise ValueError(self._mismatch(existing, list(columns)))

    def _after_fork_in_child(self) -> None:
        """A forked child: a free lock (the parent's may have been held), and a file of its own."""
        self._lock = threading.Lock()
        self._fd = None  # reopened on the next write (the inherited descriptor is left as it is)

    @staticmethod
    def csv_columns(gpus: Sequence[int], cpus: Sequence[int], drams: Sequence[int]) -> list[str]:
        """The CSV header for windows measuring these GPU, CPU package and DRAM indices."""
        cols = ["name", "host", "start_time", "elapsed_s", "total_energy_j", "uncertainty_j"]
        for prefix, keys in (("gpu", gpus), ("cpu", cpus), ("dram", drams)):
            for k in keys:
                cols += [f"{prefix}{k}_energy_j", f"{prefix}{k}_source"]
        return cols

    def _existing_header(self) -> list[str] | None:
        if not (self.path.exists() and self.path.stat().st_size > 0):
            return None
        with self.path.open(newline="") as f:
            return next(csv.reader(f), None)

    def _mismatch(self, existing: list[str], wanted: list[str]) -> str:
        missing = [c for c in wanted if c not in existing]
        extra = [c for c in existing if c not in wanted]
        what = "; ".join(part for part in (
            f"it lacks {', '.join(missing)}" if missing else "",
            f"it has {', '.join(extra)}, which these windows do not measure" if extra else "",
        ) if part)
        return (f"window log {self.path} was written for other devices ({what}): use another "
                f"file, or a .jsonl log, which takes any devices")

    def _open(self) -> int:
        """The file's descriptor, opened again where the path no longer names the open file.

        A log moved away (rotated) or deleted while the job runs is made again at its path,
        as a new file (a CSV file gets its header again), rather than losing every window.
        """
        if self._fd is not None:
            try:
                st, ours = os.stat(self.path), os.fstat(self._fd)
                same = (st.st_dev, st.st_ino) == (ours.st_dev, ours.st_ino)
            except FileNotFoundError:
                same = False
            if not same:
                self._close_fd()
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
            self._fd = os.open(self.path, flags, 0o666)
            if self.path.suffix == ".csv":
                self._csv_columns = self._existing_header()
        return self._fd

    def _close_fd(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
            self._csv_columns = None

    @staticmethod
    def _ends_mid_line(fd: int, size: int) -> bool:
        """Whether a file of ``size`` bytes is not empty and its last byte is not a newline.

        Looked at just before each record, under the file lock: another writer may have ended
        it (or cut one off) since this one opened the file.
        """
        return size > 0 and os.pread(fd, 1, size - 1) != b"\n"

    @staticmethod
    def _append(fd: int, size: int, data: bytes) -> None:
        """Append ``data`` whole, or nothing: a write that fails part-way (a full disk) is undone.

        Written straight to the file (no buffer that would hold a record's unwritten rest and
        write it later, after other writers' records).
        """
        view = memoryview(data)
        try:
            while view:
                n = os.write(fd, view)
                view = view[n:]
        except OSError:
            try:
                os.ftruncate(fd, size)  # (under the file lock: nobody else wrote meanwhile)
            except OSError:
                pass
            raise

    @staticmethod
    def _row(m: Measurement) -> dict[str, object]:
        row: dict[str, object] = {
            "name": m.name,
            "host": m.host,
            "start_time": m.start_time,
            "elapsed_s": m.elapsed_s,
            "total_energy_j": m.total_energy_j,
            "uncertainty_j": m.uncertainty_j,
        }
        for prefix, zones in (("gpu", m.gpu), ("cpu", m.cpu), ("dram", m.dram)):
            for k, d in zones.items():
                row[f"{prefix}{k}_energy_j"] = d.energy_j
                row[f"{prefix}{k}_source"] = d.source.value + ("+corrected" if d.corrected else "")
        for x in m.missing:  # a device that could not be read at the window's end
            row[f"{x}_energy_j"] = ""
            row[f"{x}_source"] = "unread"
        return row

    def write(self, m: Measurement) -> None:
        """Append one measurement (a record is written whole or not at all).

        Raises:
            ValueError: A CSV file's header does not have this measurement's devices (nothing
                is written).
            OSError: The file cannot be written (nothing is written).
        """
        with self._lock:
            try:
                fd = self._open()
                with exclusive(fd):  # other processes' writers wait
                    size = os.fstat(fd).st_size
                    if size == 0:  # (emptied meanwhile, as logrotate's copytruncate does)
                        self._csv_columns = None
                    out = io.StringIO()
                    header = False
                    if self._ends_mid_line(fd, size):  # a cut-off line: ended first
                        out.write("\n")
                    if self.path.suffix == ".jsonl":
                        out.write(json.dumps(m.to_dict()) + "\n")
                    else:
                        row = self._row(m)
                        if self._csv_columns is None and size > 0:
                            self._csv_columns = self._existing_header()  # another writer's header
                        if self._csv_columns is not None and set(row) != set(self._csv_columns):
                            raise ValueError(self._mismatch(self._csv_columns, list(row)))
                        header = self._csv_columns is None
                        columns = list(row) if header else self._csv_columns
                        if header:
                            csv.writer(out).writerow(columns)
                        csv.DictWriter(out, columns).writerow(row)
                    self._append(fd, size, out.getvalue().encode())
                    if header:
                        self._csv_columns = columns
            finally:
                if self._closed:
                    self._close_fd()

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        """Close the file (idempotent); a later :meth:`write` still appends."""
        with self._lock:
            self._closed = True
            self._close_fd()
