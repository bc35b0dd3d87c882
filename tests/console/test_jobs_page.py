"""The jobs pages: the fleet jobs the manager recorded, read from their run stores; each
station's held-out accuracy before and after, and the model the job produced."""

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, build_onnx_model, console_login, make_fleet_home

from fedge.aggregator.jobs.directory import RUNS_DB
from fedge.aggregator.jobs.run_store import PartyEvaluation, RunState, RunStore
from fedge.aggregator.rounds.record import RoundRecord
from fedge.console import views_store
from fedge.console.jobs import accuracy_chart
from fedge.edge_manager.fleet import edge_store
from fedge.edge_manager.scheduler import service
from fedge.edge_manager.scheduler.teams import TeamRole
from fedge.protocols.manifest import Lineage


def _job(fh: FleetHome, job_dir: Path, name: str, rounds: int) -> None:
    job_dir.mkdir(parents=True)
    store = RunStore(job_dir / RUNS_DB)
    store.create_run(f"{name}-1", "manifest", RunState.RUNNING)
    store.name_parties(f"{name}-1", {101: "st-01", 102: "st-02", 103: "st-03"})
    for r in range(1, rounds + 1):
        store.record_round(
            f"{name}-1",
            RoundRecord(
                r,
                (101, 102, 103),
                (101, 102),
                (103,) if r == 2 else (),
                (),
                4.0 + r,
                10.0 * r,
                2,
                True,
                30.0,
                tier=r % 2,
                eval_metrics={"accuracy": 0.6 + 0.1 * r},
            ),
        )
    store.record_evaluation(
        f"{name}-1", 0, [PartyEvaluation("st-01", 0.6, 40), PartyEvaluation("st-02", 0.7, 30)]
    )
    store.record_evaluation(
        f"{name}-1",
        rounds,
        [PartyEvaluation("st-01", 0.75, 40), PartyEvaluation("st-02", 0.68, 30)],
    )
    store.close()
    with fh.fleet() as fleet:
        fleet.registry.publish(
            build_onnx_model(job_dir / "model.onnx"),
            name="inspect",
            version=7,
            classes=("clean", "scratch"),
            positive_classes=("scratch",),
            lineage=Lineage(run_id=f"{name}-1"),
        )
        fleet.store.conn.execute(
            "INSERT INTO fleet_jobs (job_dir, name, model, prepared_at) VALUES (?,?,?,?)",
            (str(job_dir), name, "inspect:1", time.time()),
        )


@pytest.fixture
def fh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetHome]:
    root = tmp_path_factory.mktemp("jobs")
    fh = make_fleet_home(root)
    _job(fh, root / "jobs" / "learn", "learn", 3)
    with fh.fleet() as fleet:  # a job whose directory was removed since
        fleet.store.conn.execute(
            "INSERT INTO fleet_jobs (job_dir, name, model, prepared_at) VALUES (?,?,?,?)",
            (str(root / "gone"), "gone", "inspect:1", time.time() + 1),
        )
    yield fh
    fh.close()


def test_the_jobs_pages_show_rounds_tiers_late_parties_and_accuracy(fh: FleetHome) -> None:
    client, _ = console_login(fh, "viewer")
    listing = client.get("/jobs").text
    rows = re.findall(r'<tr data-job="(\d+)">(.*?)</tr>', listing, re.S)
    assert [re.search(r">([a-z]+)</a>", row).group(1) for _, row in rows] == ["gone", "learn"]  # type: ignore[union-attr]
    assert "missing" in rows[0][1] and "0.900" in rows[1][1] and "running" in rows[1][1]
    detail = client.get(f"/jobs/{rows[1][0]}").text
    assert re.findall(r'<tr data-round="(\d+)">', detail) == ["1", "2", "3"]
    second = detail.split('<tr data-round="2">', 1)[1].split("</tr>", 1)[0]
    assert "st-03" in second and "6.0 s" in second
    assert "<svg" in detail and detail.count("<circle") == 3
    assert client.get("/jobs/999").status_code == 404
    assert client.get("/jobs/not-a-number").status_code == 404


def test_the_chart_has_a_point_per_round_and_nothing_without() -> None:
    assert accuracy_chart([]) == ""
    svg = accuracy_chart([(1, 0.5), (2, 0.7)])
    assert svg.count("<circle") == 2 and "round 2" in svg and "<script" not in svg


def test_the_job_page_shows_each_station_before_and_after_and_the_model_it_produced(
    fh: FleetHome,
) -> None:
    client, _ = console_login(fh, "viewer")
    listing = client.get("/jobs").text
    job_id = re.findall(r'<tr data-job="(\d+)">', listing)[1]
    detail = client.get(f"/jobs/{job_id}").text
    stations = dict(re.findall(r'<tr data-station="([^"]+)">(.*?)</tr>', detail, re.S))
    assert "0.600" in stations["st-01"] and "0.750" in stations["st-01"]
    assert "+0.150" in stations["st-01"] and "-0.020" in stations["st-02"]
    assert 'href="/models/inspect/7"' in detail
    model = client.get("/models/inspect/7").text
    assert f'href="/jobs/{job_id}"' in model
    assert detail.count('class="tick"') == 3 + 5


def test_the_jobs_page_shows_a_member_only_their_teams_jobs(fh: FleetHome) -> None:
    with fh.fleet() as fleet:
        store = fleet.store
        learn_dir = next(j.job_dir for j in views_store.fleet_jobs(store) if j.name == "learn")
        paint_dir = str(Path(learn_dir).parent / "paint-job")
        store.conn.execute(
            "INSERT INTO fleet_jobs (job_dir, name, model, prepared_at) VALUES (?,?,?,?)",
            (paint_dir, "painted", "inspect:1", time.time() + 2),
        )
        if not edge_store.names(store):
            edge_store.enroll(store, "st-01", "0" * 64, 0.0)
        for team, admin in (("vision", "ana"), ("paint", "pia")):
            service.add_team(store, team, None, who="root", now=0.0)
            service.grant(store, team, admin, TeamRole.ADMIN, who="root", now=0.0)
        for team, who, job_dir in (("vision", "ana", learn_dir), ("paint", "pia", paint_dir)):
            service.submit_job(
                store, kind="be", team=team, stations="any 1", grace_s=60.0, max_preemptions=1,
                priority=0, job_dir=job_dir, who=who, now=1.0,
            )  # fmt: skip

    def names(client: object) -> dict[str, str]:
        listing = client.get("/jobs").text  # type: ignore[attr-defined]
        rows = re.findall(r'<tr data-job="(\d+)">(.*?)</tr>', listing, re.S)
        return {re.search(r">([a-z]+)</a>", row).group(1): job for job, row in rows}  # type: ignore[union-attr]

    ana, _ = console_login(fh, "viewer", "ana")
    seen = names(ana)
    assert sorted(seen) == ["gone", "learn"]  # hers, and one no team queued
    admin, _ = console_login(fh, "admin", "boss")
    every = names(admin)
    assert sorted(every) == ["gone", "learn", "painted"]
    assert ana.get(f"/jobs/{every['painted']}").status_code == 404
    assert ana.get(f"/jobs/{every['learn']}").status_code == 200
    pia, _ = console_login(fh, "operator", "pia")
    assert sorted(names(pia)) == ["gone", "painted"]
