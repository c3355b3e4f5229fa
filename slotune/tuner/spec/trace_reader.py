"""Read a trace file (recorded, Mooncake, Azure, BurstGPT) into a `Trace`, with errors naming file, line and column."""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

from pydantic import ValidationError
from slotune.tuner.spec.traces import (
    MAX_TOKENS_PER_REQUEST,
    MOONCAKE_BLOCK_SIZE,
    RecordedRequest,
    Trace,
    TraceFormat,
    TraceRequest,
    TraceSource,
)
from slotune.tuner.spec.yaml_reader import MissingFileError, SpecError


def load_trace(source: TraceSource | str | Path, **options) -> Trace:
    """Read a trace file (or a directory of recorded files) into TraceRequests.

    Args:
        source: a TraceSource, or a path with TraceSource's fields as keyword options
            (format, block_size, time_scale, window, max_requests).
    Returns:
        The requests in arrival order, windowed, capped, re-based to start at 0 and scaled.
        Raises MissingFileError, or SpecError naming the file, line and column.
    """
    if not isinstance(source, TraceSource):
        try:
            source = TraceSource(path=str(source), **options)
        except ValidationError as exc:
            raise SpecError.from_validation(exc, str(source)) from None
    elif options:
        raise TypeError("pass options inside the TraceSource, not beside it")
    path = Path(source.path).expanduser()
    if not path.exists():
        raise MissingFileError("trace not found", source=path)
    fmt = source.format or detect_format(path)
    if path.is_dir() and fmt != "recorded":
        raise SpecError(f"a directory loads as a recording (*.jsonl files), not as {fmt}", source=path)
    if source.block_size is not None and fmt != "mooncake":
        raise SpecError(
            f"block_size applies to mooncake traces only; this trace is {fmt}, which "
            f"{'says its own' if fmt == 'recorded' else 'has no hash ids'}",
            source=path,
            field="block_size",
        )
    block_size = (source.block_size or MOONCAKE_BLOCK_SIZE) if fmt == "mooncake" else None
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise SpecError("no *.jsonl files in this directory", source=path)
    rows: list[_Row] = []
    for f in files:
        rows.extend(_READERS[fmt](f, block_size))
    if not rows:
        raise SpecError("the trace has no requests", source=path)
    if fmt == "recorded":
        block_size = _one_block_size(rows, path)
    requests = _select(rows, source)
    if not requests:
        raise SpecError(f"no request arrives inside window {list(source.window or ())}", source=path, field="window")
    has_ids = any(r.hash_ids is not None for r in requests)
    return Trace(requests, str(path), fmt, block_size if has_ids else None)


def detect_format(path: str | Path) -> TraceFormat:
    """The format of a trace file from its first line (a directory is a recording).

    Raises SpecError when the first line matches no format.
    """
    path = Path(path)
    if path.is_dir():
        return "recorded"
    first, num = "", 0
    with _open(path) as f:
        try:
            for num, line in enumerate(f, 1):
                if line.strip():
                    first = line.strip()
                    break
        except UnicodeDecodeError as exc:
            raise SpecError(f"not UTF-8 text ({exc.reason}); is this a binary file?", source=path) from None
    if not first:
        raise SpecError("the trace is empty", source=path)
    if first.startswith("{"):
        try:
            keys = set(json.loads(first))
        except ValueError as exc:
            raise SpecError(f"not a JSON object: {exc}", source=path, line=num) from None
        if {"input_length", "timestamp"} <= keys:
            return "mooncake"
        if {"arrival", "prompt_tokens"} <= keys:
            return "recorded"
        hint = (
            " (prompt_len/output_len lines without times are a workload's `trace:` lengths file)"
            if "output_len" in keys
            else ""
        )
        raise SpecError(
            f"JSON lines with keys {sorted(keys)} match no trace format: recordings have arrival, "
            f"prompt_tokens, ...; Mooncake traces timestamp, input_length, ...{hint}",
            source=path,
            line=num,
        )
    header = {c.strip() for c in next(csv.reader([first]))}
    if "ContextTokens" in header:
        return "azure"
    if "Request tokens" in header:
        return "burstgpt"
    raise SpecError(
        f"CSV header {sorted(header)} matches no trace format: Azure traces have TIMESTAMP, "
        "ContextTokens, GeneratedTokens; BurstGPT traces Timestamp, Request tokens, Response tokens, ...",
        source=path,
        line=num,
    )


@dataclass(slots=True)
class _Row:
    """A request as read, before sorting and selection make it a TraceRequest (built once: frozen is slow)."""

    arrival: float  # seconds, on the file's own clock
    prompt_tokens: int
    output_tokens: int
    path: Path
    line: int
    hash_ids: tuple[int, ...] | None = None
    is_chat: bool | None = None
    finish_reason: str | None = None
    cached_tokens: int | None = None
    e2e_s: float | None = None
    block_size: int | None = None


