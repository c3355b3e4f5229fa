"""report.html in a real browser: headless Chromium loads the page offline, and every plotly
figure draws (its div holds plotly's rendered `svg.main-svg`); the winner card is there.

Chromium comes from tests/setup_system.sh (Debian package `chromium`)."""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from slotune.tuner.report.markdown import write_report
from slotune.tuner.run import run_command

from tests.tuner_tests.conftest import write_spec
from tests.tuner_tests.test_report import made_study, remeasured

CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (tests/setup_system.sh installs it)"
)


def chromium(page: Path, *args: str, profile: Path) -> str:
    """Run headless Chromium on `page` (no network: the page must carry its own JavaScript)."""
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--proxy-server=127.0.0.1:9",
        "--virtual-time-budget=15000",
        *args,
        page.resolve().as_uri(),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


class _Figures(HTMLParser):
    """Per plotly figure div (id 'fig-...'): how many `svg.main-svg` it holds once drawn; and the
    winner card's text."""

    def __init__(self) -> None:
        super().__init__()
        self.svgs: dict[str, int] = {}
        self.winner_text = ""
        self._open: list[tuple[str, str | None]] = []  # (tag, figure or card id) for open divs

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "div":
            fid = a.get("id") or ""
            mark = fid if fid.startswith("fig-") or fid == "winner" else None
            if fid.startswith("fig-"):
                self.svgs.setdefault(fid, 0)
            self._open.append((tag, mark))
        elif tag == "svg" and "main-svg" in (a.get("class") or "").split():
            for _, mark in self._open:
                if mark and mark.startswith("fig-"):
                    self.svgs[mark] += 1

    def handle_endtag(self, tag):
        if tag == "div" and self._open:
            self._open.pop()

    def handle_data(self, data):
        if any(mark == "winner" for _, mark in self._open):
            self.winner_text += data


def drawn(dom: str) -> _Figures:
    p = _Figures()
    p.feed(dom)
    return p


@needs_chromium
def test_the_report_of_a_real_study_draws_in_a_browser(tmp_path, fake_trials):
    """A real study (`run_command`) whose trials are the stand-in measurement (fake_trials): its
    report.html draws the optimization history, the latency percentiles and the importances."""
    spec = write_spec(
        tmp_path,
        budget={"n_trials": 4},
        objective={"ttft_limit_s": 0.08},
        search_space={
            "name": "s",
            "knobs": [
                {"name": "max_num_seqs", "type": "int", "low": 1, "high": 16},  # the default (16) is trial 0
                {"name": "quantization", "type": "categorical", "choices": ["none", "int8"]},
            ],
        },
    )
    summary = run_command(spec, progress=False, trial_runner=fake_trials)
    page = tmp_path / "out" / "report.html"
    dom = chromium(page, "--dump-dom", profile=tmp_path / "profile")
    figs = drawn(dom)
    assert set(figs.svgs) == {"fig-history-0", "fig-distributions-0", "fig-importances-0"}, figs.svgs
    assert all(n > 0 for n in figs.svgs.values()), figs.svgs  # plotly drew each one
    assert f"Winner: trial {summary['trial']}" in figs.winner_text
    assert "p95 TPOT" in figs.winner_text and "better" in figs.winner_text


@needs_chromium
def test_a_multi_objective_report_draws_its_pareto_front_and_distributions(tmp_path):
    """The study of test_report.made_study (trials with per-request latencies and gates)."""
    spec, study = made_study(tmp_path, multi=True)
    paths = write_report(spec, study, *remeasured(study, spec), tmp_path)
    figs = drawn(chromium(paths["html"], "--dump-dom", profile=tmp_path / "profile"))
    assert set(figs.svgs) == {"fig-history-0", "fig-pareto-0", "fig-distributions-0", "fig-importances-0"}
    assert all(n > 0 for n in figs.svgs.values()), figs.svgs
    assert "int8 weights + int8 KV + 2 sequences per step" in figs.winner_text
    assert "top-1 agreement 0.956 >= 0.9" in figs.winner_text
