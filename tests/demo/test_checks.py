"""The demo's self-checks (issue 34): each chapter with a passing and a failing summary,
the ERROR-line filter, and the runner that prints, records and fails."""

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from fedge.demo.checks import (
    CheckResult,
    log_check,
    story_checks,
    unexpected_errors,
)
from fedge.demo.errors import StoryCheckFailed
from fedge.demo.self_check import check_story, raise_if_failed


def part(
    pid: str, edge: str, truth: str, decision: str, score: float, threshold: float
) -> dict[str, Any]:
    """A scored part as the anomaly chapter's summary holds it."""
    novel = decision == "accept" and score > threshold
    return {
        "edge": edge, "prediction_id": pid, "truth": truth, "decision": decision,
        "anomaly_score": score, "threshold": threshold, "novel": novel,
    }  # fmt: skip


# The shape of a real run's summary.json (the figures of one run, rounded).
PASSING: dict[str, Any] = {
    "edges": [{"edge": "st-01"}, {"edge": "st-02"}, {"edge": "st-03"}],
    "anomaly": {
        "dent_stations": ["st-02", "st-03"],
        "counted": {"st-01": 31, "st-02": 33, "st-03": 30},
        "fit_count": 94,
        "thresholds": {"st-01": 21.5, "st-02": 19.0, "st-03": 24.25},
        "parts": [
            part("a1", "st-01", "good", "accept", 12.0, 21.5),
            part("a2", "st-01", "scratch", "reject", 40.0, 21.5),
            part("b1", "st-02", "good", "accept", 25.0, 19.0),  # a false alarm
            part("b2", "st-02", "good", "accept", 11.0, 19.0),
            part("b3", "st-02", "dent", "accept", 30.0, 19.0),
            part("b4", "st-02", "dent", "reject", 35.0, 19.0),
            part("c1", "st-03", "good", "accept", 10.0, 24.25),
            part("c2", "st-03", "dent", "accept", 50.0, 24.25),
            part("c3", "st-03", "dent", "accept", 20.0, 24.25),
        ],
        "queue": [
            {"prediction_id": "c2", "novel": True},
            {"prediction_id": "b3", "novel": True},
            {"prediction_id": "b1", "novel": True},
            {"prediction_id": "c3", "novel": False},
        ],
        "queue_after": [{"prediction_id": "c3", "novel": False}],
        "labelled": {"c2": "scratch", "b3": "scratch", "b1": "clean"},
    },
    "learning": {
        "dent_stations": ["st-02", "st-03"],
        "held_out": {
            "st-01": {"0": 0.984, "4": 0.984},
            "st-02": {"0": 0.710, "1": 0.839, "4": 0.935},
            "st-03": {"0": 0.797, "4": 0.969},
        },
    },
    "closed_loop": {
        "verdicts": {"inspect:4": False, "inspect:5": True, "inspect:6": True},
        "flipped": "inspect:4",
        "loop": {"state": "completed", "reason": "", "candidate": "inspect:5"},
        "central": {
            "ref": "inspect:6",
            "outcome": "rolled back: st-03: agreement_drop=0.1667 > 0.05",
            "canary": "st-03",
            "canary_before": "inspect:5",
            "canary_after": "inspect:5",
        },
    },
    "privacy": {
        "lifetime_epsilon": 8.0,
        "job_epsilon": 4.0,
        "spent": {
            e: {"rounds": 2.0, "epsilon_job": 3.996, "epsilon_total": 4.007}
            for e in ("st-01", "st-02", "st-03")
        },
        "reported": {"st-01": 4.007, "st-02": 4.010, "st-03": 4.006},
    },
    "security": {
        "enrolled": "st-09",
        "broker_refused": True,
        "revoke_to_refused_s": 1.01,
        "key_rotation": {
            "stations_online": ["st-01", "st-02", "st-03"],
            "stations_following": ["st-01", "st-02", "st-03", "st-09"],
        },
    },
    "superlink_front": {"fab.signed": 9, "forwarded": 1200},
    "federated": {"target": 0.94, "time_to_target_s": {"fedavg": 1450.0, "tiered": 812.0}},
}


