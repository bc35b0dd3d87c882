"""The image beside every label (issue 30, item 3) in a real Chromium, over a real broker,
manager service, two agents with their image endpoints on mutual TLS, and a `fedge
console` process. An admin allows operator viewing on st-01's edge page; an operator
labels ten of its parts by keyboard with each part's image shown (fetched from the
station on demand), undoes one -- the withdrawal reaches the station -- and labels it
again. On st-02 viewing stays off: the queue says why and how to label at the station,
and st-02's own counters show no image byte left it. Every view is in the audit log.
Screenshots at 1600x1000 in the test's tmp dir."""

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

ON, OFF = "st-01", "st-02"
SHOWN = "#queue tr.focused figure.station-image.shown img"


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    driver = open_chromium(tmp_path, (1600, 1000))
    try:
        yield driver
    finally:
        driver.quit()


def _shown(driver: WebDriver) -> bool:
    images = driver.find_elements(By.CSS_SELECTOR, SHOWN)
    return bool(images) and bool(
        driver.execute_script("return arguments[0].naturalWidth > 0", images[0])
    )


@pytest.mark.timeout(420)
def test_label_ten_with_their_images_undo_one_and_viewing_off_elsewhere(
    tmp_path: Path, processes: Processes, browser: WebDriver
) -> None:
    shots = Shots(browser, tmp_path / "screenshots")
    fh = make_fleet_home(tmp_path, [ON, OFF])
    http = {edge: free_port() for edge in (ON, OFF)}
    for edge in (ON, OFF):
        fh.set_agent_option(edge, "http_port", http[edge])
        fh.set_agent_option(edge, "image_port", free_port())
    broker = fh.broker()
    broker.start()
    service = ManagerService(fh.home)
    try:
        service.start()
        publish_model(fh, 1)
        for edge in (ON, OFF):
            processes.start(edge, "agent", "run", "--config", str(fh.agents[edge]))
        deployment = deploy(fh, 1, [ON, OFF])
        for edge in (ON, OFF):
            assert wait_deploy_done(fh, deployment, edge)["deploy_stage"] == "active"
        drop_images(fh.inbox(ON), "on", 12)
        drop_images(fh.inbox(OFF), "off", 3, seed=1)
        wait_until(
            lambda: fh.db.scalar("SELECT count(*) FROM predictions"), 30,
            "15 predictions at the manager", expect=lambda n: n == 15,
        )  # fmt: skip
        wait_until(
            lambda: fh.db.scalar("SELECT count(*) FROM edges WHERE images_at != ''"), 20,
            "both stations' image addresses", expect=lambda n: n == 2,
        )  # fmt: skip
        home = str(fh.home.root)
        tokens = {
            name: processes.cli(
                "console", "token", "add", name, "--role", role, "--home", home
            ).stdout.strip()
            for name, role in (("ada", "admin"), ("lena", "operator"))
        }
        port = free_port()
        processes.start("console", "console", "--home", home, "--port", str(port))
        wait_until(lambda: port_open(port), 15, "the console to listen")
        base = f"http://127.0.0.1:{port}"

        # The operator cannot allow viewing; the admin can, on the edge page.
        log_in(browser, base, tokens["lena"])
        browser.get(f"{base}/edges/{ON}")
        assert browser.find_element(By.ID, "viewing-state").get_attribute("data-allowed") == "no"
        assert not browser.find_element(By.CSS_SELECTOR, "form.viewing button").is_enabled()
        browser.delete_all_cookies()
        log_in(browser, base, tokens["ada"])
        browser.get(f"{base}/edges/{ON}")
        choice = browser.find_element(By.CSS_SELECTOR, "form.viewing select[name=viewing]")
        choice.find_element(By.CSS_SELECTOR, "option[value=allow]").click()
        browser.find_element(By.CSS_SELECTOR, "form.viewing button").click()
        wait_for(browser, "viewing allowed", 10, lambda d: d.find_element(
            By.ID, "viewing-state").get_attribute("data-allowed") == "yes")  # fmt: skip
        shots.take("edge-viewing-allowed")
        desired = fh.db.scalar(
            "SELECT max(version) FROM desired WHERE edge=? AND kind='config'", (ON,)
        )
        wait_until(
            lambda: agent_status(http[ON])["config_version"], 20,
            "st-01 to apply the signed config that allows viewing",
            expect=lambda v: v == desired,
        )  # fmt: skip

        browser.delete_all_cookies()
        log_in(browser, base, tokens["lena"])
        browser.get(f"{base}/labels?edge={ON}")
        assert browser.find_element(By.ID, "queue-total").text == "12 unlabelled"
        assert not browser.find_elements(By.ID, "viewing-off")
        wait_for(browser, "the first part's image", 10, _shown)
        shots.take("label-queue-with-images")
        assert browser.get_window_size() == {"width": 1600, "height": 1000}
        assert browser.find_element(By.CSS_SELECTOR, SHOWN).is_displayed()
        browser.execute_script("window.fedgeSamePage = true")  # gone if the page reloads

        def labelled(n: int) -> None:
            wait_for(browser, f"{n} labels", 10, lambda d: d.find_element(
                By.TAG_NAME, "body").get_attribute("data-labelled") == str(n))  # fmt: skip

        for n in range(1, 11):  # "2" picks scratch, Enter labels and shows the next image
            ActionChains(browser).send_keys("2").send_keys(Keys.ENTER).perform()
            labelled(n)
            assert _shown(browser), f"the image of the item after label {n} is not shown"
        label_ms = browser.execute_script("return window.fedgeLabelMs")
        assert len(label_ms) == 10 and all(ms > 0 for ms in label_ms)
        shots.take("labelled-ten-with-images")
        wait_until(
            lambda: agent_status(http[ON])["station"]["labelled"], 30,
            "ten labels in st-01's training set", expect=lambda n: n == 10,
        )  # fmt: skip

        ActionChains(browser).send_keys("u").perform()  # the tenth is withdrawn...
        wait_for(browser, "the undo", 10, lambda d: d.find_element(
            By.TAG_NAME, "body").get_attribute("data-withdrawn") == "1")  # fmt: skip
        assert browser.find_element(By.ID, "queue-total").text == "3 unlabelled"
        assert "withdrawn" in browser.find_element(By.ID, "label-status").text
        counters = wait_until(
            lambda: agent_status(http[ON]), 30, "the withdrawal at st-01",
            expect=lambda s: s["counters"].get("labels.withdrawn", 0) >= 1,
        )  # fmt: skip
        assert counters["station"]["labelled"] == 9
        ActionChains(browser).send_keys("1").send_keys(Keys.ENTER).perform()  # ...then clean
        labelled(11)
        assert browser.execute_script("return window.fedgeSamePage") is True
        rows = fh.db.query("SELECT label FROM labels WHERE who='lena' ORDER BY at")
        assert [r["label"] for r in rows] == ["scratch"] * 9 + ["clean"]
        wait_until(
            lambda: agent_status(http[ON])["station"]["labelled"], 30,
            "the tenth label again at st-01", expect=lambda n: n == 10,
        )  # fmt: skip

        # Every image the page showed was a view in the audit log, by lena, of st-01.
        shown_ids = browser.execute_script(
            "return Array.from(document.querySelectorAll('figure.station-image.shown'))"
            ".map(f => f.closest('tr').dataset.prediction)"
        )
        assert len(shown_ids) >= 11
        views = fh.db.query(
            "SELECT who, target, outcome, detail FROM console_audit WHERE action='view-image'"
        )
        done = {v["target"] for v in views if v["outcome"] == "done" and v["who"] == "lena"}
        assert {f"{ON}/{pid}" for pid in shown_ids} <= done
        sent = agent_status(http[ON])["counters"]
        assert sent["images.sent"] >= len(shown_ids) and sent["images.bytes_sent"] > 0

        # st-02: viewing is off (the default). The queue says so and how to label there.
        browser.get(f"{base}/labels?edge={OFF}")
        notice = browser.find_element(By.ID, "viewing-off").text
        assert OFF in notice and "fedge agent label" in notice and "policy" in notice
        assert not browser.find_elements(By.CSS_SELECTOR, "figure.station-image")
        assert browser.find_elements(By.CSS_SELECTOR, '#queue [data-viewing="off"]')
        shots.take("label-queue-viewing-off")
        pid = fh.db.scalar("SELECT prediction_id FROM predictions WHERE edge=? LIMIT 1", (OFF,))
        asked = browser.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "fetch(arguments[0], {credentials: 'same-origin'})"
            ".then(r => r.json().then(b => done([r.status, b.reason])))",
            f"/edges/{OFF}/images/{pid}",
        )
        assert asked == [403, "policy_off"]
        unknown = browser.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "fetch(arguments[0], {credentials: 'same-origin'})"
            ".then(r => r.json().then(b => done([r.status, b.reason])))",
            f"/edges/{ON}/images/p-never-scored",
        )
        assert unknown == [404, "unknown_prediction"]
        off = agent_status(http[OFF])["counters"]
        assert off.get("images.sent", 0) == 0 and off.get("images.bytes_sent", 0) == 0
        refused = fh.db.query(
            "SELECT outcome FROM console_audit WHERE action='view-image' AND target=?",
            (f"{OFF}/{pid}",),
        )
        assert [r["outcome"] for r in refused] == ["refused"]
    finally:
        service.stop()
        broker.stop()
        fh.close()
