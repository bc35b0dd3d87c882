"""The console in a real browser (issue 14): headless Chromium, driven by Selenium, against
a real broker, manager, agent and ``fedge console`` process.

An operator logs in, sets a threshold on one edge from the fleet page and sees the agent's
report of it applied; a threshold pushed elsewhere shows on the open page live; the
operator labels a prediction from the queue and it is stored and reaches the station; a
viewer's action is refused. Screenshots are kept under the test's tmp dir.
"""

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from conftest import (
    FleetHome,
    Processes,
    agent_status,
    deploy,
    drop_images,
    free_port,
    make_fleet_home,
    port_open,
    publish_model,
    set_threshold,
    wait_deploy_done,
    wait_until,
)
from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select, WebDriverWait

from fedge.edge_manager.serve import ManagerService

pytestmark = pytest.mark.integration

EDGE = "st-01"


def chromium() -> tuple[str, str]:
    """Debian's chromium and chromium-driver; missing, the test fails (it must not skip)."""
    browser = shutil.which("chromium")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.fail(
            "the console's browser test needs Debian's chromium and chromium-driver "
            f"(found chromium={browser}, chromedriver={driver}); run `make setup` or "
            "`apt-get install -y chromium chromium-driver`"
        )
    return browser, driver


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    binary, driver_path = chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in (
        "--headless=new",
        "--no-sandbox",  # tests run as root in a container
        "--disable-dev-shm-usage",
        "--window-size=1500,900",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


class Shots:
    def __init__(self, driver: WebDriver, directory: Path) -> None:
        self.driver = driver
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.count = 0

    def take(self, name: str) -> Path:
        self.count += 1
        path = self.directory / f"{self.count:02d}-{name}.png"
        self.driver.save_screenshot(str(path))
        print(f"screenshot: {path}")
        return path


def cell(driver: WebDriver, edge: str, field: str) -> str:
    selector = f'tr[data-edge="{edge}"] td[data-field="{field}"]'
    return str(driver.find_element(By.CSS_SELECTOR, selector).text)


def cell_of_edge_page(driver: WebDriver, field: str) -> str:
    return str(driver.find_element(By.CSS_SELECTOR, f'table.facts [data-field="{field}"]').text)


def log_in(driver: WebDriver, base: str, token: str) -> None:
    driver.get(f"{base}/login")
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.ID, "login").click()
    WebDriverWait(driver, 10).until(lambda d: d.find_elements(By.ID, "fleet"))


def expect_text(driver: WebDriver, element_id: str, fragment: str, timeout_s: float = 10) -> None:
    """Wait until the element ``element_id`` (on the page a form submission loads) says it."""

    def says(d: WebDriver) -> bool:
        return any(fragment in e.text for e in d.find_elements(By.ID, element_id))

    try:
        WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(says)
    except Exception:
        shown = driver.find_element(By.TAG_NAME, "body").text
        pytest.fail(
            f"#{element_id} never said {fragment!r}; the page at {driver.current_url}:\n{shown}"
        )


_NOT_YET = (NoSuchElementException, StaleElementReferenceException)


def wait_for(
    driver: WebDriver, what: str, timeout_s: float, condition: Callable[[WebDriver], object]
) -> None:
    try:
        # A form posts and the page reloads under the condition: an element found on the
        # old page goes stale, which means "not yet", not a failure.
        WebDriverWait(driver, timeout_s, poll_frequency=0.1, ignored_exceptions=_NOT_YET).until(
            condition
        )
    except Exception as exc:
        pytest.fail(f"timed out after {timeout_s}s waiting for {what}: {exc!r}")