def changed(path: str, value: Any) -> dict[str, Any]:
    """PASSING with the value at ``path`` (keys joined by '/') replaced."""
    summary = copy.deepcopy(PASSING)
    *parents, last = path.split("/")
    node = summary
    for key in parents:
        node = node[key]
    node[last] = value
    return summary


def failed(summary: dict[str, Any]) -> list[CheckResult]:
    return [r for r in story_checks(summary) if not r.ok]


def test_a_run_that_shows_every_chapter_passes_every_check() -> None:
    results = story_checks(PASSING)
    assert [r for r in results if not r.ok] == []
    assert [r.chapter for r in results] == [
        *["what normal looks like"] * 7,
        "the fleet learns",
        "the fleet learns",
        "the closed loop",
        "the closed loop",
        "the closed loop",
        "privacy",
        "privacy",
        "privacy",
        "security",
        "security",
        "signed apps",
        "federated rounds",
    ]
    assert results[7].line == (
        "ok     the fleet learns: st-02's held-out accuracy, before the job -> after it: "
        "0.710 -> 0.935 (+22.5 pt) (bound: >= +5 pt)"
    )


def test_the_fleet_job_must_raise_each_drifted_station_by_5_points() -> None:
    (result,) = failed(changed("learning/held_out/st-03", {"0": 0.797, "4": 0.828}))
    assert result.chapter == "the fleet learns" and "st-03" in result.name
    assert result.figure == "0.797 -> 0.828 (+3.1 pt)"
    assert result.line.startswith("FAILED the fleet learns: st-03")
    # st-01 saw no dents: it is not held to the bound.
    assert failed(changed("learning/held_out/st-01", {"0": 0.98, "4": 0.90})) == []
    (missing,) = failed(changed("learning/held_out/st-02", {"4": 0.935}))
    assert missing.figure == "no evaluation before and after"
    (absent,) = failed(changed("learning", None))
    assert absent.figure == "the chapter did not run"


def test_every_station_must_be_in_the_anomaly_fit_once() -> None:
    (short,) = failed(changed("anomaly/fit_count", 90))
    assert short.figure == "90 in the model; st-01 31, st-02 33, st-03 30"
    (absent,) = failed(changed("anomaly/counted", {"st-01": 61, "st-02": 33}))
    assert absent.figure.endswith("st-01 61, st-02 33, st-03 0")
    (missing,) = failed(changed("anomaly", None))
    assert missing.chapter == "what normal looks like"
    assert missing.figure == "the chapter did not run"


def test_each_station_must_score_under_its_own_anomaly_threshold() -> None:
    (result,) = failed(changed("anomaly/thresholds/st-03", 24.0))
    assert result.figure == "3 station threshold(s), not in force at st-03"
    (unset,) = failed(changed("anomaly/thresholds", {"st-01": 21.5, "st-02": 19.0}))
    assert "not in force at st-03" in unset.figure


def test_a_dent_station_must_flag_a_passed_dent_novel() -> None:
    parts = [p for p in PASSING["anomaly"]["parts"] if p["prediction_id"] != "c2"]
    # c2 gone: st-03's one passed dent left is under its threshold, and the queue's
    # first items are no longer all the chapter's novel parts.
    results = failed(changed("anomaly/parts", parts))
    (station,) = [r for r in results if r.name.startswith("st-03")]
    assert station.figure == "1 dents, 1 passed as clean, 0 novel"
    assert [r.name for r in results if r is not station] == [
        "fedge labels queue shows the novel parts first"
    ]


def test_novel_dents_must_outnumber_false_alarms_and_lead_the_queue() -> None:
    alarms = copy.deepcopy(PASSING["anomaly"]["parts"])
    for p in alarms:
        if p["truth"] == "good":
            p["novel"] = True
    results = failed(changed("anomaly/parts", alarms))
    assert "vs among good parts" in results[0].name
    assert results[0].figure == "67% of 3 passed dents, 100% of 4 good parts"
    reordered = [{"prediction_id": "c3", "novel": False}, *PASSING["anomaly"]["queue"][:3]]
    (queue,) = failed(changed("anomaly/queue", reordered))
    assert queue.figure == "2 of the first 3 item(s) are the chapter's 3 novel part(s)"


