"""Append every measurement window to a JSONL or CSV file."""

from __future__ import annotations

import csv
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from joules.devices.base import renew_locks_after_fork
from joules.filelock import exclusive
from joules.monitoring.measurement import Measurement


class WindowLog:
    """Appends measurements to ``path``; the format follows the suffix (``.jsonl`` or ``.csv``).

    Each line is flushed as it is written, so a killed job loses nothing already measured.
    A measurement written after :meth:`close` is appended too (the file is opened for it and
    closed again). Thread-safe. A file that ends in a cut-off line (a job killed while writing
    it) gets a newline before the first record, so that the broken line does not take that
    record with it.

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
        self._file: IO[str] | None = None
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
        self._file = None  # reopened on the next write; the parent's buffer stays the parent's

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

    def _open(self) -> IO[str]:
        if self._file is None:
            if self.path.suffix == ".csv":
                self._csv_columns = self._existing_header()
            self._file = self.path.open("a", newline="")
        return self._file

    def _ends_mid_line(self) -> bool:
        """Whether the file is not empty and its last byte is not a newline."""
        with self.path.open("rb") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"

    def _end_cut_line(self, f: IO[str]) -> None:
        """End a cut-off last line, so that the next record starts on a line of its own.

        Looked at just before each record, under the file lock: another writer may have ended
        it (or cut one off) since this one opened the file.
        """
        f.flush()
        if self._ends_mid_line():
            f.write("\n")

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
        """Append one measurement.

        Raises:
            ValueError: A CSV file's header does not have this measurement's devices (nothing
                is written).
        """
        with self._lock:
            f = self._open()
            try:
                if self.path.suffix == ".jsonl":
                    with exclusive(f):
                        self._end_cut_line(f)
                        f.write(json.dumps(m.to_dict()) + "\n")
                        f.flush()
                else:
                    row = self._row(m)
                    with exclusive(f):  # other processes' writers wait
                        if self._csv_columns is None and os.fstat(f.fileno()).st_size > 0:
                            self._csv_columns = self._existing_header()  # another writer's header
                        if self._csv_columns is not None and set(row) != set(self._csv_columns):
                            raise ValueError(self._mismatch(self._csv_columns, list(row)))
                        self._end_cut_line(f)
                        if self._csv_columns is None:
                            self._csv_columns = list(row)
                            csv.writer(f).writerow(self._csv_columns)
                        csv.DictWriter(f, self._csv_columns).writerow(row)
                        f.flush()  # before the file lock is let go
            finally:
                if self._closed:
                    f.close()
                    self._file = None

    def close(self) -> None:
        """Close the file (idempotent); a later :meth:`write` still appends."""
        with self._lock:
            self._closed = True
            if self._file is not None:
                self._file.close()
                self._file = None
