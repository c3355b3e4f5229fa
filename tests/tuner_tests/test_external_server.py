"""An external engine's server for one trial (slotune/tuner/measure/external_server.py), on the real
llama.cpp `llama-server` and the bundled GGUF: ready, served, torn down with nothing left; a bad
flag, a kill -9 mid-serving and a killed trial process each end as the failure they are."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from slotune.engine.loader import resolve_model_path
from slotune.tuner.measure.external_server import ExternalServer, ServerFailure
from slotune.tuner.spec.engines import EngineDescription, load_engine

LLAMA_SERVER = shutil.which("llama-server")
pytestmark = pytest.mark.skipif(LLAMA_SERVER is None, reason="needs llama.cpp's llama-server on PATH")
SMALL = {"threads": 2, "parallel": 2, "ctx_per_slot": 512}


def _server(tmp_path, values=SMALL, engine=None) -> ExternalServer:
    return ExternalServer(
        engine or load_engine("llama-server"),
        values,
        binary=LLAMA_SERVER,
        model=str(resolve_model_path("smollm2-135m")),
        tokenizer=None,
        log_path=tmp_path / "server.log",
        ready_timeout_s=120,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split()[2] != "Z"


def _wait_gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


def test_it_serves_its_knobs_and_leaves_nothing_behind(tmp_path):
    server = _server(tmp_path, {**SMALL, "cache_type_k": "q8_0"})
    with server:
        pid = server.proc.pid
        props = urllib.request.urlopen(server.url + "/props", timeout=10).read().decode()
        assert '"total_slots":2' in props.replace(" ", "")
        server.check()
        server.begin_window()
        server._post("/v1/completions", {"prompt": "Hello there", "max_tokens": 5, "temperature": 0}, timeout=60)
        seen = server.window_metrics()  # what it resolved, and its counters' rise: no bundled-engine counter
        assert seen["server_slots"] == 2 and seen["server_ctx_per_slot"] == 512
        assert seen["server_generated_tokens"] == 5 and seen["server_decode_calls"] >= 5
        assert all(k.startswith("server_") for k in seen)
        assert "--cache-type-k" in server.argv and server.load_time_s > 0
    assert not _alive(pid)
    server.check()  # stopped by us, as a trial stops it after its replay: not a crash


def test_a_flag_the_binary_does_not_know_is_a_bad_flag(tmp_path):
    engine = EngineDescription.model_validate(
        {
            **load_engine("llama-server").model_dump(),
            "knobs": {"slots": {"flag": "--n-slots", "type": "int"}},
            "rules": [],
            "slot_context": None,
            "slots": None,
        }
    )
    with pytest.raises(ServerFailure, match=r"^bad flag: exit code \d+: .*--n-slots"):
        with _server(tmp_path, {"slots": 2}, engine):
            pass


def test_kill_9_while_serving_is_a_crash_under_load(tmp_path):
    with _server(tmp_path) as server:
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        with pytest.raises(ServerFailure, match="^crashed under load: killed by signal 9"):
            server.check()
    with pytest.raises(ServerFailure, match="^crashed under load: killed by signal 9"):
        server.check()  # still a crash once the trial has stopped it


def test_the_server_dies_with_a_killed_trial_process(tmp_path):
    """SIGKILL of the process that started the server (as `tune run` kills a trial, or as the
    trial dies) leaves no server running."""
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from slotune.tuner.measure.external_server import ExternalServer
        from slotune.tuner.spec.engines import load_engine
        s = ExternalServer(load_engine("llama-server"), {SMALL!r}, binary={LLAMA_SERVER!r},
                           model={str(resolve_model_path("smollm2-135m"))!r}, tokenizer=None,
                           log_path=Path({str(tmp_path / "server.log")!r}), ready_timeout_s=120)
        s.__enter__()
        print(s.proc.pid, flush=True)
        time.sleep(600)
        """
    )
    trial = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(trial.stdout.readline())
        assert _alive(pid)
        trial.kill()
        trial.wait(10)
        assert _wait_gone(pid)
    finally:
        trial.kill()


@pytest.mark.skipif(shutil.which("llama-quantize") is None, reason="needs llama.cpp's llama-quantize on PATH")
def test_greedy_match_passes_the_reference_and_fails_weights_requantized_to_2_bits(tmp_path):
    """The negative control: the bundled Q4_1 GGUF requantized to Q2_K by llama-quantize is known to
    damage output; the gate fails it, and passes the reference launch judged against itself."""
    from slotune.evals.gate_spec import GateSpec
    from slotune.tuner.measure.external_trial import answers, external_server, judge_gates
    from slotune.tuner.spec.server import ServerConfig

    q2 = tmp_path / "q2_k.gguf"
    subprocess.run(
        ["llama-quantize", "--allow-requantize", str(resolve_model_path("smollm2-135m")), str(q2), "Q2_K"],
        check=True,
        capture_output=True,
    )
    gate = GateSpec(name="same", kind="greedy_match", min_match=0.8, limit=8, max_tokens=16)
    reference = ServerConfig(engine="llama-server", model="smollm2-135m", knobs={"threads": 2})
    scores = {}
    for model in ("smollm2-135m", str(q2)):
        cfg = reference.with_updates({"model": model})
        with external_server(cfg, tmp_path / "server.log") as server:
            assert str(q2) in server.argv or model != str(q2)
            report = judge_gates(cfg, reference, [gate], answers(server, [gate]), server.tokenizer, tmp_path)
        scores[model] = report.gates[0]
    assert scores["smollm2-135m"].passed and scores["smollm2-135m"].candidate == 1.0
    assert not scores[str(q2)].passed and scores[str(q2)].candidate < 0.5


def test_an_lm_eval_generation_task_runs_through_the_servers_api(tmp_path):
    """lm-eval's local-completions against the real server: the task's per-document scores, and a
    gate of the reference launch judged against itself (the baseline cached from its own run)."""
    from slotune.evals.gate_spec import GateSpec
    from slotune.tuner.measure.external_trial import answers, external_server, judge_gates
    from slotune.tuner.spec.server import ServerConfig

    gate = GateSpec(
        name="sums",
        kind="lm_eval",
        task="slotune_arithmetic_1digit_gen",
        metric="exact_match",
        limit=6,
        max_abs_drop=0.2,
    )
    reference = ServerConfig(engine="llama-server", model="smollm2-135m", knobs={"threads": 2})
    with external_server(reference, tmp_path / "server.log") as server:
        run = answers(server, [gate])["sums"]
    assert run["num_docs"] == 6 and set(run["per_doc"]["exact_match"]) == set(range(6))
    assert 0 <= run["metrics"]["exact_match"] <= 1
    report = judge_gates(reference, reference, [gate], {"sums": run}, None, tmp_path)
    result = report.gates[0]
    assert result.passed and result.drop == 0 and result.num_items == 6, result.reason
    assert len(list(tmp_path.glob("lm_eval-*.json"))) == 1
