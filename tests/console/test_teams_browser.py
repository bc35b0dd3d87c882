"""The teams page in a real Chromium (issue 31 item 4): a team's admin reads her team --
members with roles, the quota and the station-hours used in the last 24 hours -- and
grants a role through the page's form (CSRF token from the page); the grant is stored
and audited. Screenshot at 1600x1000 in the test's tmp dir (``screenshots/``), checked
for the table."""

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import Processes, free_port, make_fleet_home, port_open, wait_until
from PIL import Image
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select

from fedge.console import accounts, audit
from fedge.console.accounts import Role
from fedge.console.audit import Outcome
from fedge.edge_manager.scheduler import service, team_store
from fedge.edge_manager.scheduler import store as queue_store
from fedge.edge_manager.scheduler.lifecycle import JobState
from fedge.edge_manager.scheduler.teams import TeamRole

from .chromium import Shots, log_in, open_chromium, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    driver = open_chromium(tmp_path, (1600, 1000))
    try:
        yield driver
    finally:
        driver.quit()


def test_a_team_admin_reads_her_team_and_grants_a_role(
    tmp_path: Path, processes: Processes, browser: WebDriver
) -> None:
    shots = Shots(browser, tmp_path / "screenshots")
    fh = make_fleet_home(tmp_path, edges=("st-01", "st-02"))
    try:
        now = time.time()
        with fh.fleet() as fleet:
            store = fleet.store
            token = accounts.add_token(store, "ana", Role.OPERATOR)
            accounts.add_token(store, "bo", Role.VIEWER)
            service.add_team(store, "vision", 8.0, who="root", now=now)
            service.add_team(store, "paint", None, who="root", now=now)
            service.grant(store, "vision", "ana", TeamRole.ADMIN, who="root", now=now)
            service.grant(store, "paint", "pia", TeamRole.ADMIN, who="root", now=now)
            job = service.submit_job(
                store, kind="be", team="vision", stations="any 2", grace_s=60.0,
                max_preemptions=1, priority=0, job_dir="", who="ana", now=now - 7200,
            )  # fmt: skip
            queue_store.transition(
                store, job.job.job_id, JobState.RUNNING, who="scheduler", at=now - 7200
            )
        port = free_port()
        processes.start("console", "console", "--home", str(fh.home.root), "--port", str(port))
        wait_until(lambda: port_open(port), 120, "the console to listen")
        base = f"http://127.0.0.1:{port}"
        log_in(browser, base, token)
        browser.find_element(By.LINK_TEXT, "Teams").click()
        wait_for(browser, "the teams table", 10, lambda d: d.find_elements(By.ID, "teams"))
        rows = browser.find_elements(By.CSS_SELECTOR, "#teams tbody tr")
        assert [r.get_attribute("data-team") for r in rows] == ["vision"]  # not paint's
        row = rows[0]
        assert row.find_element(By.CSS_SELECTOR, '[data-field="quota"]').text == "8"
        used = float(row.find_element(By.CSS_SELECTOR, '[data-field="used"]').text)
        assert used == pytest.approx(4.0, abs=0.05)  # 2 stations for the last 2 hours
        assert "ana (admin)" in row.text

        row.find_element(By.CSS_SELECTOR, "form.grant input[name=member]").send_keys("bo")
        Select(row.find_element(By.CSS_SELECTOR, "form.grant select[name=role]")).select_by_value(
            "viewer"
        )
        row.find_element(By.CSS_SELECTOR, "form.grant button").click()
        wait_for(
            browser,
            "the grant's message",
            10,
            lambda d: "bo: viewer of team vision" in d.find_element(By.TAG_NAME, "body").text,
        )
        member = browser.find_element(By.CSS_SELECTOR, '#teams [data-member="bo"]')
        assert "bo (viewer)" in member.text and "granted by ana" in member.text
        with fh.fleet() as fleet:
            assert team_store.members(fleet.store, "vision") == {
                "ana": TeamRole.ADMIN, "bo": TeamRole.VIEWER,
            }  # fmt: skip
            granted = [e for e in audit.recent(fleet.store) if e.action == "team-grant"]
        assert [(e.who, e.target, e.outcome) for e in granted] == [("ana", "vision", Outcome.DONE)]

        table = browser.find_element(By.ID, "teams")
        box = table.rect
        path = shots.take("teams")
        image = Image.open(path).convert("RGB")
        # The window is 1600x1000; the screenshot is its viewport (less the browser's bar).
        assert browser.get_window_size() == {"width": 1600, "height": 1000}
        scale = image.size[0] / browser.execute_script("return window.innerWidth")
        assert image.size[0] == 1600 * scale
        # The table is on the screenshot and drawn: its box inside the viewport, with ink.
        assert (box["y"] + box["height"]) * scale <= image.size[1] and box["width"] > 400
        crop = image.crop(
            (int(box["x"] * scale), int(box["y"] * scale),
             int((box["x"] + box["width"]) * scale), int((box["y"] + box["height"]) * scale))
        )  # fmt: skip
        pixels = np.asarray(crop).reshape(-1, 3).astype(int)
        background = np.median(pixels, axis=0)
        assert (np.abs(pixels - background).sum(axis=1) > 100).mean() > 0.01
    finally:
        fh.close()
