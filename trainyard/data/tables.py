"""Reading the user's table (CSV or Parquet) and writing the bundled default dataset.

Every problem is reported as one DataError naming the file, the column and the first
offending rows, numbered as the user sees them (CSV: line numbers, header = line 1;
Parquet: 1-based row numbers).
"""

from __future__ import annotations

import csv
import difflib
import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trainyard.errors import DataError
from trainyard.util.files import replacing

if TYPE_CHECKING:
    import pandas as pd  # imported where used: a worker reading split arrays never needs it

SHOWN = 5  # offending rows named in a message
# A numeric label column with fractional values is refused as a regression target when it
# has more than CONTINUOUS_DISTINCT distinct values and they number more than
# CONTINUOUS_SHARE of the rows. 20 is above the class count of most classification data
# sets; the share keeps a large table with a few fractional codes (grades 0.5 .. 5.0) usable.
CONTINUOUS_DISTINCT = 20
CONTINUOUS_SHARE = 0.05
# A CSV record longer than this is refused before any parser sees it: pandas and the csv
# module hold a whole record (a 400 MB line peaked at 2.7 GB). 8 MiB is a row of about
# 800,000 numeric fields; a longer one is a damaged file or a quote that never closes.
MAX_LINE_BYTES = 8 << 20
LINE_BLOCK = 1 << 20  # read at a time while measuring lines; at most MAX_LINE_BYTES


def read_table(path: Path, label_column: str, target: str = "class") -> pd.DataFrame:
    """Load a table of numeric feature columns plus one label column: class labels as text
    (`target="class"`), or numbers (`target="value"`, the regression task's target)."""
    import pandas as pd

    if not path.is_file():
        raise DataError(f"{path}: dataset file not found; set data.path in params.yaml")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty; expected a header and rows")
    parquet = path.suffix.lower() == ".parquet"
    sep = ","
    if not parquet:
        check_line_lengths(path)
        sep = _check_csv_header(path)
    try:
        if parquet:
            frame = pd.read_parquet(path)
        else:
            frame = pd.read_csv(path, sep=sep, dtype={label_column: str}, keep_default_na=True)
    except Exception as exc:  # pandas and pyarrow raise many types for unreadable files
        kind = "Parquet" if parquet else "CSV"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{path}: cannot read as {kind} ({reason})") from None
    duplicated = [str(c) for c, n in Counter(map(str, frame.columns)).items() if n > 1]
    if duplicated:
        raise DataError(f"{path}: column name {duplicated[0]!r} appears more than once; rename one")
    if frame.empty:
        raise DataError(f"{path}: has a header but no rows")
    if label_column not in frame.columns:
        close = difflib.get_close_matches(label_column, [str(c) for c in frame.columns], n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise DataError(
            f"{path}: no label column '{label_column}'{hint} "
            f"(columns: {_names(frame.columns)}); set data.label_column in params.yaml"
        )
    row_number = _row_numbering(parquet)
    missing_labels = frame.index[frame[label_column].isna()]
    if len(missing_labels):
        raise DataError(
            f"{path}: column '{label_column}' has empty labels at {_rows(missing_labels, row_number)}"
        )
    if target == "value":
        frame[label_column] = numeric_target(path, label_column, frame[label_column], row_number)
    else:
        frame[label_column] = class_labels(path, label_column, frame[label_column])
    _check_features(path, frame.drop(columns=[label_column]), row_number)
    return frame


def class_labels(path: Path, column: str, labels: pd.Series) -> pd.Series:
    """Labels as text, one spelling per class: when every label is a finite number, "1",
    "1.0" and "01" are one class, written "1" (fractional ones as Python writes the float).
    A column that looks continuous is refused."""
    texts = labels.astype(str)
    spelled = {text: _number(text) for text in texts.unique()}
    numbers = {text: number for text, number in spelled.items() if number is not None}
    if len(numbers) < len(spelled):
        return texts  # text classes stay as written
    if all(number.is_integer() and abs(number) < 2**53 for number in numbers.values()):
        canonical = {text: str(int(number)) for text, number in numbers.items()}
    else:
        canonical = {text: repr(number) for text, number in numbers.items()}
        _refuse_continuous(path, column, canonical, numbers, len(texts))
    return texts.map(canonical)


def numeric_target(path: Path, column: str, values: pd.Series, row_number) -> pd.Series:
    import pandas as pd

    numbers = pd.to_numeric(values, errors="coerce")
    bad = values.index[~np.isfinite(numbers.to_numpy(dtype="float64", na_value=np.nan))]
    if len(bad):
        raise DataError(
            f"{path}: the regression target '{column}' is not a finite number at "
            f"{_rows(bad, row_number)} (e.g. {values.loc[bad[0]]!r}); fix those rows"
        )
    return numbers.astype("float64")


def _number(text: str) -> float | None:
    try:
        number = float(text)
    except ValueError:
        return None
    return number if np.isfinite(number) else None


def _refuse_continuous(
    path: Path, column: str, canonical: dict[str, str], spelled: dict, rows: int
) -> None:
    distinct = len(set(canonical.values()))
    if distinct > CONTINUOUS_DISTINCT and distinct > CONTINUOUS_SHARE * rows:
        example = next(text for text, number in spelled.items() if not number.is_integer())
        raise DataError(
            f"{path}: label column '{column}' holds {distinct} distinct numbers in {rows} rows "
            f"(e.g. {example!r}); trainyard's classification task needs discrete class labels; "
            "this looks like a regression target: use -S task.name=regression, bin it into "
            "classes, or set data.label_column"
        )


def check_line_lengths(path: Path, limit: int = MAX_LINE_BYTES) -> None:
    """Refuse a CSV record longer than `limit` bytes, naming the line it starts on, reading
    a block at a time. A record ends at a line break outside double quotes (a quoted field
    may hold line breaks); a lone carriage return also ends one, as pandas reads it."""
    block_size = min(LINE_BLOCK, limit)  # then a record that starts and ends in one block fits
    lines, start_line, open_bytes, quoted = 0, 1, 0, False
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(block_size), b""):
            first, last, quoted = _record_ends(block, quoted)
            if open_bytes + (len(block) if first < 0 else first) > limit:
                size = f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit} bytes"
                raise DataError(
                    f"{path}: line {start_line} runs past {size} without a line "
                    "break (a damaged file, or a quote that never closes); fix that line"
                )
            if first < 0:
                open_bytes += len(block)
            else:
                start_line = lines + block.count(b"\n", 0, last + 1) + 1
                open_bytes = len(block) - last - 1
            lines += block.count(b"\n")


