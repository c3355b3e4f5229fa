"""`tune serve --record-traffic DIR`: one line per finished request, never any text, never in the way.

Each finished request becomes a `RecordedRequest` line (slotune/tuner/spec/traces.py owns the format: arrival and
finish in unix seconds, prompt / requested / produced tokens, finish reason, chat or not, prefix-cache
hits, and keyed hashes of the prompt's full blocks, so a replay can rebuild the same prefix sharing
without the recording holding a single token of text). The HTTP loop only appends a small tuple to
a bounded queue; hashing, JSON and file writes happen on the recorder's own thread. When the queue
is full (the disk stalls) the record is dropped and counted, never waited for: serving comes first.

Files: DIR/traffic-<UTC start>-<pid>.jsonl, a new one past `max_file_mib` or `max_file_age_s`;
whenever one starts, the oldest are deleted while the others hold more than `max_total_mib` (so
the folder stays under max_total_mib + max_file_mib). The hash key comes
from SLOTUNE_TRAFFIC_KEY (hex; give every replica of a deployment the same one, so their hashes
agree), else from DIR/.traffic-key, made once with 32 random bytes (mode 0600) and reused on restart.
"""

from __future__ import annotations

import os
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from slotune.tuner.spec.traces import RecordedRequest, block_hash_ids

KEY_ENV = "SLOTUNE_TRAFFIC_KEY"
KEY_FILE = ".traffic-key"
_STOP = object()


@dataclass(slots=True)
class _Item:
    arrival: float  # unix seconds
    finish: float
    prompt_token_ids: list[int]
    max_tokens: int | None
    output_tokens: int
    finish_reason: str
    chat: bool
    cached_tokens: int


class TrafficRecorder:
    """Writes what `tune serve` served into rotated JSONL files, on a thread of its own.

    Args:
        directory: created if missing; every replica should have its own.
        block_size: prompt tokens per hash id (64: short shared system prompts still show).
        max_file_mib, max_file_age_s: when to start a new file.
        max_total_mib: the folder's bound; the oldest files go first.
        queue_size: records waiting for the writer; beyond it records are dropped and counted.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        block_size: int = 64,
        max_file_mib: float = 16,
        max_file_age_s: float = 3600,
        max_total_mib: float = 256,
        queue_size: int = 10_000,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.block_size = block_size
        self.max_file_bytes = int(max_file_mib * 2**20)
        self.max_file_age_s = max_file_age_s
        self.max_total_bytes = int(max_total_mib * 2**20)
        self.key = self._key()
        self.num_recorded = 0
        self.num_dropped = 0
        self.num_errors = 0  # records lost to a write error (disk full, folder removed)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._file = None
        self._file_opened = 0.0
        self._is_closed = False
        self._thread = threading.Thread(target=self._run, name="slotune-traffic-recorder", daemon=True)
        self._thread.start()

    def _key(self) -> bytes:
        env = os.environ.get(KEY_ENV)
        if env:
            try:
                key = bytes.fromhex(env)
            except ValueError:
                raise ValueError(f"{KEY_ENV}: expected hex, e.g. `openssl rand -hex 32`") from None
            if not 1 <= len(key) <= 64:
                raise ValueError(f"{KEY_ENV}: 1 to 64 bytes, got {len(key)}")
            return key
        path = self.directory / KEY_FILE
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
        return path.read_bytes()

    # --- the HTTP loop's side: O(1), never blocks ---------------------------------------------
    def record(self, out, *, chat: bool, max_tokens: int | None) -> bool:
        """Queue one finished `RequestOutput`; False if it was dropped (queue full or closed)."""
        if self._is_closed:
            self.num_dropped += 1
            return False
        m = out.metrics
        now_unix, now = time.time(), time.perf_counter()
        finish = m.finish_time if m.finish_time is not None else now
        item = _Item(
            arrival=now_unix - (now - m.arrival_time),
            finish=now_unix - (now - finish),
            prompt_token_ids=out.prompt_token_ids,
            max_tokens=max_tokens,
            output_tokens=len(out.output_token_ids),
            finish_reason=out.finish_reason or "abort",
            chat=chat,
            cached_tokens=m.num_cached_prompt_tokens,
        )
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.num_dropped += 1
            return False
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (for up to timeout_s), then close the file; later records are dropped."""
        self._is_closed = True
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)

    # --- the writer thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            try:
                self._write(self._line(item))
                self.num_recorded += 1
            except (OSError, ValueError):
                self.num_errors += 1
                self._close_file()
        self._close_file()

    def _line(self, it: _Item) -> bytes:
        ids = it.prompt_token_ids
        rec = RecordedRequest(
            arrival=it.arrival,
            finish=max(it.finish, it.arrival),
            prompt_tokens=len(ids),
            max_tokens=it.max_tokens,
            output_tokens=it.output_tokens,
            finish_reason=it.finish_reason,
            chat=it.chat,
            cached_tokens=min(it.cached_tokens, len(ids)),
            block_size=self.block_size,
            hash_ids=block_hash_ids(ids, self.block_size, key=self.key),
        )
        return rec.model_dump_json(exclude_none=True).encode() + b"\n"

    def _write(self, line: bytes) -> None:
        now = time.time()
        if self._file is not None and (
            self._file.tell() + len(line) > self.max_file_bytes or now - self._file_opened > self.max_file_age_s
        ):
            self._close_file()
        if self._file is None:
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
            self._file = open(self.directory / f"traffic-{stamp}-{os.getpid()}.jsonl", "ab")
            self._file_opened = now
            self._prune()
        self._file.write(line)
        self._file.flush()  # a line is whole on disk before the next one starts (readers skip a torn tail)

    def _close_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None

    def _prune(self) -> None:
        """Delete the oldest files (never the open one) while the folder exceeds its bound."""
        files = sorted(self.directory.glob("traffic-*.jsonl"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        current = Path(self._file.name) if self._file is not None else None
        for p in files:
            if total <= self.max_total_bytes:
                break
            if p == current:
                continue
            total -= p.stat().st_size
            p.unlink(missing_ok=True)
