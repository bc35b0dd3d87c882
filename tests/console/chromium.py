"""Real-Chromium plumbing for the console's browser tests (issue 30): Debian's chromium
and chromium-driver (missing: the test fails, never skips), screenshots, table cells."""

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait


def open_chromium(tmp_path: Path, size: tuple[int, int] = (1600, 1000)) -> WebDriver:
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.fail(
            "the console's browser tests need Debian's chromium and chromium-driver "
            f"(found chromium={browser}, chromedriver={driver}); run `make setup` or "
            "`apt-get install -y chromium chromium-driver`"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in (
        "--headless=new",
        "--no-sandbox",  # tests run as root in a container
        "--disable-dev-shm-usage",
        f"--window-size={size[0]},{size[1]}",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(argument)
    chrome = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    chrome.set_window_size(*size)
    return chrome


class Shots:
    """Numbered screenshots of the browser's window, each after its page was checked."""

    def __init__(self, driver: WebDriver, directory: Path) -> None:
        self.driver, self.directory, self.count = driver, directory, 0
        directory.mkdir(parents=True, exist_ok=True)

    def take(self, name: str) -> Path:
        self.count += 1
        path = self.directory / f"{self.count:02d}-{name}.png"
        self.driver.save_screenshot(str(path))
        print(f"screenshot: {path}")
        return path


def cell(driver: WebDriver, edge: str, field: str) -> str:
    selector = f'tr[data-edge="{edge}"] td[data-field="{field}"]'
    return str(driver.find_element(By.CSS_SELECTOR, selector).text)


def log_in(driver: WebDriver, base: str, token: str) -> None:
    driver.get(f"{base}/login")
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.ID, "login").click()
    WebDriverWait(driver, 10).until(lambda d: d.find_elements(By.ID, "fleet"))


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
        shown = driver.find_element(By.TAG_NAME, "body").text
        pytest.fail(f"timed out after {timeout_s}s waiting for {what}: {exc!r}\npage:\n{shown}")
