"""Vectorised parsing of numeric text tables (CSV and whitespace-separated) with line-accurate errors."""

from __future__ import annotations

import gzip
import re
import warnings
import zlib
from pathlib import Path

import numpy as np

from tessera.errors import DatasetError
from tessera.graph.formats._limits import format_bytes, memory_limit, require_memory

_CHUNK = 1 << 24
_PIECE = 1 << 22  # text parsed at a time by read_csv_gz: a few copies of it are transient
_COMMENT = re.compile(rb"(?m)^[ \t]*[#%][^\n]*")
_WS = np.zeros(256, dtype=bool)
_WS[[9, 10, 11, 12, 13, 32]] = True


def read_gzip(path: Path) -> bytes:
    """The decompressed bytes of a gzip file; DatasetError if it is missing, truncated or corrupt,
    or decompresses to more than a third of :func:`memory_limit` (checked while streaming, before
    it is held: joining the chunks and parsing the text need as much again)."""
    limit = memory_limit()
    chunks, size = [], 0
    try:
        with gzip.open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                chunks.append(chunk)
                size += len(chunk)
                if 3 * size > limit:
                    raise DatasetError(
                        f"{path} decompresses to more than {format_bytes(size)}; holding and parsing it would need "
                        f"more than the {format_bytes(limit)} this process can use"
                    )
    except FileNotFoundError as e:
        raise DatasetError(f"{path} not found") from e
    except (OSError, EOFError, zlib.error) as e:
        raise DatasetError(f"{path} is not a valid gzip file (truncated or corrupt: {e})") from e
    return b"".join(chunks)


def _token_ok(tok: bytes, dtype: np.dtype) -> bool:
    if b"_" in tok:  # Python accepts 1_000, numpy does not
        return False
    try:
        value = (int if dtype.kind in "iu" else float)(tok)
    except ValueError:
        return False
    # numpy saturates an integer beyond the dtype's range to its extreme value without a word.
    return dtype.kind not in "iu" or np.iinfo(dtype).min < value < np.iinfo(dtype).max


def _first_bad_token(text: bytes, dtype: np.dtype) -> tuple[int, bytes]:
    # Error path only: find the line number of the first token numpy refused.
    for lineno, line in enumerate(text.split(b"\n"), 1):
        for tok in line.replace(b",", b" ").split():
            if not _token_ok(tok, dtype):
                return lineno, tok
    return 0, b""


def parse_numbers(text: bytes, dtype: type | np.dtype, source: str, first_line: int = 1) -> np.ndarray:
    """Every whitespace-separated number in ``text`` as a flat array, or a DatasetError naming the
    line (``text`` starting at line ``first_line`` of ``source``) and token that is not a number of
    that kind."""
    dtype = np.dtype(dtype)
    try:
        with warnings.catch_warnings():
            # numpy < 2 only warns (DeprecationWarning) when it stops at an unparsable token.
            warnings.simplefilter("error", DeprecationWarning)
            values = np.fromstring(text, dtype=dtype, sep=" ")
        if dtype.kind in "iu" and values.size:
            info = np.iinfo(dtype)
            if int(values.max()) == info.max or int(values.min()) == info.min:
                raise ValueError("saturated")
        return values
    except (ValueError, DeprecationWarning):
        lineno, tok = _first_bad_token(text, dtype)
        kind = f"an integer within {dtype}'s range" if dtype.kind in "iu" else "a number"
        where = f", line {lineno + first_line - 1}" if lineno else ""
        raise DatasetError(f"{source}{where}: {tok.decode('latin1')!r} is not {kind}") from None


def parse_csv(
    raw: bytes,
    dtype: type | np.dtype,
    source: str,
    ncols: int | None = None,
    first_line: int = 1,
    whole: bool = True,
) -> np.ndarray:
    """A strict comma-separated numeric table (no header, no blank lines) as a ``(rows, ncols)``
    array; ``ncols`` defaults to the first line's column count. Errors name lines counting from
    ``first_line``; ``whole`` False: ``raw`` is a piece of lines from inside a file, whose
    trailing whitespace is a blank line, not the file's end."""
    end = len(raw)  # ignore trailing whitespace without copying a possibly huge buffer
    while whole and end and raw[end - 1] in b" \t\r\n":
        end -= 1
    if not end:
        if not whole:  # an empty line inside the file
            raise DatasetError(f"{source}, line {first_line}: expected {ncols} comma-separated columns, found 1")
        return np.zeros((0, ncols or 0), dtype=dtype)
    eol = raw.find(b"\n", 0, end)
    found = raw.count(b",", 0, end if eol < 0 else eol) + 1
    if ncols is None:
        ncols = found
    elif found != ncols:
        raise DatasetError(f"{source}, line {first_line}: expected {ncols} comma-separated columns, found {found}")
    nrows = raw.count(b"\n", 0, end) + 1
    # Cheap structural check before parsing: every line needs exactly ncols - 1 commas.
    if raw.count(b",", 0, end) != nrows * (ncols - 1):
        lengths = np.array([ln.count(b",") + 1 for ln in raw[:end].split(b"\n")])
        bad = int(np.flatnonzero(lengths != ncols)[0])
        raise DatasetError(
            f"{source}, line {bad + first_line}: expected {ncols} comma-separated columns, found {lengths[bad]}"
        )
    values = parse_numbers(raw.replace(b",", b" "), dtype, source, first_line)
    if values.size != nrows * ncols:
        raise DatasetError(
            f"{source}: found {values.size} values on {nrows} lines, expected {nrows} x {ncols} "
            "(empty fields or a truncated file)"
        )
    return values.reshape(nrows, ncols)