def _open(path: Path):
    try:
        return path.open(encoding="utf-8-sig", newline="")  # -sig: a CSV may start with a BOM
    except OSError as exc:
        raise SpecError(f"cannot read: {exc.strerror or exc}", source=path) from None


def _json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    with _open(path) as f:
        try:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise SpecError(f"not JSON: {exc.msg}", source=path, line=i, column=exc.colno) from None
                if not isinstance(row, dict):
                    raise SpecError(f"each line must be a JSON object, got {type(row).__name__}", source=path, line=i)
                yield i, row
        except UnicodeDecodeError as exc:
            raise SpecError(f"not UTF-8 text ({exc.reason}); is this a binary file?", source=path) from None


def _read_recorded(path: Path, block_size: int | None) -> Iterator[_Row]:
    for i, raw in _json_lines(path):
        try:
            rec = RecordedRequest.model_validate(raw)
        except ValidationError as exc:
            err = SpecError.from_validation(exc, path)
            raise SpecError(problems=[replace(p, line=i) for p in err.problems]) from None
        yield _Row(
            rec.arrival,
            rec.prompt_tokens,
            rec.output_tokens,
            path,
            i,
            tuple(rec.hash_ids) if rec.hash_ids is not None else None,
            rec.chat,
            rec.finish_reason,
            rec.cached_tokens,
            None if rec.finish is None else rec.finish - rec.arrival,
            rec.block_size if rec.hash_ids is not None else None,
        )


def _read_mooncake(path: Path, block_size: int | None) -> Iterator[_Row]:
    assert block_size is not None
    for i, raw in _json_lines(path):
        missing = sorted({"timestamp", "input_length", "output_length"} - set(raw))
        if missing:
            raise SpecError(
                f"missing {', '.join(missing)} (a Mooncake line has timestamp, input_length, output_length, hash_ids)",
                source=path,
                line=i,
            )
        ts = _number(raw["timestamp"], path, i, "timestamp", minimum=0.0)
        prompt = _count(raw["input_length"], path, i, "input_length", minimum=1)
        output = _count(raw["output_length"], path, i, "output_length", minimum=0)
        ids = raw.get("hash_ids")
        if ids is not None:
            bad = (
                next((h for h in ids if isinstance(h, bool) or not isinstance(h, int) or h < 0), None)
                if isinstance(ids, list)
                else ids
            )
            if bad is not None:
                raise SpecError(
                    f"must be a list of non-negative whole numbers, got {bad!r}", source=path, line=i, field="hash_ids"
                )
            num_blocks = math.ceil(prompt / block_size)  # Mooncake gives the last, partial block an id too
            if len(ids) > num_blocks:
                raise SpecError(
                    f"{len(ids)} ids, but input_length {prompt} fills at most {num_blocks} blocks "
                    f"of {block_size} tokens; is block_size right?",
                    source=path,
                    line=i,
                    field="hash_ids",
                )
        yield _Row(ts / 1000.0, prompt, output, path, i, None if ids is None else tuple(ids))


class _CsvRow:
    """One data row of a CSV trace, read by column name; problems name the file, line and column."""

    __slots__ = ("path", "line", "cells", "index")

    def __init__(self, path: Path, line: int, cells: list[str], index: dict[str, int]) -> None:
        self.path, self.line, self.cells, self.index = path, line, cells, index

    def text(self, name: str) -> str:
        return self.cells[self.index[name]].strip()

    def count(self, name: str, *, minimum: int) -> int:
        text = self.cells[self.index[name]]
        try:
            v = int(text)
        except ValueError:
            v = _float(text.strip())  # "472.0" is a count too
        return _count(v, self.path, self.line, name, minimum=minimum, column=self.index[name] + 1)

    def error(self, name: str, message: str) -> SpecError:
        return SpecError(message, source=self.path, line=self.line, column=self.index[name] + 1, field=name)


def _csv_rows(path: Path, required: tuple[str, ...], what: str) -> Iterator[_CsvRow]:
    with _open(path) as f:
        reader = csv.reader(f)
        try:
            header = [h.strip() for h in next(reader, [])]
            missing = [c for c in required if c not in header]
            if missing:
                raise SpecError(
                    f"missing column(s) {', '.join(missing)}; a {what} CSV has {', '.join(required)} "
                    f"(found: {', '.join(header) or 'nothing'})",
                    source=path,
                    line=1,
                )
            index = {h: k for k, h in enumerate(header)}
            for row in reader:
                if len(row) != len(header):
                    if not any(cell.strip() for cell in row):
                        continue
                    raise SpecError(
                        f"{len(row)} values, but the header names {len(header)} columns",
                        source=path,
                        line=reader.line_num,
                    )
                yield _CsvRow(path, reader.line_num, row, index)
        except csv.Error as exc:
            raise SpecError(f"malformed CSV: {exc}", source=path, line=reader.line_num) from None
        except UnicodeDecodeError as exc:
            raise SpecError(f"not UTF-8 text ({exc.reason}); is this a binary file?", source=path) from None


