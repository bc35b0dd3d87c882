"""The demo's privacy chapter: its report section and summary from what it measured."""

import json
from pathlib import Path

from fedge.demo.privacy import JOB, JOB_EPSILON, PrivacyChapter, report_lines, summary
from fedge.privacy.settings import PrivacyMode, PrivacySpec


def test_the_chapter_reports_each_stations_spend(tmp_path: Path) -> None:
    chapter = PrivacyChapter(tmp_path / "fleet-private", "inspect:3", job_s=41.6)
    chapter.spent = {
        "st-01": {"rounds": 2.0, "epsilon_job": 3.91, "epsilon_total": 3.91},
        "st-02": {"rounds": 2.0, "epsilon_job": 3.97, "epsilon_total": 3.97},
    }
    chapter.reported = {"st-01": 3.91, "st-02": None}
    chapter.held_out = {"st-01": {0: 0.81, 2: 0.84}, "st-02": {0: 0.7}}
    text = "\n".join(report_lines(chapter))
    assert "## Privacy" in text and "inspect:3" in text and "42 s" in text
    assert "| st-01 | 2 | 3.910 | 3.910 | 3.910 | 0.810 → 0.840 |" in text
    assert "| st-02 | 2 | 3.970 | 3.970 | - | - |" in text
    shown = summary(chapter)
    assert json.loads(json.dumps(shown))["held_out"]["st-01"] == {"0": 0.81, "2": 0.84}


def test_the_chapters_job_asks_for_dp_sgd_under_secagg() -> None:
    import tomllib

    document = tomllib.loads(JOB.format(rounds=2, model="inspect:1", epsilon=JOB_EPSILON,
                                        delta=1e-3, fleet="demo"))  # fmt: skip
    spec = PrivacySpec.from_table(document["privacy"])
    assert spec.mode is PrivacyMode.LOCAL and spec.secagg and spec.epsilon == JOB_EPSILON