def _last_line_end(text: bytes) -> int:
    """The newline ending the last line of ``text`` with more than whitespace on it (-1: none):
    what follows it may be the file's trailing whitespace, which only the next piece can tell."""
    end = text.rfind(b"\n")
    while end >= 0:
        start = text.rfind(b"\n", 0, end) + 1
        if text[start:end].strip():
            return end
        end = start - 1
    return -1


class RowCountError(DatasetError):
    """A table with other than the rows its dataset declares (``found`` None: more than those)."""

    def __init__(self, path: Path, found: int | None, declared: int) -> None:
        super().__init__(f"{path} has {'more than ' + str(declared) if found is None else found} rows, not {declared}")
        self.found, self.declared = found, declared


def read_csv_gz(path: Path, dtype: type | np.dtype, ncols: int | None = None, rows: int | None = None) -> np.ndarray:
    """:func:`parse_csv` of a gzip file, decompressed and parsed a piece of whole lines at a time:
    what is held is the table (``rows`` of it allocated once when the caller knows them; else the
    pieces' tables, joined at the end) and one piece of text, never the whole text beside a
    converted copy. DatasetError as :func:`read_gzip` and :func:`parse_csv` give, and
    :class:`RowCountError` for other than ``rows`` rows."""
    dtype = np.dtype(dtype)
    parts: list[np.ndarray] = []
    out = None

    def allocate(width: int) -> np.ndarray:
        assert rows is not None
        require_memory(rows * width * dtype.itemsize, f"the {rows:,} x {width:,} table", str(path))
        return np.empty((rows, width), dtype=dtype)

    if rows is not None and ncols is not None:
        out = allocate(ncols)
    done = line = 0
    tail = b""

    def take(text: bytes, last: bool) -> None:
        nonlocal ncols, out, done, line
        if last and not text.strip():
            return
        table = parse_csv(text, dtype, str(path), ncols, line + 1, whole=last)
        ncols = table.shape[1]
        line += table.shape[0]
        if out is None and rows is not None:
            out = allocate(ncols)
        if out is None:
            parts.append(table)
        else:
            if done + table.shape[0] > out.shape[0]:
                raise RowCountError(path, None, out.shape[0])
            out[done : done + table.shape[0]] = table
        done += table.shape[0]

    limit, size = memory_limit(), 0

    def too_big() -> DatasetError:
        return DatasetError(
            f"{path} decompresses to more than {format_bytes(size)}; parsing it would need more than the "
            f"{format_bytes(limit)} this process can use"
        )

    try:
        with gzip.open(path, "rb") as f:
            while chunk := f.read(_PIECE):
                size += len(chunk)
                text = tail + chunk
                end = _last_line_end(text)
                tail = text[end + 1 :] if end >= 0 else text
                if 3 * len(tail) > limit:  # one line that never ends
                    raise too_big()
                if end >= 0:
                    take(text[:end], last=False)
                if out is None and 2 * sum(p.nbytes for p in parts) > limit:  # the pieces and their join
                    raise too_big()
    except FileNotFoundError as e:
        raise DatasetError(f"{path} not found") from e
    except (OSError, EOFError, zlib.error) as e:
        raise DatasetError(f"{path} is not a valid gzip file (truncated or corrupt: {e})") from e
    take(tail, last=True)
    if out is not None:
        if done != out.shape[0]:
            raise RowCountError(path, done, out.shape[0])
        return out
    if not parts:
        return np.zeros((0, ncols or 0), dtype=dtype)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def parse_columns(data: bytes, source: str, allowed: tuple[int, ...]) -> tuple[bytes, np.ndarray, int]:
    """Check a whitespace/comma separated table with ``#``/``%`` comment lines and blank lines.

    Returns the text with comments blanked and commas replaced (ready for :func:`parse_numbers`),
    the 1-based line number of each data row, and the column count shared by every row (0 when
    there are none); DatasetError naming the line where a row has another count."""
    text = _COMMENT.sub(b"", data).replace(b",", b" ")
    buf = np.frombuffer(text, dtype=np.uint8)
    ws = _WS[buf]
    starts = np.flatnonzero(~ws & np.concatenate(([True], ws[:-1])))
    newlines = np.flatnonzero(buf == 10)
    per_line = np.bincount(np.searchsorted(newlines, starts), minlength=newlines.size + 1)
    rows = np.flatnonzero(per_line)
    if rows.size == 0:
        return text, rows + 1, 0
    ncols = int(per_line[rows[0]])
    if ncols not in allowed:
        want = " or ".join(map(str, allowed))
        raise DatasetError(f"{source}, line {rows[0] + 1}: expected {want} columns, found {ncols}")
    bad = rows[per_line[rows] != ncols]
    if bad.size:
        raise DatasetError(
            f"{source}, line {bad[0] + 1}: found {per_line[bad[0]]} columns but line {rows[0] + 1} has {ncols}"
        )
    return text, rows + 1, ncols