def _read_azure(path: Path, block_size: int | None) -> Iterator[_Row]:
    for row in _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"), "Azure trace"):
        text = row.text("TIMESTAMP")
        t = _datetime_s(text)
        if t is None:
            raise row.error("TIMESTAMP", f"{text!r} is not a date and time like 2023-11-16 18:15:46.6805900")
        yield _Row(t, row.count("ContextTokens", minimum=1), row.count("GeneratedTokens", minimum=0), path, row.line)


def _read_burstgpt(path: Path, block_size: int | None) -> Iterator[_Row]:
    cols = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
    for row in _csv_rows(path, cols, "BurstGPT"):
        t = _number(
            _float(row.text("Timestamp")), path, row.line, "Timestamp", minimum=0.0, column=row.index["Timestamp"] + 1
        )
        log_type = row.text("Log Type")
        if log_type not in ("Conversation log", "API log"):
            raise row.error("Log Type", f"must be 'Conversation log' or 'API log', got {log_type!r}")
        yield _Row(
            t,
            row.count("Request tokens", minimum=1),
            row.count("Response tokens", minimum=0),
            path,
            row.line,
            is_chat=log_type == "Conversation log",
        )


_READERS = {"recorded": _read_recorded, "mooncake": _read_mooncake, "azure": _read_azure, "burstgpt": _read_burstgpt}


def _float(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def _number(v, path: Path, line: int, field: str, *, minimum: float, column: int | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < minimum:
        raise SpecError(
            f"must be a number >= {minimum:g}, got {v!r}", source=path, line=line, column=column, field=field
        )
    return float(v)


def _count(v, path: Path, line: int, field: str, *, minimum: int, column: int | None = None) -> int:
    if type(v) is int and minimum <= v <= MAX_TOKENS_PER_REQUEST:
        return v
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= MAX_TOKENS_PER_REQUEST:
        raise SpecError(
            f"must be a whole number of tokens in {minimum}..{MAX_TOKENS_PER_REQUEST}, got {v!r}",
            source=path,
            line=line,
            column=column,
            field=field,
        )
    return v


_DATETIME = re.compile(r"(\d{4}-\d\d-\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d+))?\s*(Z|[+-]\d\d:?\d\d)?")


def _datetime_s(text: str) -> float | None:
    """Seconds since the epoch of `YYYY-MM-DD HH:MM:SS.fffffff`, the Azure trace's timestamps (any number
    of fraction digits, optional zone; none means UTC)."""
    m = _DATETIME.fullmatch(text)
    if m is None:
        return None
    day, hh, mm, ss, frac, zone = m.groups()
    try:
        t = datetime.fromisoformat(f"{day} {hh}:{mm}:{ss}").replace(tzinfo=timezone.utc)
    except ValueError:
        return None
    if zone and zone != "Z":
        sign = 1 if zone[0] == "+" else -1
        t -= sign * timedelta(hours=int(zone[1:3]), minutes=int(zone[-2:]))
    return t.timestamp() + (float("0." + frac) if frac else 0.0)


def _one_block_size(rows: list[_Row], path: Path) -> int | None:
    sizes = {r.block_size for r in rows} - {None}
    if len(sizes) > 1:
        first = next(r for r in rows if r.block_size is not None)
        other = next(r for r in rows if r.block_size not in (None, first.block_size))
        raise SpecError(
            f"block_size {other.block_size} differs from {first.block_size} ({first.path}, line "
            f"{first.line}): one recording, one block size",
            source=other.path,
            line=other.line,
            field="block_size",
        )
    return sizes.pop() if sizes else None


def _select(rows: list[_Row], source: TraceSource) -> list[TraceRequest]:
    rows = sorted(rows, key=lambda r: r.arrival)  # stable: equal arrivals keep file order
    t0 = rows[0].arrival
    if source.window is not None:
        start, end = source.window
        rows = [r for r in rows if start <= r.arrival - t0 < end]
    if source.max_requests is not None:
        rows = rows[: source.max_requests]
    if not rows:
        return []
    first, scale = rows[0].arrival, source.time_scale
    return [
        TraceRequest(
            (r.arrival - first) * scale,
            r.prompt_tokens,
            r.output_tokens,
            r.hash_ids,
            r.is_chat,
            r.finish_reason,
            r.cached_tokens,
            r.e2e_s,
        )
        for r in rows
    ]