def test_the_operator_must_label_every_novel_part() -> None:
    (unlabelled,) = failed(changed("anomaly/labelled", {"c2": "scratch"}))
    assert unlabelled.figure == "1 of 3 labelled; 0 novel left in the queue"
    left = [{"prediction_id": "b1", "novel": True}]
    (still,) = failed(changed("anomaly/queue_after", left))
    assert still.figure == "3 of 3 labelled; 1 novel left in the queue"


def test_the_gate_must_refuse_the_flipped_candidate_and_bless_the_retrained_one() -> None:
    (blessed_flip,) = failed(changed("closed_loop/verdicts/inspect:4", True))
    assert blessed_flip.figure == "inspect:4 blessed" and blessed_flip.bound == "refused"
    (refused_loop,) = failed(changed("closed_loop/verdicts/inspect:5", False))
    assert refused_loop.figure == "inspect:5 refused" and refused_loop.bound == "blessed"
    (no_loop,) = failed(changed("closed_loop/loop/candidate", ""))
    assert no_loop.figure == "no candidate"
    (ungated,) = failed(changed("closed_loop/flipped", "inspect:9"))
    assert ungated.figure == "inspect:9 not gated"


def test_the_defocused_canary_must_roll_back_to_its_previous_model() -> None:
    (completed,) = failed(changed("closed_loop/central/outcome", "completed"))
    assert completed.figure.startswith("completed; st-03 serves inspect:5")
    (stayed,) = failed(changed("closed_loop/central/canary_after", "inspect:6"))
    assert stayed.figure.endswith("st-03 serves inspect:6 (before: inspect:5)")
    assert failed(changed("closed_loop/central/canary_before", "")) != []


def test_every_station_must_spend_within_its_epsilon_bounds() -> None:
    over_job = changed("privacy/spent/st-02/epsilon_job", 4.2)
    (result,) = failed(over_job)
    assert result.name == "epsilon st-02 spent" and result.bound == "<= 4 this job, <= 8 lifetime"
    (reported,) = failed(changed("privacy/reported/st-01", 8.5))
    assert "8.500 reported" in reported.figure
    only_st01 = {"st-01": PASSING["privacy"]["spent"]["st-01"]}
    untrained = failed(changed("privacy/spent", only_st01))
    assert [(r.name, r.figure) for r in untrained] == [
        ("epsilon st-02 spent", "did not train under DP"),
        ("epsilon st-03 spent", "did not train under DP"),
    ]
    assert len(failed(changed("privacy/spent", {}))) == 3


def test_the_broker_must_refuse_the_revoked_station_and_every_station_follow_the_key() -> None:
    (refused,) = failed(changed("security/broker_refused", False))
    assert refused.figure == "not refused"
    (behind,) = failed(changed("security/key_rotation/stations_following", ["st-01", "st-03"]))
    assert behind.figure == "2 of 3 stations on the new key (st-02 not)"
    # A station online at the rotation that is not among the demo's own counts too.
    online = ["st-01", "st-02", "st-03", "st-04"]
    (extra,) = failed(changed("security/key_rotation/stations_online", online))
    assert extra.figure == "3 of 4 stations on the new key (st-04 not)"


def test_the_front_must_have_signed_the_apps_the_stations_fetched() -> None:
    (none_signed,) = failed(changed("superlink_front", {"forwarded": 3}))
    assert none_signed.figure == "0 signed, 0 unsigned"
    (unsigned,) = failed(changed("superlink_front/fab.unsigned", 1))
    assert unsigned.figure == "9 signed, 1 unsigned"
    (absent,) = failed(changed("superlink_front", None))
    assert absent.figure == "the chapter did not run"


def test_tifl_must_reach_the_target_before_fedavg() -> None:
    (later,) = failed(changed("federated/time_to_target_s", {"fedavg": 800.0, "tiered": 812.0}))
    assert later.figure == "0.94 after 812 s (TiFL), 800 s (FedAvg) virtual"
    (never,) = failed(changed("federated/time_to_target_s", {"fedavg": None, "tiered": None}))
    assert never.figure == "0.94 after never (TiFL), never (FedAvg) virtual"
    fedavg_never = changed("federated/time_to_target_s", {"fedavg": None, "tiered": 900.0})
    assert failed(fedavg_never) == []
    assert len(failed(changed("federated/target", 0.9))) == 1  # a lower target proves nothing


