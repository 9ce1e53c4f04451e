"""The lengths to plan for, and the bucket edges over them (pure Python, no torch).

A bucket is the half-open range of padded lengths ``(previous edge, edge]``; its batch is
planned at its edge, the longest padded length it holds. The last edge is the longest
(padded) length of the data, never less, so every sample has a bucket. With
``pad_to_multiple_of=m`` every length is rounded up to a multiple of ``m`` first (as a collator
with ``pad_to_multiple_of`` pads it) and so is every edge.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence, Union

from dptune.errors import UsageError

__all__ = ["check_lengths", "read_lengths", "padded", "bucket_edges", "bucket_index",
           "assign", "Buckets"]

#: ``buckets=``: a count (quantile edges) or the explicit edges
Buckets = Union[int, Sequence[int], str]


def padded(length: int, multiple: Optional[int]) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (``None`` or 1: as it is)."""
    if not multiple or multiple == 1:
        return length
    return -(-length // multiple) * multiple


def check_lengths(lengths: Iterable[Any]) -> list[int]:
    """The lengths as a list of ints >= 1 (a ``datasets`` column, a numpy array, a pandas
    Series or any iterable of ints); :class:`UsageError` on an empty, negative or
    non-integer one."""
    out: list[int] = []
    for k, x in enumerate(lengths):
        if isinstance(x, bool):
            raise UsageError(f"lengths[{k}] is {x!r}; give one integer length per sample")
        try:
            v = int(x)
        except (TypeError, ValueError):
            raise UsageError(f"lengths[{k}] is {x!r}, not an integer; give one integer length "
                             "per sample") from None
        if v != x:
            raise UsageError(f"lengths[{k}] is {x!r}, not an integer; give one integer length "
                             "per sample")
        if v < 1:
            raise UsageError(f"lengths[{k}] is {v}; lengths must be >= 1 (drop empty samples "
                             "from the data first)")
        out.append(v)
    if not out:
        raise UsageError("the lengths are empty: give one length per training sample")
    return out


def read_lengths(path: str, column: Optional[str] = None) -> list[int]:
    """Lengths from a file: one integer per line (``.txt`` or anything else), or a column of
    a CSV or Parquet file read with pandas (``column``, or the only column)."""
    import os

    if not os.path.isfile(path):
        raise UsageError(f"--lengths {path}: no such file (give one integer per line, or a "
                         "CSV/Parquet file with a length column)")
    lower = path.lower()
    if lower.endswith((".csv", ".parquet", ".pq")):
        import pandas as pd

        try:
            df = pd.read_parquet(path) if not lower.endswith(".csv") else pd.read_csv(path)
        except Exception as e:
            raise UsageError(f"--lengths {path}: cannot be read ({type(e).__name__}: {e})") from None
        if column is None:
            if len(df.columns) != 1:
                raise UsageError(f"--lengths {path} has columns {list(df.columns)}; name the "
                                 "length column as FILE:COLUMN")
            column = str(df.columns[0])
        if column not in df.columns:
            raise UsageError(f"--lengths {path} has no column {column!r} "
                             f"(columns: {list(df.columns)})")
        return check_lengths(df[column].tolist())
    try:
        with open(path, encoding="utf-8") as f:
            rows = [line.strip() for line in f if line.strip()]
    except UnicodeDecodeError:
        raise UsageError(f"--lengths {path} is not a text file (a binary file?): give one "
                         "integer length per line, or a CSV/Parquet file as FILE.csv:COLUMN"
                         ) from None
    except OSError as e:
        raise UsageError(f"--lengths {path}: cannot be read ({e.strerror or e})") from None
    values: list[Any] = []
    for k, row in enumerate(rows):
        try:
            values.append(int(row))
        except ValueError:
            raise UsageError(f"--lengths {path}, line {k + 1}: {row!r} is not an integer "
                             "(give one integer length per line)") from None
    return check_lengths(values)


def _parse(buckets: Buckets) -> Union[int, list[int]]:
    if isinstance(buckets, str):
        parts = [p.strip() for p in buckets.split(",") if p.strip()]
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            raise UsageError(f"--buckets {buckets!r}: give a count (8) or the edges "
                             "(128,256,512)") from None
        return nums[0] if len(nums) == 1 and "," not in buckets else nums
    if isinstance(buckets, bool):
        raise UsageError(f"buckets must be a count or a list of edges, got {buckets!r}")
    if isinstance(buckets, int):
        return buckets
    return [int(e) for e in buckets]


def bucket_edges(lengths: Sequence[int], buckets: Buckets = 8, *,
                 pad_to_multiple_of: Optional[int] = None,
                 max_length: Optional[int] = None) -> list[int]:
    """Bucket edges, increasing; the last one the longest padded length.

    ``buckets``: a count ``k`` (edges at the ``1/k, 2/k, ...`` quantiles of the padded
    lengths, nearest rank; equal edges merged) or the explicit edges (those at or beyond the
    longest length are replaced by it). Empty buckets are dropped. ``max_length``: the
    model's maximum positions; an edge beyond it is a :class:`UsageError`.
    """
    if pad_to_multiple_of is not None and (isinstance(pad_to_multiple_of, bool)
                                           or not isinstance(pad_to_multiple_of, int)
                                           or pad_to_multiple_of < 1):
        raise UsageError(f"pad_to_multiple_of must be an int >= 1, got {pad_to_multiple_of!r}")
    lens = sorted(padded(x, pad_to_multiple_of) for x in check_lengths(lengths))
    longest = lens[-1]
    spec = _parse(buckets)
    if isinstance(spec, int):
        if spec < 1:
            raise UsageError(f"buckets={spec}: give at least 1 bucket")
        n = len(lens)
        raw = [lens[max(0, math.ceil(j * n / spec) - 1)] for j in range(1, spec + 1)]
    else:
        if not spec or any(e < 1 for e in spec) or any(b <= a for a, b in zip(spec, spec[1:])):
            raise UsageError(f"bucket edges {spec} must be increasing integers >= 1")
        raw = [padded(e, pad_to_multiple_of) for e in spec if e < longest]
    edges = sorted(set(raw + [longest]) - {e for e in raw if e > longest})
    counts = [0] * len(edges)
    for x in lens:
        counts[bucket_index(edges, x)] += 1
    edges = [e for e, c in zip(edges, counts) if c > 0]
    if max_length is not None and edges[-1] > max_length:
        raise UsageError(f"the longest (padded) length is {edges[-1]} but the model takes at most "
                         f"{max_length} positions: truncate the data to {max_length} "
                         "(or drop the longer samples) first")
    return edges


def bucket_index(edges: Sequence[int], length: int) -> int:
    """The bucket of a padded ``length``: the first edge ``>= length``."""
    import bisect

    k = bisect.bisect_left(edges, length)
    if k == len(edges):
        raise UsageError(f"length {length} is longer than the last bucket edge {edges[-1]}: "
                         "plan again with the data's lengths")
    return k


def assign(lengths: Sequence[int], edges: Sequence[int],
           pad_to_multiple_of: Optional[int] = None) -> list[int]:
    """The bucket of every sample (its index into ``edges``)."""
    return [bucket_index(edges, padded(x, pad_to_multiple_of)) for x in lengths]
