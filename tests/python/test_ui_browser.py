"""The run-control web UI in a real browser: headless Chromium (Debian `chromium` +
`chromium-driver`) loads the page, clicks INIT, CONFIGURE and START, sees RUNNING and
non-zero rates, sends an alert from the form and sees every builder's answer, saves a
screenshot, clicks STOP and sees the run in the history."""

import os
import pathlib
import shutil

import pytest

from conftest import ROOT
from shoal_cluster import Cluster

SCREENSHOT_DIR = pathlib.Path(os.environ.get("SHOAL_TEST_OUTPUT", ROOT / "test-output"))


def chromium_paths():
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return browser, driver


@pytest.fixture
def browser():
    b, d = chromium_paths()
    if not (b and d):
        pytest.skip("chromium and chromium-driver are not installed (make deps installs them when root)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = b
    for flag in [
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-extensions",
        "--no-first-run",
        "--window-size=1400,1600",
    ]:
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=d), options=opts)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def test_ui_drives_a_run(shoal_bin, tmp_path, browser):
    c = Cluster(shoal_bin, tmp_path)
    try:
        _drive(c, browser)
    except Exception as e:
        # One failure (a selenium exception after about a minute) was seen once and never
        # again in a dozen runs: keep what run control and the page knew, to find it.
        try:
            status = c.status()
            seen = {k: status.get(k) for k in ("state", "busy", "run")}
            log = status.get("log", [])[-15:]
        except Exception as s:  # noqa: BLE001
            seen, log = f"status unreadable: {s!r}", []
        page = browser.execute_script("return document.getElementById('state')?.textContent")
        raise AssertionError(f"{e!r}\nrun control: {seen}\npage state: {page}\nlog: {log}") from e
    finally:
        c.close()


def _drive(c, browser):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(c.url + "/")
    # The page re-renders its tables on every status push: read them with one script
    # call each, and let waits retry on elements replaced under them.
    wait = WebDriverWait(browser, 60, poll_frequency=0.2, ignored_exceptions=[StaleElementReferenceException])
    js = browser.execute_script
    state = lambda: browser.find_element(By.ID, "state").text  # noqa: E731
    wait.until(lambda _: state() == "IDLE")

    def click(command, then_state):
        wait.until(lambda _: browser.find_element(By.ID, "cmd-" + command).is_enabled())
        browser.find_element(By.ID, "cmd-" + command).click()
        wait.until(lambda _: state() == then_state)

    click("INIT", "STANDBY")
    click("CONFIGURE", "READY")
    # CONFIGURE measured every process's clock: the column shows offset -> residual +- bound,
    # and the tolerance rule's verdict is under the table.
    clocks = lambda: js("return [...document.querySelectorAll('#processes tbody .clock')].map(e => e.textContent)")  # noqa: E731
    wait.until(lambda _: len(clocks()) == 9 and all("\u00b1" in t for t in clocks()))
    assert "clock skew" in js("return document.getElementById('clock-verdict').textContent")
    click("START", "RUNNING")
    # Non-zero rates, as the page shows them (the status the page rendered last).
    rate = lambda key: browser.execute_script(  # noqa: E731
        "const s = window.shoalStatus; return s ? s.processes.filter(p => p.role === 'builder')"
        ".reduce((a, p) => a + p.rates[arguments[0]], 0) : 0;",
        key,
    )
    wait.until(lambda _: rate("slices_complete_per_s") > 0 and rate("mbytes_per_s") > 0)
    wait.until(lambda _: float(js("return document.querySelector('#total-slicess b').textContent")) > 0)
    states = js("return [...document.querySelectorAll('#processes tbody .pstate')].map(e => e.textContent)")
    assert states == ["RUNNING"] * 9, states
    # Let the charts gather a few points, then keep a picture of the running system.
    wait.until(lambda _: browser.execute_script("return document.querySelectorAll('.uplot').length") == 4)
    # The alert form: a one-second window that ended a second ago; every builder answers.
    for field, value in (("alert-name", "ui-test"), ("alert-ago", "2"), ("alert-length", "1")):
        el = browser.find_element(By.ID, field)
        el.clear()
        el.send_keys(value)
    browser.find_element(By.ID, "alert-send").click()
    wait.until(lambda _: js("return document.querySelectorAll('#alerts tbody tr').length") == 3)
    rows = js("return [...document.querySelectorAll('#alerts tbody tr')].map(e => e.textContent)")
    assert all("ui-test" in r and "nothing" in r for r in rows), rows
    import time

    time.sleep(3)
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOT_DIR / "run-control-ui.png"
    assert browser.save_screenshot(str(shot)), "screenshot failed"
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")

    click("STOP", "READY")
    wait.until(lambda _: js("return document.querySelectorAll('#history tbody tr').length") == 1)
    row = js("return document.querySelector('#history tbody tr').textContent")
    assert "balanced" in row and "NOT" not in row, row
    wait.until(lambda _: browser.find_element(By.ID, "cmd-OFF").is_enabled())
    browser.find_element(By.ID, "cmd-OFF").click()
    # OFF switches every process off and ends `shoal run` itself.
    assert c.proc.wait(timeout=90) == 0
