"""Append every measurement window to a JSONL or CSV file."""

from __future__ import annotations

import csv
import json
import threading
from pathlib import Path
from typing import IO

from joules.monitoring.measurement import Measurement


class WindowLog:
    """Appends measurements to ``path``; the format follows the suffix (``.jsonl`` or ``.csv``).

    Each line is flushed as it is written, so a killed job loses nothing already measured.
    Thread-safe.

    Raises:
        ValueError: The suffix is neither ``.jsonl`` nor ``.csv``.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.suffix not in (".jsonl", ".csv"):
            raise ValueError(f"window log needs a .jsonl or .csv file name, got {self.path}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._csv_columns: list[str] | None = None

    def _open(self) -> IO[str]:
        if self._file is None:
            exists = self.path.exists() and self.path.stat().st_size > 0
            self._file = self.path.open("a", newline="")
            if exists and self.path.suffix == ".csv":
                with self.path.open(newline="") as f:
                    self._csv_columns = next(csv.reader(f), None)
        return self._file

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
        return row

    def write(self, m: Measurement) -> None:
        """Append one measurement."""
        with self._lock:
            f = self._open()
            if self.path.suffix == ".jsonl":
                f.write(json.dumps(m.to_dict()) + "\n")
            else:
                row = self._row(m)
                if self._csv_columns is None:
                    self._csv_columns = list(row)
                    csv.writer(f).writerow(self._csv_columns)
                csv.DictWriter(f, self._csv_columns, extrasaction="ignore").writerow(row)
            f.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
