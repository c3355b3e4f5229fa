import importlib.util
import json
import math
from pathlib import Path

import pytest
from slotune.tuner.spec.trace_reader import detect_format, load_trace
from slotune.tuner.spec.traces import RecordedRequest, Trace, TraceRequest, TraceSource, block_hash_ids
from slotune.tuner.spec.yaml_reader import MissingFileError, SpecError
from slotune.tuner.workload.prompts import build_prompts, iter_prompts

DATA = Path(__file__).resolve().parents[1] / "data" / "traces"
SAMPLES = {
    "recorded": DATA / "recorded.jsonl",
    "mooncake": DATA / "mooncake.jsonl",
    "azure": DATA / "azure.csv",
    "burstgpt": DATA / "burstgpt.csv",
}
CORPUS = list(range(10_007))  # distinct ids: equal windows can only come from equal starts


def _make_samples():
    spec = importlib.util.spec_from_file_location("make_samples", DATA / "make_samples.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _canonical(ids_per_request):
    """Hash ids renumbered in first-seen order: equal when two traces share the same blocks."""
    number: dict[int, int] = {}
    return [[number.setdefault(h, len(number)) for h in ids] for ids in ids_per_request]


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# --- formats ----------------------------------------------------------------------------------------------
def test_samples_are_up_to_date():
    for name, text in _make_samples().sample_files().items():
        assert (DATA / name).read_text() == text, f"{name} is stale: run python tests/data/traces/make_samples.py"


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
def test_format_is_detected_and_explicit_format_agrees(fmt):
    assert detect_format(SAMPLES[fmt]) == fmt
    detected, explicit = load_trace(SAMPLES[fmt]), load_trace(SAMPLES[fmt], format=fmt)
    assert detected.format == explicit.format == fmt and detected.requests == explicit.requests


def test_every_format_gives_the_same_requests():
    traces = {fmt: load_trace(p) for fmt, p in SAMPLES.items()}
    ref = traces["recorded"].requests
    assert len(ref) == 120
    for fmt, trace in traces.items():
        assert len(trace) == len(ref), fmt
        for a, b in zip(ref, trace.requests):
            assert (a.prompt_tokens, a.output_tokens) == (b.prompt_tokens, b.output_tokens), fmt
            assert a.arrival_s == pytest.approx(b.arrival_s, abs=1e-5), fmt
    assert ref[0].arrival_s == 0.0 and all(a.arrival_s <= b.arrival_s for a, b in zip(ref, ref[1:]))
    # chat flags where the format has them; finish data only in recordings
    assert [r.is_chat for r in ref] == [r.is_chat for r in traces["burstgpt"].requests]
    assert all(r.is_chat is None and r.e2e_s is None for r in traces["azure"].requests + traces["mooncake"].requests)
    assert all(r.e2e_s > 0 and r.finish_reason in ("stop", "length") for r in ref)
    # the same blocks shared: recordings hash full blocks, Mooncake also the last, partial one
    assert traces["recorded"].block_size == traces["mooncake"].block_size == 512
    assert traces["azure"].block_size is None and traces["burstgpt"].block_size is None
    mooncake_full = [r.hash_ids[: r.prompt_tokens // 512] for r in traces["mooncake"].requests]
    assert _canonical([r.hash_ids for r in ref]) == _canonical(mooncake_full)
    assert all(len(r.hash_ids) == math.ceil(r.prompt_tokens / 512) for r in traces["mooncake"].requests)


def test_rotated_directory_loads_as_one_recording_in_time_order():
    files = sorted((DATA / "recorded_rotated").glob("*.jsonl"))
    assert len(files) == 3
    assert detect_format(DATA / "recorded_rotated") == "recorded"
    assert load_trace(DATA / "recorded_rotated").requests == load_trace(SAMPLES["recorded"]).requests


def test_recorded_lines_are_in_finish_order_and_load_in_arrival_order():
    arrivals = [json.loads(line)["arrival"] for line in SAMPLES["recorded"].read_text().splitlines()]
    assert arrivals != sorted(arrivals)  # the sample really tests the sort
    trace = load_trace(SAMPLES["recorded"])
    assert [r.arrival_s for r in trace.requests] == pytest.approx([a - min(arrivals) for a in sorted(arrivals)])


def test_recorded_request_round_trips_and_is_the_line_format(tmp_path):
    ids = block_hash_ids(list(range(40)), 16, key=b"k")
    rec = RecordedRequest(
        arrival=1_700_000_000.5,
        finish=1_700_000_002.0,
        prompt_tokens=40,
        max_tokens=64,
        output_tokens=64,
        finish_reason="length",
        chat=False,
        cached_tokens=16,
        block_size=16,
        hash_ids=ids,
    )
    p = _write(tmp_path, "rec.jsonl", rec.model_dump_json() + "\n")
    [req] = load_trace(p).requests
    assert req == TraceRequest(0.0, 40, 64, tuple(ids), False, "length", 16, 1.5)
    assert load_trace(p).block_size == 16


def test_azure_timestamps_with_seven_fraction_digits_and_zones(tmp_path):
    p = _write(
        tmp_path,
        "a.csv",
        "\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\n"  # with a BOM
        "2023-11-16 18:15:46.6805900,10,2\n2023-11-16 18:15:47.0000001,11,3\n"
        "2023-11-16T20:15:48+02:00,12,4\n2023-11-16 18:15:49Z,13,5\n",
    )
    assert [r.arrival_s for r in load_trace(p).requests] == pytest.approx(
        [0, 0.3194101, 1.3194100, 2.3194100], abs=1e-6
    )


# --- options ------------------------------------------------------------------------------------------------
def test_time_scale_window_and_cap():
    full = load_trace(SAMPLES["mooncake"]).requests
    slow = load_trace(SAMPLES["mooncake"], time_scale=2.0).requests
    assert [r.arrival_s for r in slow] == pytest.approx([2 * r.arrival_s for r in full])
    win = load_trace(SAMPLES["mooncake"], window=(10, 20)).requests
    inside = [r for r in full if 10 <= r.arrival_s < 20]
    assert [r.prompt_tokens for r in win] == [r.prompt_tokens for r in inside] and len(win) >= 5
    assert [r.arrival_s for r in win] == pytest.approx([r.arrival_s - inside[0].arrival_s for r in inside])
    capped = load_trace(SAMPLES["mooncake"], window=(10, 20), max_requests=3, time_scale=0.5).requests
    assert [r.prompt_tokens for r in capped] == [r.prompt_tokens for r in inside[:3]]
    assert [r.arrival_s for r in capped] == pytest.approx([r.arrival_s / 2 for r in win[:3]])
    source = TraceSource(path=str(SAMPLES["mooncake"]), window=(10, 20), max_requests=3, time_scale=0.5)
    assert load_trace(source).requests == capped


def test_mooncake_block_size_is_a_parameter():
    # 512 by convention; as 1024 the same ids cover twice the tokens, so too many ids for a long prompt
    assert load_trace(SAMPLES["mooncake"]).block_size == 512
    with pytest.raises(SpecError, match=r"mooncake.jsonl:\d+: hash_ids: \d+ ids, but input_length .*block_size"):
        load_trace(SAMPLES["mooncake"], block_size=1024)


# --- errors ----------------------------------------------------------------------------------------------
REC = (
    '{"arrival": 1700000000.0, "prompt_tokens": 20, "output_tokens": 3, "finish_reason": "stop", "chat": true, '
    '"block_size": 8, "hash_ids": [1, 2]}'
)
BAD = [
    ("r.jsonl", f'{REC}\n{REC}\n{{"arrival": 1,,}}\n', r"r.jsonl:3:15: not JSON"),
    (
        "r.jsonl",
        f"{REC}\n" + REC.replace('"prompt_tokens": 20', '"prompt_tokens": -1') + "\n",
        r"r.jsonl:2: prompt_tokens: .*greater than or equal to 1",
    ),
    (
        "r.jsonl",
        REC.replace("[1, 2]", "[1, 2, 3]") + "\n",
        r"r.jsonl:1: hash_ids has 3 ids, but 20 prompt tokens fill 2",
    ),
    ("r.jsonl", REC.replace("[1, 2]", "[1, 2.5]") + "\n", r"r.jsonl:1: hash_ids.1: .*integer"),
    ("r.jsonl", REC.replace("[1, 2]", "[1, -2]") + "\n", r"r.jsonl:1: hash_ids.1: .*greater than or equal to 0"),
    ("r.jsonl", REC.replace('"chat": true', '"chat": true, "tenant": "a"') + "\n", r"r.jsonl:1: tenant: unknown field"),
    ("r.jsonl", REC.replace('"stop"', '"eos"') + "\n", r"r.jsonl:1: finish_reason: .*'stop'"),
    (
        "m.jsonl",
        '{"timestamp": 0, "input_length": 10, "output_length": 1}\n{"timestamp": 5, "input_length": 10}\n',
        r"m.jsonl:2: missing output_length",
    ),
    (
        "m.jsonl",
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-4]}\n',
        r"m.jsonl:1: hash_ids: must be a list of non-negative whole numbers, got -4",
    ),
    (
        "m.jsonl",
        '{"timestamp": "soon", "input_length": 10, "output_length": 1}\n',
        r"m.jsonl:1: timestamp: must be a number",
    ),
    (
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,5,1\nyesterday,5,1\n",
        r"a.csv:3:1: TIMESTAMP: 'yesterday' is not a date",
    ),
    (
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,5,1\n2023-11-16 18:15:47,5.5,1\n",
        r"a.csv:3:2: ContextTokens: must be a whole number",
    ),
    (
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,5\n",
        r"a.csv:2: 2 values, but the header",
    ),
    (
        "b.csv",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,ChatGPT,5,1,6,API log\n"
        "2,ChatGPT,5,-1,4,API log\n",
        r"b.csv:3:4: Response tokens: must be a whole number",
    ),
    (
        "b.csv",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,ChatGPT,5,1,6,Chat\n",
        r"b.csv:2:6: Log Type: must be 'Conversation log' or 'API log'",
    ),
    (
        "b.csv",
        "Timestamp,Model,Request tokens,Response tokens,Log Type\n1,ChatGPT,5,1,API log\n",
        r"b.csv:1: missing column\(s\) Total tokens",
    ),
    ("x.csv", "time,prompt,output\n1,2,3\n", r"x.csv:1: CSV header .* matches no trace format"),
    ("x.jsonl", '{"t": 1}\n', r"x.jsonl:1: JSON lines with keys \['t'\] match no trace format"),
    ("e.jsonl", "\n\n", r"e.jsonl: the trace is empty"),
    ("l.jsonl", '\n{"prompt_len": 3, "output_len": 2}\n', r"l.jsonl:2: .* a workload's `trace:` lengths file"),
]


@pytest.mark.parametrize(("name", "text", "pattern"), BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_files_name_file_line_and_column(tmp_path, name, text, pattern):
    p = _write(tmp_path, name, text)
    with pytest.raises(SpecError, match=pattern) as exc:
        load_trace(p)
    assert str(exc.value).startswith(str(p))


def test_wrong_explicit_format_names_missing_columns(tmp_path):
    with pytest.raises(SpecError, match=r"azure.csv:1: missing column\(s\) Timestamp, Model"):
        load_trace(SAMPLES["azure"], format="burstgpt")


def test_rotated_files_with_different_block_sizes(tmp_path):
    (tmp_path / "rec").mkdir()
    _write(tmp_path / "rec", "a.jsonl", REC + "\n")
    _write(
        tmp_path / "rec",
        "b.jsonl",
        REC + "\n" + REC.replace('"block_size": 8', '"block_size": 4').replace("[1, 2]", "[1, 2, 3, 4, 5]") + "\n",
    )
    with pytest.raises(
        SpecError, match=r"rec/b.jsonl:2: block_size: block_size 4 differs from 8 \(.*a.jsonl, line 1\)"
    ):
        load_trace(tmp_path / "rec")


def test_bad_options_and_paths(tmp_path):
    with pytest.raises(MissingFileError, match="nope.jsonl: trace not found"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(SpecError, match="time_scale: Input should be greater than 0"):
        load_trace(SAMPLES["azure"], time_scale=0)
    with pytest.raises(SpecError, match=r"window: need 0 <= start_s < end_s, got \[5.0, 1.0\]"):
        load_trace(SAMPLES["azure"], window=(5, 1))
    with pytest.raises(SpecError, match="window: no request arrives inside window"):
        load_trace(SAMPLES["azure"], window=(10_000, 20_000))
    with pytest.raises(SpecError, match="block_size: block_size applies to mooncake traces only; this trace is azure"):
        load_trace(SAMPLES["azure"], block_size=16)
    with pytest.raises(SpecError, match="a directory loads as a recording"):
        load_trace(DATA / "recorded_rotated", format="azure")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match=r"no \*.jsonl files"):
        load_trace(tmp_path / "empty")


# --- hashes and prompts -----------------------------------------------------------------------------------------
def test_block_hash_ids_are_chained_keyed_and_cover_full_blocks():
    a = block_hash_ids(list(range(50)), 16)
    assert len(a) == 3 and all(0 <= h < 2**63 for h in a) and len(set(a)) == 3
    assert block_hash_ids(list(range(48)) + [7, 7], 16) == a  # the partial block is not hashed
    changed = block_hash_ids([99] + list(range(1, 50)), 16)
    assert all(x != y for x, y in zip(a, changed))  # a change in block 0 changes every later id
    tail = block_hash_ids(list(range(32)) + [5] * 16, 16)
    assert tail[:2] == a[:2] and tail[2] != a[2]
    assert set(block_hash_ids(list(range(50)), 16, key=b"secret")).isdisjoint(a)
    assert block_hash_ids(list(range(15)), 16) == []


def _trace(requests, block_size=4) -> Trace:
    return Trace(requests, "hand", "mooncake", block_size)


def test_same_hash_id_same_block_different_ids_different_blocks():
    reqs = [
        TraceRequest(0, 10, 1, (1, 2, 3)),
        TraceRequest(1, 12, 1, (1, 2, 4)),
        TraceRequest(2, 9, 1, (5, 2)),
        TraceRequest(3, 6, 1, None),
        TraceRequest(4, 6, 1, None),
        TraceRequest(5, 3, 1, (1,)),
    ]
    p = build_prompts(_trace(reqs), CORPUS)
    assert [len(x) for x in p] == [r.prompt_tokens for r in reqs]
    assert p[0][:8] == p[1][:8]  # ids 1, 2
    assert p[0][8:10] != p[1][8:10]  # ids 3 vs 4
    assert p[2][4:8] == p[0][4:8]  # id 2 at block 1 again: same tokens
    assert p[2][:4] != p[0][:4]  # id 5 vs 1
    assert p[1][8:12] != p[2][8:]  # past the hashed blocks: fresh per request
    assert p[3] != p[4]  # no hash ids: fresh throughout
    assert p[5] == p[0][:3]  # a partial block keeps its id's first tokens
    blocks = {}
    for r, ids in zip(reqs, p):
        for j, h in enumerate(r.hash_ids or ()):
            blocks.setdefault(h, set()).add(tuple(ids[4 * j : 4 * j + 4]))
    assert all(len(v) == 1 for h, v in blocks.items() if h != 1)  # one block per id (id 1 also cut to 3 tokens)
    assert len({next(iter(v)) for h, v in blocks.items() if h != 1}) == len(blocks) - 1  # distinct ids, distinct blocks


def test_build_prompts_is_deterministic_and_seeded():
    trace = load_trace(SAMPLES["mooncake"])
    a, b = build_prompts(trace, CORPUS), build_prompts(trace, CORPUS)
    assert a == b
    c = build_prompts(trace, CORPUS, seed=1)
    assert [len(x) for x in c] == [len(x) for x in a] and c != a
    # another stream: the same blocks, other fresh parts (a recording hashes full blocks only: the tail is fresh)
    rec = load_trace(SAMPLES["recorded"])
    x, w = build_prompts(rec, CORPUS), list(iter_prompts(rec, CORPUS, stream=1))
    assert all(
        wi[: 512 * len(r.hash_ids)] == xi[: 512 * len(r.hash_ids)]
        and wi[512 * len(r.hash_ids) :] != xi[512 * len(r.hash_ids) :]
        for wi, xi, r in zip(w, x, rec.requests)
        if r.prompt_tokens % 512
    )
    # prompts longer than the corpus wrap around it
    [long] = build_prompts(_trace([TraceRequest(0, 25, 1, None)]), [1, 2, 3, 4, 5, 6, 7])
    assert len(long) == 25 and set(long) == set(range(1, 8))


def test_rebuilt_prompts_reproduce_the_traced_sharing():
    trace = load_trace(SAMPLES["mooncake"])
    prompts = build_prompts(trace, CORPUS)
    rehashed = [block_hash_ids(p, 512) for p in prompts]
    full = [r.hash_ids[: r.prompt_tokens // 512] for r in trace.requests]
    assert _canonical(rehashed) == _canonical(full)
