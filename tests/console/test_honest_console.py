"""An honest console in a real Chromium (issue 30, items 1 and 2), over a real broker,
``fedge manager serve`` and agent processes and a ``fedge console`` process.

- Thresholds: where st-01's per-class ``scratch`` threshold overrides the default being
  set, the console warns; the threshold the table shows as deciding is the one the agent's
  ``/v1/status`` says it applies.
- States: every process of the fleet stopped, the fleet page turns the station stale and
  shows a banner within the stated time (freshness.stale_after_s + the console's poll);
  restarted, back to online and live.

Screenshots at 1600x1000 of each page in the test's tmp dir (``screenshots/``).
"""

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    FleetHome,
    Processes,
    agent_status,
    deploy,
    free_port,
    make_fleet_home,
    port_open,
    publish_model,
    wait_deploy_done,
    wait_until,
)
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from fedge.console.freshness import stale_after_s

from .chromium import Shots, cell, log_in, open_chromium, wait_for

pytestmark = pytest.mark.integration

EDGE = "st-01"
POLL_S = 0.5  # the console's live poll (create_app's default)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    driver = open_chromium(tmp_path, (1600, 1000))
    try:
        yield driver
    finally:
        driver.quit()


class Fleet:
    """The fleet's processes, each stopped and started again as an operator would."""

    def __init__(self, fh: FleetHome, processes: Processes, tmp_path: Path) -> None:
        self.fh, self.processes, self.tmp_path = fh, processes, tmp_path
        self.procs: list[object] = []
        self.starts = 0

    def start(self) -> None:
        fh, processes = self.fh, self.processes
        self.starts += 1
        broker = processes.start("broker", "manager", "broker")
        wait_until(lambda: port_open(fh.settings.broker_port), 15, "the managed broker")
        ready = self.tmp_path / f"serve-{self.starts}.ready"
        serve = processes.start("serve", "manager", "serve", "--ready-file", str(ready))
        wait_until(ready.exists, 30, "manager serve to be ready")
        agent = processes.start(EDGE, "agent", "run", "--config", str(fh.agents[EDGE]))
        # Stopped in this order, the agent's own "offline" reaches no one: the store keeps
        # saying "online", as after the thirteen minutes.
        self.procs = [serve, broker, agent]

    def stop(self) -> None:
        for proc in self.procs:
            self.processes.stop(proc)  # type: ignore[arg-type]


def banner(driver: WebDriver) -> str:
    element = driver.find_element(By.ID, "banner")
    return "" if not element.is_displayed() else str(element.text)


