"""The label queue in a real Chromium (issue 30, item 4), over a real broker, manager
service, agent and ``fedge console`` process: an operator labels ten parts by keyboard
without a page reload, undoes one (withdrawn) and labels it again; the labels are stored
once each and reach the station. Screenshots at 1600x1000 in the test's tmp dir."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    Processes,
    agent_status,
    deploy,
    drop_images,
    free_port,
    make_fleet_home,
    port_open,
    publish_model,
    wait_deploy_done,
    wait_until,
)
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver

from fedge.edge_manager.serve import ManagerService

from .chromium import Shots, log_in, open_chromium, wait_for

pytestmark = pytest.mark.integration

EDGE = "st-01"


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    driver = open_chromium(tmp_path, (1600, 1000))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.mark.timeout(300)
def test_ten_labels_by_keyboard_with_an_undo(
    tmp_path: Path, processes: Processes, browser: WebDriver
) -> None:
    shots = Shots(browser, tmp_path / "screenshots")
    fh = make_fleet_home(tmp_path)
    http_port = free_port()
    fh.set_agent_option(EDGE, "http_port", http_port)
    broker = fh.broker()
    broker.start()
    service = ManagerService(fh.home)
    try:
        service.start()
        publish_model(fh, 1)
        processes.start(EDGE, "agent", "run", "--config", str(fh.agents[EDGE]))
        assert wait_deploy_done(fh, deploy(fh, 1, [EDGE]), EDGE)["deploy_stage"] == "active"
        drop_images(fh.inbox(EDGE), "queue", 12)
        wait_until(
            lambda: fh.db.scalar("SELECT count(*) FROM predictions WHERE edge=?", (EDGE,)),
            30, "st-01's 12 predictions at the manager", expect=lambda n: n == 12,
        )  # fmt: skip
        home = str(fh.home.root)
        token = processes.cli(
            "console", "token", "add", "lena", "--role", "operator", "--home", home
        ).stdout.strip()
        port = free_port()
        processes.start("console", "console", "--home", home, "--port", str(port))
        wait_until(lambda: port_open(port), 15, "the console to listen")
        base = f"http://127.0.0.1:{port}"
        log_in(browser, base, token)
        browser.get(f"{base}/labels")
        assert browser.find_element(By.ID, "queue-total").text == "12 unlabelled"
        assert "smallest margin first" in browser.find_element(By.ID, "queue-rule").text
        margins = [
            float(e.text)
            for e in browser.find_elements(By.CSS_SELECTOR, '#queue td[data-field="margin"]')
        ]
        assert margins == sorted(margins) and len(margins) == 12
        first = browser.find_element(By.CSS_SELECTOR, "#queue select[name=label]")
        assert first.get_attribute("value") == ""  # nothing preselected
        shots.take("label-queue")
        browser.execute_script("window.fedgeSamePage = true")  # gone if the page reloads

        def labelled(n: int) -> None:
            wait_for(browser, f"{n} labels", 10, lambda d: d.find_element(
                By.TAG_NAME, "body").get_attribute("data-labelled") == str(n))  # fmt: skip

        for n in range(1, 11):  # "2" picks scratch, Enter labels and moves on
            ActionChains(browser).send_keys("2").send_keys(Keys.ENTER).perform()
            labelled(n)
        assert browser.find_element(By.ID, "queue-total").text == "2 unlabelled"
        ActionChains(browser).send_keys("u").perform()  # the tenth comes back...
        # ...once the manager has withdrawn its label (an undo is a request, not a redraw).
        wait_for(browser, "the undo", 10, lambda d: d.find_element(
            By.ID, "queue-total").text == "3 unlabelled")  # fmt: skip
        ActionChains(browser).send_keys("1").send_keys(Keys.ENTER).perform()  # ...as clean
        labelled(11)
        # The undo withdrew the tenth's label (here and at the station): this is a new one.
        assert "labelled clean" in browser.find_element(By.ID, "label-status").text
        assert browser.execute_script("return window.fedgeSamePage") is True
        shots.take("labelled-ten-undo-one")
        rows = fh.db.query("SELECT label FROM labels WHERE who='lena' ORDER BY at")
        assert [r["label"] for r in rows] == ["scratch"] * 9 + ["clean"]
        # A delivery bound, not a measurement: the serve loop publishes the labels document
        # on its next pass, which a loaded host (the suite's three workers) can push past 20 s.
        wait_until(
            lambda: agent_status(http_port)["counters"], 60, "the labels at the station",
            expect=lambda c: c.get("labels.from_manager", 0) >= 11,
        )  # fmt: skip
    finally:
        service.stop()
        broker.stop()
        fh.close()
