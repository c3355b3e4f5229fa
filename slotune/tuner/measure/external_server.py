"""An external engine's server for one trial (a `TrialServer`, slotune/tuner/measure/server.py).

Launched from its engine file (slotune/tuner/spec/engines.py) on a free loopback port, in its own process
group and tied to the trial process (slotune/tuner/measure/tied.py: SIGKILL when the trial process dies,
however it dies);
ready once it is alive, its health path answers 200 and one real completion succeeds, within
`ready_timeout_s`; `check` notices that it died mid-replay; teardown sends SIGTERM to the whole
group, then SIGKILL, and returns only once the server is gone. Every failure is a `ServerFailure`
whose reason comes from slotune/tuner/measure/failures.py. `window_metrics` holds what the engine file
names under `settings` (as the server resolved them) and `counters` (their rise over the measured
requests), as `server_<name>`; the bundled engine's counters are not among them (not measured, never 0).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from slotune.tuner.measure import failures
from slotune.tuner.spec.engines import EngineDescription, Recorded, Value


class ServerFailure(RuntimeError):
    """The server could not be started or died; `reason` is the trial's failure reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ExternalServer:
    def __init__(
        self,
        engine: EngineDescription,
        values: dict[str, Value],
        *,
        binary: str,
        model: str,
        tokenizer: Any,
        log_path: Path,
        ready_timeout_s: float = 300.0,
        stop_grace_s: float = 10.0,
    ) -> None:
        self.engine, self.values, self.binary, self.model = engine, values, binary, model
        self.tokenizer, self.log_path = tokenizer, Path(log_path)
        self.ready_timeout_s, self.stop_grace_s = ready_timeout_s, stop_grace_s
        self.url, self.argv, self.load_time_s = "", [], 0.0
        self.model_id: str | None = None  # as the server names its model (GET /v1/models)
        self.proc: subprocess.Popen | None = None
        self._ended: str | None = None  # once stopped: why it had ended on its own, or "" (we stopped it)
        self._counters_at_start: dict[str, float] = {}

    def __enter__(self) -> ExternalServer:
        port = _free_port()
        self.argv = self.engine.argv(self.values, binary=self.binary, model=self.model, port=port)
        self.url = f"http://127.0.0.1:{port}"
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "slotune.tuner.measure.tied", str(os.getpid()), *self.argv],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: teardown reaches whatever it starts
            )
        try:
            self._wait_ready(t0 + self.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.load_time_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self, deadline: float) -> None:
        while not self._get_ok(self.engine.ready_path):
            self._raise_if_ended(serving=False)
            if time.perf_counter() > deadline:
                raise ServerFailure(failures.not_ready(self.ready_timeout_s))
            time.sleep(0.2)
        self.model_id = self._model_id()
        body = {
            "prompt": "Hello",
            "max_tokens": 1,
            "temperature": 0,
            **({"model": self.model_id} if self.model_id else {}),
        }
        try:
            self._post("/v1/completions", body, timeout=max(deadline - time.perf_counter(), 5.0))
        except (OSError, ValueError) as exc:
            self._raise_if_ended(serving=False)
            said = exc.read().decode(errors="replace")[:500] if isinstance(exc, urllib.error.HTTPError) else ""
            raise ServerFailure(f"failed to start: its first completion failed: {exc} {said}".strip()) from None

    def _model_id(self) -> str | None:
        """The first id of GET /v1/models (OpenAI's API requires one in each request; None: not listed)."""
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=10) as r:
                return str(json.loads(r.read())["data"][0]["id"])
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return None

    def _get_ok(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as r:
                return r.status == 200
        except (OSError, ValueError):
            return False

    def _post(self, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def _raise_if_ended(self, *, serving: bool) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise ServerFailure(failures.server_ended(self.proc.returncode, self.log_tail(), serving=serving))

    def log_tail(self, n_bytes: int = 4000) -> str:
        with contextlib.suppress(OSError), open(self.log_path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - n_bytes, 0))
            return f.read().decode(errors="replace")
        return ""

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after `stop_grace_s`; returns once it is gone."""
        if self.proc is None:
            return
        if self._ended is None:  # "" when we stop it; why it ended, when it had ended on its own
            ended = self.proc.poll() is not None
            self._ended = failures.server_ended(self.proc.returncode, self.log_tail(), serving=True) if ended else ""
        for sig, wait_s in ((signal.SIGTERM, self.stop_grace_s), (signal.SIGKILL, None)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):  # anything it started that outlived it
            os.killpg(self.proc.pid, signal.SIGKILL)

    def begin_window(self) -> None:
        self._counters_at_start = self._read(self.engine.counters)

    def sample(self) -> None:
        pass

    def window_metrics(self) -> dict[str, float]:
        """`server_<name>` for each setting, and each counter's rise since `begin_window`; a value the
        server did not give is left out."""
        now = self._read(self.engine.counters)
        rises = {k: v - self._counters_at_start[k] for k, v in now.items() if k in self._counters_at_start}
        return {f"server_{k}": v for k, v in {**self._read(self.engine.settings), **rises}.items()}

    def _read(self, recorded: Recorded | None) -> dict[str, float]:
        """The numbers `recorded` names, read from the running server ({} when it cannot say)."""
        if recorded is None:
            return {}
        try:
            with urllib.request.urlopen(self.url + recorded.path, timeout=5) as r:
                text = r.read().decode()
        except (OSError, ValueError):
            return {}
        return _numbers(text, recorded.fields)

    def check(self) -> None:
        """Raises when the server ended on its own while serving (before `stop`, or since it started)."""
        if self._ended:
            raise ServerFailure(self._ended)
        if self._ended is None:
            self._raise_if_ended(serving=True)

    @property
    def is_hopeless(self) -> bool:
        return False


def _numbers(text: str, fields: dict[str, str]) -> dict[str, float]:
    """`fields` (name -> JSON dotted path, or Prometheus sample name) read from a response body."""
    try:
        data = json.loads(text)
    except ValueError:
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        return {k: float(samples[v]) for k, v in fields.items() if v in samples}
    out = {}
    for name, dotted in fields.items():
        value = data
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