@pytest.mark.timeout(300)
def test_states_and_thresholds_are_the_ones_in_force(
    tmp_path: Path, processes: Processes, browser: WebDriver
) -> None:
    shots = Shots(browser, tmp_path / "screenshots")
    fh = make_fleet_home(tmp_path)
    http_port = free_port()
    fh.set_agent_option(EDGE, "http_port", http_port)
    processes.env["FEDGE_HOME"] = str(fh.home.root)
    processes.pidfiles.append(fh.home.root / "broker" / "mosquitto.pid")
    fleet = Fleet(fh, processes, tmp_path)
    try:
        publish_model(fh, 1)
        fleet.start()
        deployment = deploy(fh, 1, [EDGE])
        assert wait_deploy_done(fh, deployment, EDGE)["deploy_stage"] == "active"
        # st-01's own threshold for scratch (its only defect class): it decides, whatever
        # the default is.
        with fh.fleet() as manager:
            (per_class,) = manager.set_threshold([EDGE], 0.2, "scratch")
        wait_until(
            lambda: fh.edge_row(EDGE)["config_applied"], 20, "the per-class threshold applied",
            expect=lambda v: v == per_class.version,
        )  # fmt: skip

        home = str(fh.home.root)
        token = processes.cli(
            "console", "token", "add", "olga", "--role", "operator", "--home", home
        ).stdout.strip()
        port = free_port()
        processes.start("console", "console", "--home", home, "--port", str(port))
        wait_until(lambda: port_open(port), 15, "the console to listen")
        base = f"http://127.0.0.1:{port}"
        log_in(browser, base, token)
        wait_for(browser, "st-01 online and the page live", 15, lambda d: (
            cell(d, EDGE, "state") == "online"
            and d.find_element(By.ID, "live").text == "live"
        ))  # fmt: skip
        assert banner(browser) == ""
        assert cell(browser, "st-02", "state") == "never-seen"
        assert cell(browser, EDGE, "threshold").startswith("scratch 0.2 (per-class)")
        row = browser.find_element(By.CSS_SELECTOR, f'tr[data-edge="{EDGE}"]')
        assert row.find_element(By.NAME, "threshold").get_attribute("value") == "0.5"
        shots.take("fleet-online")

        # -- set the default where scratch has its own: warned, and the table shows the
        # threshold the station applies (its /v1/status), not the one just typed
        field = row.find_element(By.NAME, "threshold")
        field.clear()
        field.send_keys("0.6")
        row.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        wait_for(browser, "the override warning", 10, lambda d: d.find_elements(By.ID, "warning"))
        warning = browser.find_element(By.ID, "warning").text
        assert "scratch 0.2" in warning and "does not decide" in warning, warning
        v = per_class.version + 1
        wait_for(
            browser, "the default applied", 20, lambda d: cell(d, EDGE, "config") == f"v{v} / v{v}"
        )
        applied = agent_status(http_port)["thresholds"]
        assert applied["default_threshold"] == 0.6
        station_decides = applied["class_thresholds"].get("scratch", applied["default_threshold"])
        assert station_decides == 0.2
        assert cell(browser, EDGE, "threshold") == (
            f"scratch {station_decides:g} (per-class); default 0.6 decides no defect class"
        )
        shots.take("threshold-override-warning")
        browser.get(f"{base}/edges/{EDGE}")
        deciding = browser.find_element(By.CSS_SELECTOR, '#deciding tr[data-class="scratch"]')
        assert deciding.find_element(By.CSS_SELECTOR, '[data-field="deciding"]').text == "0.2"
        assert "its own threshold" in deciding.text
        classes = [o.get_attribute("value") for o in browser.find_elements(
            By.CSS_SELECTOR, "select[name=class_name] option")]  # fmt: skip
        assert classes == ["", "clean", "scratch"]
        shots.take("edge-deciding-thresholds")

        # -- every process stopped: stale, with a banner, within the stated time
        browser.get(base)
        wait_for(
            browser, "the live stream", 10, lambda d: d.find_element(By.ID, "live").text == "live"
        )
        fleet.stop()
        stopped_at = time.monotonic()
        allowed = stale_after_s() + 4 * POLL_S + 2.0  # the rule, the poll, the agent's last batch
        wait_for(browser, "st-01 shown stale with a banner", allowed + 5, lambda d: (
            cell(d, EDGE, "state") == "stale" and "not running" in banner(d)
        ))  # fmt: skip
        took = time.monotonic() - stopped_at
        assert took <= allowed, f"stale shown after {took:.1f} s, stated {allowed:.1f} s"
        print(f"stale shown {took:.1f} s after the fleet stopped (stated: {allowed:.1f} s)")
        assert browser.find_element(By.ID, "live").text == "not live"
        assert "1 station stale" in banner(browser) and EDGE in banner(browser)
        assert "pending" not in cell(browser, EDGE, "sync")
        shots.take("fleet-stale-banner")

        # -- restarted: online and live again, on the same open page
        browser.execute_script("window.fedgeSamePage = true")
        fleet.start()
        wait_for(browser, "st-01 online and live again", 30, lambda d: (
            cell(d, EDGE, "state") == "online"
            and d.find_element(By.ID, "live").text == "live"
            and banner(d) == ""
        ))  # fmt: skip
        assert browser.execute_script("return window.fedgeSamePage") is True
        ago = browser.find_element(By.CSS_SELECTOR, f'tr[data-edge="{EDGE}"] td[data-field="ago"]')
        assert ago.text.endswith("s ago") or ago.text == "just now", ago.text
        shots.take("fleet-back-online")
    finally:
        fleet.stop()
        fh.close()
