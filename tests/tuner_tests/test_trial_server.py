"""The server seam of a served trial (slotune/tuner/measure/server.py): `ServerConformance` is what every
`TrialServer` must do, run here on the bundled engine (SmolLM2, real HTTP on loopback). A server
for another engine subclasses it with its own `make_server`. A client's failure against a server
that died is failed with the server's reason."""

from __future__ import annotations

import socket

import httpx
import pytest

from slotune.engine.config import EngineConfig
from slotune.tuner.measure.external_server import ServerFailure
from slotune.tuner.measure.server import BundledServer, TrialServer
from slotune.tuner.measure.trial_runner import _replay_once
from slotune.tuner.spec.workload_spec import WorkloadSpec

OBJECTIVE = {"percentile": 95, "ttft_limit_s": 30.0, "tpot_limit_s": None}


def _complete(url: str, prompt: str = "Hello", max_tokens: int = 4) -> dict:
    r = httpx.post(
        f"{url}/v1/completions",
        json={
            "model": httpx.get(f"{url}/v1/models").json()["data"][0]["id"],
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


class ServerConformance:
    """The lifecycle a served trial relies on: ready on `url` inside `with`, gone after it; a
    tokenizer the client can encode prompts with; window metrics are numbers; `check` raises only
    for a server that died."""

    def make_server(self) -> TrialServer:
        raise NotImplementedError

    def test_serves_on_its_url_only_while_inside_with(self):
        server = self.make_server()
        with server:
            assert server.url.startswith("http://127.0.0.1:")
            assert server.load_time_s > 0
            out = _complete(server.url)
            assert out["usage"]["completion_tokens"] == 4
            url = server.url
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/v1/models", timeout=5)

    def test_the_client_tokenizes_as_the_server_does(self):
        server = self.make_server()
        with server:
            ids = server.tokenizer.encode("The quick brown fox")
            out = _complete(server.url, prompt="The quick brown fox")
        assert out["usage"]["prompt_tokens"] == len(ids)

    def test_window_metrics_are_numbers_and_a_healthy_server_checks_clean(self):
        server = self.make_server()
        with server:
            _complete(server.url)  # a warm-up, before the window
            server.begin_window()
            _complete(server.url)
            server.sample()
            metrics = server.window_metrics()
        server.check()
        assert not server.is_hopeless
        assert all(isinstance(v, float) for v in metrics.values()), metrics


class TestBundledServer(ServerConformance):
    def make_server(self) -> TrialServer:
        return BundledServer(EngineConfig(max_num_seqs=2), OBJECTIVE, {"enabled": False})

    def test_the_window_counts_only_what_came_after_it_began(self):
        server = self.make_server()
        with server:
            for _ in range(3):
                _complete(server.url, max_tokens=8)  # before the window: not counted
            server.begin_window()
            _complete(server.url, max_tokens=4)
            metrics = server.window_metrics()
        # One request of 4 tokens: a prefill step that gives the first token, then 3 decode steps.
        assert 1 <= metrics["num_engine_steps"] <= 4
        assert metrics["weight_bytes"] > 0 and metrics["peak_memory_mb"] > 0

    def test_a_server_whose_engine_died_fails_its_check(self):
        server = self.make_server()
        with server:
            server._served.error = RuntimeError("boom")  # what AsyncLLM records when its loop dies
        with pytest.raises(RuntimeError, match="engine loop died while serving: RuntimeError: boom"):
            server.check()


class _KilledServer:
    """A stand-in for a server killed while its client starts: nothing listens on its url, and its
    `check` passes once and then raises what ExternalServer.check raises for a SIGKILLed process.
    (Killing a real one at that instant is a race: tests/tuner_tests/test_server_faults.py.)"""

    tokenizer = None

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{s.getsockname()[1]}"
        self.checks = 0

    def begin_window(self) -> None: ...

    def sample(self) -> None: ...

    def check(self) -> None:
        self.checks += 1
        if self.checks > 1:
            raise ServerFailure("crashed under load: killed by signal 9")


def test_a_client_that_cannot_reach_a_dead_server_fails_with_the_servers_reason():
    req = {"config": {}, "workload": WorkloadSpec(num_requests=2).model_dump(), "objective": OBJECTIVE}
    with pytest.raises(ServerFailure, match="crashed under load: killed by signal 9") as err:
        _replay_once(_KilledServer(), req, after=lambda res: None)
    assert "cannot reach" in str(err.value.__context__)  # what the client saw, kept as the context