def _record_ends(block: bytes, quoted: bool) -> tuple[int, int, bool]:
    """(first, last) offsets in `block` of a line break that ends a record (-1, -1 if none),
    and whether the block ends inside quotes. Each end is found from its side of the block
    with a few C-speed finds and counts; a block whose breaks are mostly inside quotes
    falls back to numpy, so a long quoted field costs no Python loop per line."""
    after = quoted ^ bool(block.count(b'"') % 2)
    first = _first_end(block, quoted)
    last = _last_end(block, after) if first != -1 else -1
    if first is None or last is None:
        return _record_ends_numpy(block, quoted)
    return first, last, after


def _first_end(block: bytes, quoted: bool, tries: int = 32) -> int | None:
    start = 0
    for _ in range(tries):
        found = [i for i in (block.find(b"\n", start), block.find(b"\r", start)) if i >= 0]
        if not found:
            return -1
        end = min(found)
        quoted ^= bool(block.count(b'"', start, end) % 2)
        if not quoted:
            return end
        start = end + 1
    return None  # undecided: let numpy look


def _last_end(block: bytes, after: bool, tries: int = 32) -> int | None:
    stop = len(block)
    for _ in range(tries):
        end = max(block.rfind(b"\n", 0, stop), block.rfind(b"\r", 0, stop))
        if end < 0:
            return -1
        after ^= bool(block.count(b'"', end + 1, stop) % 2)  # the state at that break
        if not after:
            return end
        stop = end
    return None


def _record_ends_numpy(block: bytes, quoted: bool) -> tuple[int, int, bool]:
    data = np.frombuffer(block, dtype=np.uint8)
    inside = np.logical_xor.accumulate(data == ord('"'))
    if quoted:
        inside = ~inside
    breaks = (data == ord("\n")) | (data == ord("\r"))
    ends = np.flatnonzero(breaks & ~inside)
    if not len(ends):
        return -1, -1, bool(inside[-1])
    return int(ends[0]), int(ends[-1]), bool(inside[-1])


