"""Reading the CSV files users hand to the optimizers (power-limit and pipeline profiles)."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def csv_rows(path: Path, error: type[Exception]) -> Iterator[csv.DictReader[str]]:
    """A ``csv.DictReader`` of the UTF-8 file ``path`` (a byte-order mark is skipped).

    Raises:
        error: The file is not UTF-8 text (the message names the file and the byte).
    """
    # utf-8-sig: spreadsheets save "CSV UTF-8" with a byte-order mark.
    with path.open(newline="", encoding="utf-8-sig") as f:
        try:
            yield csv.DictReader(f)
        except UnicodeDecodeError as e:
            raise error(f"{path}: not a UTF-8 text file ({e.reason} at byte {e.start})") from None