LOG = [
    "agent st-02 running (serving nothing yet; local API http://127.0.0.1:27989)",
    "2026-11-27 18:56:24,370 INFO fedge.edge_agent.deploy.models: now serving inspect:1",
    "2026-11-27 18:56:44,375 WARNING fedge.edge_agent.inference.scorer: config v2 sets thresholds",
    "2026-11-27 18:58:48,022 INFO fedge.x: a message that quotes ERROR in passing",
]
BUG = (
    "2026-11-27 18:56:25,304 ERROR fedge.edge_agent.config.labels: labels document rejected "
    "(malformed): not valid JSON: Expecting value: line 1 column 1 (char 0)"
)
REFUSAL = "2026-11-27 19:03:39,100 ERROR fedge.transport.mqtt: mqtt st-09: certificate revoked"
EXPECTED = ((r"ERROR fedge\.transport\.mqtt: mqtt st-09: .*revoked", "st-09 is revoked"),)


def test_only_error_lines_that_no_expected_refusal_explains_are_unexpected() -> None:
    assert unexpected_errors(LOG) == []
    assert unexpected_errors([*LOG, BUG, REFUSAL], EXPECTED) == [BUG]
    assert unexpected_errors([REFUSAL]) == [REFUSAL]  # not expected unless listed
    # Flower's own format and Python's bare last-resort line are ERROR lines too.
    assert unexpected_errors(["ERROR :      Exception in ServerApp", "CRITICAL boom"]) == [
        "ERROR :      Exception in ServerApp",
        "CRITICAL boom",
    ]
    assert log_check([]).ok
    bad = log_check([f"st-02.log: {BUG}"])
    assert not bad.ok and bad.figure.startswith("1 unexpected ERROR line(s), first: st-02.log:")


def test_the_runner_prints_records_and_fails_on_a_failed_check(tmp_path: Path) -> None:
    summary = {k: v for k, v in PASSING.items() if k not in ("federated", "superlink_front")}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "report.md").write_text("# fedge demo report\n")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "st-02.log").write_text("\n".join([*LOG, BUG]) + "\n")
    measured = {k: PASSING[k] for k in ("federated", "superlink_front")}
    console = Console(record=True, width=200)

    results = check_story(
        tmp_path, measured, ["2026-11-27 19:00:00,000 ERROR fedge.x: own"], console
    )

    assert [r.name for r in results if not r.ok] == ["no ERROR line but the expected refusals"]
    assert results[-1].figure.startswith("2 unexpected ERROR line(s), first: st-02.log: 2026")
    printed = console.export_text()
    assert "FAILED logs: no ERROR line but the expected refusals" in printed
    assert "the demo: 2026-11-27 19:00:00,000 ERROR fedge.x: own" in printed
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["federated"] == PASSING["federated"]
    assert [c["ok"] for c in written["checks"]].count(False) == 1
    report = (tmp_path / "report.md").read_text()
    assert "## The demo's own checks" in report and "- `ok     privacy: epsilon st-01" in report
    with pytest.raises(StoryCheckFailed, match=r"1 of 20 checks FAILED \(logs: no ERROR"):
        raise_if_failed(results, tmp_path)
    raise_if_failed([r for r in results if r.ok], tmp_path)  # all ok: nothing raised


def test_fedge_demo_exits_1_with_one_line_when_a_check_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from typer.testing import CliRunner

    from fedge.cli.main import app
    from fedge.demo import fleet

    def story_missed(out: Path, *, console_port: int | None = None) -> int:
        raise StoryCheckFailed("the demo did not show what the README says: 1 of 13 checks")

    monkeypatch.setattr(fleet, "run_demo", story_missed)
    result = CliRunner().invoke(app, ["demo", "--out", "unused"])
    assert result.exit_code == 1
    assert result.output.strip() == (
        "error: the demo did not show what the README says: 1 of 13 checks"
    )


def test_the_revoked_stations_own_refusal_is_expected_and_no_other_stations() -> None:
    revoked = (
        "2026-11-27 20:29:09,770 ERROR fedge.transport.mqtt: mqtt st-09 -> 127.0.0.1:26831: "
        "broker refused the connection (the broker closed the connection before answering)"
    )
    other = revoked.replace("st-09", "st-01")
    assert unexpected_errors([revoked, other]) == [other]
