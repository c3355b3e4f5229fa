"""Tuning on recorded traffic, without a cluster: the drift rule, the window a Job snapshots from
every pod's recording, the skip decision, and what the operator renders for recording and
replaying (slotune/operator/traffic.py, publish.py, children.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slotune.operator import admission, children, publish, traffic
from slotune.tuner.spec.traces import RecordedRequest

T0 = 1_763_000_000.0
OWNER = {"apiVersion": "slotune.dev/v1alpha1", "kind": "SLOTuning", "name": "t", "uid": "u"}


def record(
    folder: Path, start: float, num: int, rate: float, prompt: int, output: int, name: str = "requests-000.jsonl"
) -> list[float]:
    """Write `num` RecordedRequest lines (in finish order, as a recorder does); returns the arrivals."""
    folder.mkdir(parents=True, exist_ok=True)
    reqs = [
        RecordedRequest(
            arrival=start + i / rate,
            finish=start + i / rate + 1.0 + (i % 3),
            prompt_tokens=prompt + 7 * (i % 5),
            output_tokens=output + (i % 4),
            finish_reason="stop",
            chat=False,
        )
        for i in range(num)
    ]
    reqs.sort(key=lambda r: r.finish)
    with (folder / name).open("a") as f:
        f.write("".join(r.model_dump_json() + "\n" for r in reqs))
    return [r.arrival for r in reqs]


# --- drift -----------------------------------------------------------------------------------

BASE = {
    "run": 1,
    "requests": 100,
    "meanRate": 2.0,
    "promptP50": 500,
    "promptP95": 900,
    "outputP50": 100,
    "outputP95": 200,
    "cv": 1.0,
    "cacheableShare": 0.30,
}


def test_drift_is_the_largest_relative_change_or_the_share_change():
    assert traffic.drift(dict(BASE), BASE) == traffic.Drift(0.0, "meanRate")
    d = traffic.drift({**BASE, "meanRate": 2.2, "promptP95": 1080}, BASE)
    assert d.field == "promptP95" and d.value == pytest.approx(0.2)
    # the cacheable share is a fraction already: its absolute change counts
    d = traffic.drift({**BASE, "cacheableShare": 0.55}, BASE)
    assert d.field == "cacheableShare" and d.value == pytest.approx(0.25)
    # the CV is reported, not compared
    assert traffic.drift({**BASE, "cv": 3.0}, BASE).value == 0.0
    # a field missing on either side, or zero in the tuned-on traffic, is left out
    assert traffic.drift({**BASE, "meanRate": None, "cacheableShare": None}, {**BASE, "outputP50": 0}).value == 0.0
    assert traffic.drift({}, {}) == traffic.Drift(0.0, "none")


def test_describe_and_the_skip_rule():
    d = traffic.Drift(0.04, "promptP95")
    assert traffic.is_skipped(d, 0.15) and not traffic.is_skipped(d, 0.0)  # 0: always re-tune
    assert traffic.describe(d, 0.15, 3) == "traffic drift 4% < threshold 15% (largest: promptP95, vs run 3)"
    assert traffic.describe(traffic.Drift(0.15, "meanRate"), 0.15).startswith("traffic drift 15% >= threshold 15%")


def test_tuned_traffic_counts_only_for_the_same_spec_and_source():
    spec = {"tuning": {"name": "a"}, "target": {"servingName": "chat"}, "traffic": {"window": "1h"}}
    digest = traffic.source_hash(spec)
    tuned = {**BASE, "sourceHash": digest, "window": {"seconds": 3600}}
    plan = traffic.make_plan(spec, "rec", tuned)
    assert (plan.serving, plan.claim, plan.window_s, plan.drift_threshold) == ("chat", "rec", 3600, 0.15)
    assert plan.tuned_traffic == {k: BASE[k] for k in ("run", *traffic.SUMMARY_FIELDS)}
    for changed in (
        {**spec, "tuning": {"name": "b"}},
        {**spec, "traffic": {"window": "2h"}},
        {**spec, "traffic": {"window": "1h", "fromServing": "other"}},
    ):
        assert traffic.make_plan(changed, "rec", tuned).tuned_traffic is None
    # the threshold is how the tuned-on traffic is judged, not what it was tuned on
    assert traffic.make_plan({**spec, "traffic": {"window": "1h", "driftThreshold": 0.5}}, "rec", tuned).tuned_traffic


@pytest.mark.parametrize(
    "patch,field",
    [
        ({"traffic": {"window": "1 day"}}, "spec.traffic.window"),
        ({"traffic": {"window": "0s"}}, "spec.traffic.window"),
        ({"traffic": {"driftThreshold": -0.1}}, "spec.traffic.driftThreshold"),
        ({"traffic": {"timeScale": 0}}, "spec.traffic.timeScale"),
        ({"traffic": {}, "workers": 2}, None),  # {} is unset
        ({"traffic": {"window": "1h"}, "workers": 2, "storageSecret": {"name": "db"}}, "spec.traffic"),
    ],
)
def test_traffic_settings_are_checked(patch, field):
    spec = {"tuning": {"name": "a"}, "target": {"servingName": "chat"}, **patch}
    got = traffic.problem(spec)
    assert (got[0] if got else None) == field


def test_recording_claims_are_checked():
    assert admission.check_serving({}) is None
    assert admission.check_serving({"recordTraffic": {"claimName": "rec"}}) is None
    for record, words in (
        ({}, "is empty"),
        ({"claimName": ""}, "is empty"),
        ({"claimName": "Not_A_Name"}, "not a"),
        ({"claimName": "rec", "maxMiB": 0}, "maxMiB"),
    ):
        r = admission.check_serving({"recordTraffic": record})
        assert r.reason == "InvalidRecording" and words in r.message, (record, r)
    launch = {"engine": "llama-server", "knobs": {"parallel": 2}}
    for spec in ({"config": launch}, {"config": {}, "canary": {"config": launch}}):
        r = admission.check_serving({**spec, "recordTraffic": {"claimName": "rec"}})
        assert r.field == "spec.recordTraffic" and "the bundled engine's server only" in r.message


# --- rendering -------------------------------------------------------------------------------


def test_recording_pods_each_write_their_own_folder():
    spec = {"model": "m", "recordTraffic": {"claimName": "rec", "maxMiB": 64}}
    dep = children.deployment("chat", "canary", spec, OWNER, {"model": "m"}, 1)
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    i = c["command"].index("--record-traffic")
    assert c["command"][i : i + 4] == [
        "--record-traffic",
        "/traffic/chat/$(SLOTUNE_POD_NAME)",
        "--record-traffic-max-mib",
        "64",
    ]
    assert {"name": "SLOTUNE_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in c["env"]
    assert {"name": "traffic", "mountPath": "/traffic"} in c["volumeMounts"]
    assert {"name": "traffic", "persistentVolumeClaim": {"claimName": "rec"}} in pod["volumes"]
    plain = children.deployment("chat", "stable", {"model": "m"}, OWNER, {"model": "m"}, 1)
    assert "--record-traffic" not in plain["spec"]["template"]["spec"]["containers"][0]["command"]


def test_a_traffic_run_mounts_the_recording_read_only_and_replays_its_snapshot():
    spec = {
        "tuning": {"name": "a", "workload": "chat-small"},
        "target": {"servingName": "chat"},
        "traffic": {"window": "2h", "driftThreshold": 0.2, "timeScale": 2.0},
    }
    plan = traffic.make_plan(spec, "rec", {**BASE, "sourceHash": traffic.source_hash(spec)})
    job = children.tuning_jobs("t", spec, OWNER, 3, "ns", plan)[0]
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert {"name": "traffic", "mountPath": "/traffic", "readOnly": True} in c["volumeMounts"]
    assert {"name": "traffic", "persistentVolumeClaim": {"claimName": "rec", "readOnly": True}} in pod["volumes"]
    cmd = c["command"]
    arg = lambda flag: cmd[cmd.index(flag) + 1]  # noqa: E731
    assert arg("--traffic-dir") == "/traffic/chat" and arg("--traffic-window-s") == "7200"
    assert arg("--traffic-snapshot") == children.TRAFFIC_SNAPSHOT and arg("--drift-threshold") == "0.2"
    assert json.loads(arg("--tuned-traffic"))["promptP95"] == 900
    assert cmd[cmd.index("--") + 1 :][:2] == ["tune", "run"]
    workload = children.tuning_spec(spec, plan, 1)["workload"]
    assert workload["trace"] == {"path": children.TRAFFIC_SNAPSHOT, "format": "recorded", "time_scale": 2.0}
    assert children.tuning_spec(spec, None, 1)["workload"] == "chat-small"


# --- the Job side: snapshot, summary, skip -----------------------------------------------------


def test_snapshot_takes_the_last_window_of_every_pod(tmp_path):
    root = tmp_path / "chat"
    old = record(root / "chat-0", T0 - 7200, 50, 1.0, 2000, 50)  # two hours before: outside a 1 h window
    a = record(root / "chat-0", T0, 60, 0.5, 300, 40, name="requests-001.jsonl")
    b = record(root / "chat-1", T0 + 1, 60, 0.5, 300, 40)
    with (root / "chat-1" / "requests-000.jsonl").open("a") as f:
        f.write('{"arrival": 1763000500.0, "prompt_tok')  # a pod killed mid-write
    out = tmp_path / "work" / "traffic.jsonl"
    w = publish.snapshot_traffic(root, 3600, out)
    assert w.end == max(a + b) and w.num_requests == 120 and w.num_files == 3 and w.num_invalid == 1
    arrivals = [json.loads(line)["arrival"] for line in out.read_text().splitlines()]
    assert arrivals == sorted(a + b) and not set(old) & set(arrivals)


def test_the_same_traffic_is_skipped_and_drifted_traffic_tunes(tmp_path):
    root = tmp_path / "chat"
    record(root / "chat-0", T0, 100, 0.5, 300, 40)
    record(root / "chat-1", T0, 100, 0.5, 300, 40)
    snap = tmp_path / "snap.jsonl"
    first, skipped = publish.prepare_traffic(root, 3600, snap, 0.15, None)
    assert skipped is None and first["drift"] is None and first["requests"] == 200
    assert first["window"]["seconds"] == 3600 and first["invalidLines"] == 0
    assert set(traffic.SUMMARY_FIELDS) <= set(first)
    again, skipped = publish.prepare_traffic(root, 3600, snap, 0.15, {**first, "run": 1})
    assert skipped == "NoDrift: traffic drift 0% < threshold 15% (largest: meanRate, vs run 1)"
    assert again["drift"] == 0.0 and again["driftFrom"] == 1
    record(root / "chat-0", T0 + 200, 200, 2.0, 900, 40, name="requests-001.jsonl")  # busier, longer prompts
    drifted, skipped = publish.prepare_traffic(root, 3600, snap, 0.15, {**first, "run": 1})
    assert skipped is None and drifted["drift"] >= 0.15 and drifted["driftField"] in traffic.RELATIVE_FIELDS


def test_no_traffic_is_an_error_naming_the_folder(tmp_path):
    with pytest.raises(publish.NoTraffic, match="no recording"):
        publish.prepare_traffic(tmp_path / "nothing", 3600, tmp_path / "s.jsonl", 0.15, None)
    (tmp_path / "bad" / "p").mkdir(parents=True)
    (tmp_path / "bad" / "p" / "r.jsonl").write_text("not json\n")
    with pytest.raises(publish.NoTraffic, match="no valid request"):
        publish.prepare_traffic(tmp_path / "bad", 3600, tmp_path / "s.jsonl", 0.15, None)


def test_every_run_is_its_own_study():
    """A re-tune on a persistent store must not resume run 1's study (its trials would use up the
    budget and the run would add none): run n tunes study <name>-run-<n>."""
    from slotune.operator import children

    spec = {"tuning": {"name": "chat", "model": "smollm2-135m"}}
    assert [children.tuning_spec(spec, None, run)["name"] for run in (1, 2)] == ["chat-run-1", "chat-run-2"]
    assert spec["tuning"]["name"] == "chat"  # the custom resource's own spec is not touched


def test_tuned_traffic_written_under_its_pre_rename_name_is_still_read_then_replaced():
    """Objects written by operators before 0.2 keep the tuned-on traffic in `status.baselineTraffic`:
    it is still what the next run compares with, and the next result moves it to `tunedTraffic`."""
    from slotune.operator import tuning

    old = {"run": 1, "requests": 200, "sourceHash": "h"}
    s = tuning.Step(
        name="t",
        namespace="ns",
        spec={"rollout": {"mode": "manual"}, "target": {"servingName": "chat"}},
        status={"baselineTraffic": old, "run": 2, "traffic": {"run": 2, "requests": 180}},
        body={},
    )
    assert tuning.tuned_traffic(s) == old
    tuning.take_result(s, {"best.yaml": "max_num_seqs: 4\n"})
    assert s.patch["tunedTraffic"]["run"] == 2 and s.patch["baselineTraffic"] is None
    assert tuning.tuned_traffic(s)["requests"] == 180
