"""The fleet page's table: the same cells as each edge's own view, in a few queries,
sorted and filtered on the server from the query string."""

import re
import time
from collections.abc import Iterator

import pytest
from conftest import FleetHome, console_login, make_fleet_home, publish_model, set_threshold

from fedge.bench.console_fleet import fill, plan, publish_models
from fedge.console.fleet_table import ALL_ROWS, TableQuery, fleet_table
from fedge.console.views import fleet_row
from fedge.edge_manager.ingest.messages import Ingestor
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.protocols import codec, topics
from fedge.protocols.config import ConfigReport, ConfigStatus
from fedge.protocols.liveness import EdgeState, Liveness

EDGES = ("st-01", "st-02", "st-03", "line-9")


@pytest.fixture
def fh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetHome]:
    """Four edges in different states: online serving inspect:1 with predictions, labels
    and a gap; online with a config applied; lost; never seen."""
    fh = make_fleet_home(tmp_path_factory.mktemp("table"), edges=EDGES)
    publish_model(fh, 1)
    ingestor = Ingestor(fh.db, fh.settings.fleet)
    now = time.time()
    v = set_threshold(fh, "st-02", 0.7)

    def status(edge: str, kind: topics.Up, payload: bytes) -> None:
        with IngestTransaction.open(fh.db) as tx:
            ingestor.handle(tx, topics.up(fh.settings.fleet, edge, kind), payload, now)

    for edge, state, serving in (
        ("st-01", EdgeState.ONLINE, "inspect:1"),
        ("st-02", EdgeState.ONLINE, ""),
        ("st-03", EdgeState.ONLINE, "inspect:1"),
    ):
        status(edge, topics.Up.STATE, codec.encode(Liveness(edge, 1, state, "0", serving, 0, now)))
    status("st-03", topics.Up.STATE, codec.encode(Liveness("st-03", 1, EdgeState.LOST, "0")))
    report = ConfigReport("st-02", ConfigStatus.APPLIED, v, v, "", now)
    status("st-02", topics.Up.CONFIG, codec.encode(report))
    with fh.db.transaction() as conn:
        for index, decision in enumerate(["reject", "accept", "accept", "reject"]):
            conn.execute(
                "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, "
                "decision, threshold, config_version, latency_ms, source) "
                "VALUES (?, 'st-01', ?, ?, 'inspect:1', '{}', ?, 0.5, 0, 1.0, '')",
                (f"p-{index}", index, now - index, decision),
            )
        conn.execute(
            "INSERT INTO labels (label_id, prediction_id, edge, label, who, at, origin) "
            "VALUES ('l-1', 'p-0', 'st-01', 'scratch', 'op', ?, 'manager')",
            (now,),
        )
        conn.execute(
            "INSERT INTO gaps (edge, stream, from_seq, to_seq, detected_at) "
            "VALUES ('st-01', 'predictions', 5, 7, ?)",
            (now,),
        )
    yield fh
    fh.close()


def test_the_table_has_exactly_the_cells_of_each_edges_own_view(fh: FleetHome) -> None:
    with fh.fleet() as fleet:
        table = fleet_table(fleet)
        one_by_one = {edge: fleet_row(fleet, fleet.show(edge)) for edge in EDGES}
    assert [row.edge for row in table.rows] == sorted(EDGES)
    for row in table.rows:
        assert row == one_by_one[row.edge], row.edge
    st01 = next(r for r in table.rows if r.edge == "st-01").cells
    assert (st01["predictions"], st01["reject_rate"], st01["agreement"]) == ("4", "50%", "100%")
    assert st01["gaps"] == "1 (3 batches)"
    st02 = next(r for r in table.rows if r.edge == "st-02").cells
    assert st02["threshold"] == "0.7" and st02["sync"] == "in sync"


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, ["line-9", "st-01", "st-02", "st-03"]),
        ({"sort": "edge", "desc": "1"}, ["st-03", "st-02", "st-01", "line-9"]),
        ({"state": "online"}, ["st-01", "st-02"]),
        ({"state": "lost"}, ["st-03"]),
        ({"state": "never-seen"}, ["line-9"]),
        ({"model": "inspect:1"}, ["st-01", "st-03"]),
        ({"q": "ST-0", "state": "online"}, ["st-01", "st-02"]),
        # Rows without a value (no predictions) come last, whichever the direction.
        ({"sort": "reject_rate", "desc": "1"}, ["st-01", "line-9", "st-02", "st-03"]),
        ({"sort": "predictions", "desc": "1"}, ["st-01", "line-9", "st-02", "st-03"]),
        # A hand-edited URL falls back to the defaults instead of failing.
        ({"sort": "token_sha256", "state": "hacked"}, ["line-9", "st-01", "st-02", "st-03"]),
    ],
)
def test_sorting_and_filtering(fh: FleetHome, params: dict[str, str], expected: list[str]) -> None:
    with fh.fleet() as fleet:
        table = fleet_table(fleet, TableQuery.parse(params))
    assert [row.edge for row in table.rows] == expected
    assert table.total == 4