# A comma, or where a comma finds one column only, the one of these that finds the most:
# spreadsheets write `;` where the comma is the decimal mark, and tab-separated files abound.
OTHER_SEPARATORS = (";", "\t", "|")


def csv_separator(header_line: str) -> str:
    """The separator the header line is written with: ',' unless a comma leaves it one
    column and another separator finds more (a table needs a label and a feature)."""
    fields = {
        sep: len(next(csv.reader([header_line], delimiter=sep), []))
        for sep in (",", *OTHER_SEPARATORS)
    }
    if fields[","] > 1:
        return ","
    best = max(OTHER_SEPARATORS, key=fields.__getitem__)
    return best if fields[best] > 1 else ","


def _check_csv_header(path: Path) -> str:
    """The file's separator (csv_separator), and its header checked: pandas silently renames
    duplicated headers (x, x.1); a user should hear about it."""
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            sep = csv_separator(handle.readline())
            handle.seek(0)
            header = next(csv.reader(handle, delimiter=sep), [])
    except UnicodeDecodeError:
        raise DataError(f"{path}: cannot read as CSV (not UTF-8 text)") from None
    except csv.Error as exc:
        raise DataError(f"{path}: cannot read as CSV ({exc})") from None
    counts = Counter(header)
    for name, count in counts.items():
        if count > 1:
            columns = [i + 1 for i, h in enumerate(header) if h == name]
            raise DataError(
                f"{path}: column name {name!r} appears {count} times (columns {', '.join(map(str, columns))}); "
                "rename them so each is unique"
            )
    return sep


def _check_features(path: Path, features: pd.DataFrame, row_number) -> None:
    import pandas as pd

    if features.shape[1] == 0:
        raise DataError(f"{path}: no feature columns besides the label")
    for column in features.columns:
        values = features[column]
        if not pd.api.types.is_numeric_dtype(values) or pd.api.types.is_bool_dtype(values):
            numeric = pd.to_numeric(values, errors="coerce")
            bad = values.index[numeric.isna() & values.notna()]
            examples = ", ".join(repr(v) for v in values.loc[bad[:2]])
            raise DataError(
                f"{path}: feature column '{column}' is not numeric ({examples} at {_rows(bad, row_number)}); "
                "features must be numbers"
            )
        finite = np.isfinite(values.to_numpy(dtype="float64"))
        if not finite.all():
            bad = values.index[~finite]
            raise DataError(
                f"{path}: feature column '{column}' has missing, NaN or infinite values at {_rows(bad, row_number)}"
            )


def _row_numbering(parquet: bool):
    # CSV: line 1 is the header, so data row i (0-based) is on line i + 2.
    return (lambda i: f"row {i + 1}") if parquet else (lambda i: f"line {i + 2}")


def where_in_file(path: Path, index) -> str:
    """Rows of a table read by `read_table`, named as the user sees them in the file."""
    return _rows(index, _row_numbering(path.suffix.lower() == ".parquet"))


def _rows(index, row_number) -> str:
    shown = ", ".join(row_number(int(i)) for i in index[:SHOWN])
    more = f" and {len(index) - SHOWN} more" if len(index) > SHOWN else ""
    return shown + more


def _names(columns) -> str:
    """Each name quoted: a name may hold a comma or a space, and the list stays readable."""
    names = [repr(str(c)) for c in columns]
    return ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")


def write_digits(path: Path) -> None:
    """scikit-learn's bundled handwritten digits (1,797 8x8 images) as a CSV, byte-stable."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    header = ",".join([f"pixel_{i}" for i in range(digits.data.shape[1])] + ["label"])
    table = np.column_stack([digits.data.astype(np.int64), digits.target.astype(np.int64)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # runs started at once both write
    np.savetxt(tmp, table, fmt="%d", delimiter=",", header=header, comments="")
    tmp.replace(path)


def write_diabetes(path: Path) -> None:
    """scikit-learn's bundled diabetes data (442 patients, 10 features, a numeric disease
    progression `target`), the bundled regression example, as a byte-stable CSV."""
    from sklearn.datasets import load_diabetes

    data = load_diabetes(scaled=False)
    header = ",".join([*data.feature_names, "target"])
    table = np.column_stack([data.data, data.target])
    with replacing(path) as tmp:
        np.savetxt(tmp, table, fmt="%.6g", delimiter=",", header=header, comments="")