@pytest.mark.timeout(300)
def test_an_operator_runs_the_fleet_from_the_browser(
    tmp_path: Path, processes: Processes, browser: WebDriver
) -> None:
    shots = Shots(browser, tmp_path / "screenshots")
    fh: FleetHome = make_fleet_home(tmp_path)
    http_port = free_port()
    fh.set_agent_option(EDGE, "http_port", http_port)
    broker = fh.broker()
    broker.start()
    service = ManagerService(fh.home)
    try:
        service.start()
        publish_model(fh, 1)
        agent = processes.start(EDGE, "agent", "run", "--config", str(fh.agents[EDGE]))
        deployment = deploy(fh, 1, [EDGE])
        assert wait_deploy_done(fh, deployment, EDGE)["deploy_stage"] == "active", agent.output()
        drop_images(fh.inbox(EDGE), "console", 3)

        home = str(fh.home.root)
        operator = processes.cli(
            "console", "token", "add", "alice", "--role", "operator", "--home", home
        ).stdout.strip()
        viewer = processes.cli("console", "token", "add", "victor", "--home", home).stdout.strip()
        admin = processes.cli(
            "console", "token", "add", "ada", "--role", "admin", "--home", home
        ).stdout.strip()
        port = free_port()
        console = processes.start("console", "console", "--home", home, "--port", str(port))
        wait_until(lambda: port_open(port), 15, "the console to listen")
        base = f"http://127.0.0.1:{port}"

        # -- an operator logs in and sets a threshold on st-01 from the fleet page
        log_in(browser, base, operator)
        assert cell(browser, EDGE, "state") == "online"
        assert cell(browser, EDGE, "serving") == "inspect:1"
        assert cell(browser, "st-02", "state") == "never-seen"
        shots.take("fleet-logged-in")
        row = browser.find_element(By.CSS_SELECTOR, f'tr[data-edge="{EDGE}"]')
        row.find_element(By.NAME, "threshold").clear()  # pre-filled with the one in force
        row.find_element(By.NAME, "threshold").send_keys("1.5")
        row.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        expect_text(browser, "error", "must be in [0, 1]")
        shots.take("threshold-refused")
        assert fh.row("SELECT version FROM desired WHERE kind='config'") == {}

        row = browser.find_element(By.CSS_SELECTOR, f'tr[data-edge="{EDGE}"]')
        row.find_element(By.NAME, "threshold").clear()  # pre-filled with the one in force
        row.find_element(By.NAME, "threshold").send_keys("0.72")
        row.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        expect_text(browser, "message", "desired config v1 (threshold 0.72)")
        browser.execute_script("window.fedgeSamePage = true")  # gone if the page reloads
        wait_for(
            browser,
            "the fleet page to show st-01's report of config v1 applied",
            15,
            lambda d: (
                (cell(d, EDGE, "config"), cell(d, EDGE, "sync"), cell(d, EDGE, "threshold"))
                == ("v1 / v1", "in sync", "0.72")
            ),
        )
        shots.take("threshold-applied")

        # -- a threshold pushed elsewhere (the CLI's library call) shows on the open page
        pushed_at = time.monotonic()
        version = set_threshold(fh, EDGE, 0.8)
        wait_for(
            browser,
            f"config v{version} applied, live on the open page",
            10,
            lambda d: (cell(d, EDGE, "config"), cell(d, EDGE, "threshold")) == ("v2 / v2", "0.8"),
        )
        print(f"live update: pushed to shown applied in {time.monotonic() - pushed_at:.2f} s")
        assert browser.execute_script("return window.fedgeSamePage") is True
        shots.take("threshold-live")
        browser.find_element(By.LINK_TEXT, EDGE).click()
        wait_for(browser, "the edge page", 10, lambda d: "Config history" in d.page_source)
        assert cell_of_edge_page(browser, "sync") == "in sync"
        shots.take("edge-page")

        # -- the label queue: label one prediction; it is stored and reaches the station
        wait_until(
            lambda: fh.db.scalar("SELECT count(*) FROM predictions WHERE edge=?", (EDGE,)),
            30,
            "st-01's predictions at the manager",
        )
        browser.find_element(By.LINK_TEXT, "Label queue").click()
        WebDriverWait(browser, 10).until(lambda d: d.find_elements(By.ID, "queue"))
        first = browser.find_element(By.CSS_SELECTOR, "tr[data-prediction]")
        prediction_id = str(first.get_attribute("data-prediction"))
        # By keyboard, as a labeler works: the first row has the focus; j moves down and
        # k back up, 2 picks the second class (scratch), Enter labels.
        keys = ActionChains(browser)
        keys.send_keys("j").send_keys("k").send_keys("2").perform()
        assert "focused" in str(first.get_attribute("class"))
        assert Select(first.find_element(By.NAME, "label")).first_selected_option.text == "scratch"
        ActionChains(browser).send_keys(Keys.ENTER).perform()
        expect_text(browser, "label-status", f"{prediction_id} labelled scratch")  # no reload
        shots.take("labelled")
        stored = fh.db.query(
            "SELECT label, who, origin FROM labels WHERE prediction_id=?", (prediction_id,)
        )
        assert stored == [{"label": "scratch", "who": "alice", "origin": "operator"}]
        wait_until(
            lambda: agent_status(http_port)["counters"],
            20,
            "the label to reach the station",
            expect=lambda counters: counters.get("labels.from_manager", 0) >= 1,
        )

        # -- a viewer cannot act: the form is disabled, and forcing it is refused (403)
        browser.find_element(By.ID, "logout").click()
        log_in(browser, base, viewer)
        row = browser.find_element(By.CSS_SELECTOR, f'tr[data-edge="{EDGE}"]')
        field = row.find_element(By.NAME, "threshold")
        assert field.get_attribute("disabled") is not None
        browser.execute_script(
            "arguments[0].querySelectorAll('[disabled]').forEach(e => e.disabled = false)", row
        )
        field.clear()
        field.send_keys("0.3")
        row.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        expect_text(browser, "error", "viewers cannot act")
        shots.take("viewer-refused")
        assert fh.row("SELECT max(version) AS v FROM desired WHERE kind='config'") == {"v": 2}

        # -- thumbnails: none until an admin lets st-01 share them on its page (the viewer
        # sees that form disabled); then the edge page and the label queue show the images
        # it scored, and nobody else can
        assert fh.db.scalar("SELECT count(*) FROM thumbnails") == 0
        browser.get(f"{base}/edges/{EDGE}")
        images = browser.find_element(By.CSS_SELECTOR, "form.thumbnails")
        assert images.find_element(By.NAME, "images").get_attribute("disabled") is not None
        browser.find_element(By.ID, "logout").click()
        log_in(browser, base, admin)
        browser.get(f"{base}/edges/{EDGE}")
        images = browser.find_element(By.CSS_SELECTOR, "form.thumbnails")
        Select(images.find_element(By.NAME, "images")).select_by_value("all")
        images.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        expect_text(browser, "message", "shares thumbnails of all scored images, 64 px, 30/min")
        wait_until(
            lambda: fh.row("SELECT config_applied FROM edges WHERE edge=?", (EDGE,)),
            15,
            "st-01 to apply the config that shares thumbnails",
            expect=lambda row: row["config_applied"] == 3,
        )
        drop_images(fh.inbox(EDGE), "shared", 2)
        wait_until(
            lambda: fh.db.scalar("SELECT count(*) FROM thumbnails WHERE edge=?", (EDGE,)),
            30,
            "st-01's thumbnails at the manager",
            expect=lambda n: n == 2,
        )
        browser.get(f"{base}/edges/{EDGE}")
        assert cell_of_edge_page(browser, "images").startswith("thumbnails of all scored images")
        thumbs = browser.find_elements(By.CSS_SELECTOR, "img.thumb")
        assert len(thumbs) == 2
        wait_for(
            browser,
            "the thumbnails to load",
            10,
            lambda d: all(
                d.execute_script("return arguments[0].naturalWidth", t) > 0 for t in thumbs
            ),
        )
        browser.execute_script("arguments[0].scrollIntoView()", thumbs[0])
        shots.take("edge-thumbnails")
        browser.find_element(By.LINK_TEXT, "Label queue").click()
        WebDriverWait(browser, 10).until(lambda d: d.find_elements(By.ID, "queue"))
        assert len(browser.find_elements(By.CSS_SELECTOR, "#queue img.thumb")) == 2
        first_thumb = browser.find_element(By.CSS_SELECTOR, "#queue img.thumb")
        src = str(first_thumb.get_attribute("src"))
        assert src.endswith(".png"), src
        anonymous = httpx.get(src)
        assert anonymous.status_code == 403, "a thumbnail without a session"
        missing = src.replace(f"/edges/{EDGE}/", "/edges/st-02/")
        browser.get(missing)
        assert "no such thumbnail" in browser.page_source, "another edge's thumbnail"
        assert console.running(), console.output()
    finally:
        service.stop()
        broker.stop()
        fh.close()