def test_the_page_sorts_and_filters_from_its_query_string(fh: FleetHome) -> None:
    client, _ = console_login(fh, "viewer")
    shown = client.get("/", params={"state": "online", "sort": "edge", "desc": "1"})
    assert shown.status_code == 200
    edges = re.findall(r'<tr data-edge="([^"]+)"', shown.text)
    assert edges == ["st-02", "st-01"]
    assert "1-2 of 2 matching (4 edges)" in shown.text
    assert 'aria-sort="descending"' in shown.text
    none = client.get("/", params={"q": "nothing-like-this"})
    assert "No edge matches this filter." in none.text


@pytest.fixture(scope="module")
def plant(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetHome]:
    """130 stations in the bench's plant-like states (bench/console_fleet.py), through the
    manager's real ingest."""
    root = tmp_path_factory.mktemp("plant")
    fh = make_fleet_home(root, edges=())
    with fh.fleet() as fleet:
        publish_models(fleet, root)
        fill(fleet, [plan(i) for i in range(1, 131)], time.time())
    yield fh
    fh.close()


def test_a_page_holds_its_share_of_the_sorted_filtered_rows(plant: FleetHome) -> None:
    with plant.fleet() as fleet:
        every = fleet_table(fleet, TableQuery.parse({"per": "1000"}))
        second = fleet_table(fleet, TableQuery.parse({"per": "50", "page": "2"}))
        past = fleet_table(fleet, TableQuery.parse({"per": "50", "page": "99"}))
        lost = fleet_table(fleet, TableQuery.parse({"state": "lost", "per": "50"}))
        bad = fleet_table(fleet, TableQuery.parse({"per": "7", "page": "-1"}))
    names = [row.edge for row in every.rows]
    assert len(names) == every.matched == every.total == 130 and every.pages == 1
    assert [row.edge for row in second.rows] == names[50:100]
    assert (second.page, second.pages, second.first, second.last) == (2, 3, 51, 100)
    # Past the end shows the last page; the health still covers every station.
    assert [row.edge for row in past.rows] == names[100:]
    assert (past.page, past.first, past.last) == (3, 101, 130)
    assert past.health == every.health
    # Filters apply before paging: the count is of the matching rows.
    assert lost.matched == sum(row.state == "lost" for row in every.rows) > 0
    assert all(row.state == "lost" for row in lost.rows)
    # A hand-edited page size or page falls back to the defaults.
    assert (bad.query.per_page, bad.page, len(bad.rows)) == (100, 1, 100)


def test_the_pager_keeps_the_view_and_the_page_says_what_it_cost(plant: FleetHome) -> None:
    client, _ = console_login(plant, "viewer")
    shown = client.get("/", params={"sort": "edge", "desc": "1", "per": "50", "page": "2"})
    assert shown.status_code == 200
    assert len(re.findall(r'<tr data-edge="', shown.text)) == 50
    assert "51-100 of 130 edges" in shown.text
    assert "page 2 of 3" in shown.text
    assert 'href="?sort=edge&amp;desc=1&amp;page=3&amp;per=50" rel="next"' in shown.text
    assert 'href="?sort=edge&amp;desc=1&amp;page=1&amp;per=50" rel="prev"' in shown.text
    assert 'href="?sort=edge&amp;desc=1&amp;page=1&amp;per=250"' in shown.text
    # Server-Timing (W3C): the store read and the render, measured apart.
    timing = dict(part.strip().split(";dur=") for part in shown.headers["server-timing"].split(","))
    assert set(timing) == {"data", "render"} and all(float(v) >= 0 for v in timing.values())


def test_the_live_feed_carries_every_edge_whatever_page_is_shown(plant: FleetHome) -> None:
    with plant.fleet() as fleet:
        every = fleet_table(fleet, TableQuery(per_page=ALL_ROWS))
    assert len(every.rows) == every.matched == 130
    assert (every.page, every.pages, every.first, every.last) == (1, 1, 1, 130)
