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
        error: The file is not UTF-8 text (the message names the file and the byte), is not
            CSV as the reader takes it (a field over the size limit, say), or names a column
            twice in its header.
    """
    # utf-8-sig: spreadsheets save "CSV UTF-8" with a byte-order mark.
    with path.open(newline="", encoding="utf-8-sig") as f:
        rows = csv.reader(f)
        reader = csv.DictReader(f)
        reader.reader = rows  # one reader of the file's lines: line numbers count from its start
        try:
            # Blank lines before the header are skipped, as are those after it.
            reader.fieldnames = next((row for row in rows if row), None)
            names = [n.strip() for n in reader.fieldnames or []]  # " time" is "time" to a reader
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise error(f"{path}: the header names {', '.join(map(repr, twice))} more than once")
            yield reader
        except UnicodeDecodeError as e:
            raise error(f"{path}: not a UTF-8 text file ({e.reason} at byte {e.start})") from None
        except csv.Error as e:
            raise error(f"{path}, line {reader.line_num + 1}: {e}") from None  # the line being read
