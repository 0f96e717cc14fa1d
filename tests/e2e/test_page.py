"""serve's page (`/`) in a real headless Chromium (Debian's `chromium` and `chromium-driver`,
driven by Selenium): both ranks of a 2-rank serve shown ready; a message typed into the chat
box streams the API's own text; a killed rank shows as a restart, then ok again; with an API
key the page's calls without it are refused, with it they work. Screenshots of the page go to
docs/ (``MLX_CLUSTER_SCREENSHOTS=1``)."""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from tests.support.processes import ROOT, rank_pids

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
SHOTS = os.environ.get("MLX_CLUSTER_SCREENSHOTS") == "1"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (CHROMIUM and DRIVER) and not os.environ.get("CI"),
        reason="no chromium/chromium-driver here (CI installs them)",
    ),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A 2-rank serve of this module's own (a rank of it is killed)."""
    from tests.support.serving import Served
    from tests.support.tiny import make_model

    model = make_model(tmp_path_factory.mktemp("page") / "m", "qwen2", seed=2, chat_template=True)
    s = Served(model, links=True)
    s.model = model
    yield s
    s.stop()
    assert rank_pids() == []  # the ranks started again after the kill are gone too


@pytest.fixture(autouse=True)
def no_stray_ranks():  # the module's serve lives across its tests: checked at its end
    yield


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service as DriverService

    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1000",
                 "--disable-dev-shm-usage"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=DriverService(DRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def wait(driver, what, timeout: float = 30):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(what)


def rank_phases(driver) -> dict[str, str]:
    rows = driver.find_elements(By.CSS_SELECTOR, "#ranks tbody tr")
    return {r.get_attribute("data-rank"): r.get_attribute("data-phase") for r in rows}


def shot(driver, name: str) -> None:
    if SHOTS:
        driver.save_screenshot(str(ROOT / "docs" / f"{name}.png"))


def test_the_page_shows_the_ranks_chats_and_a_restart(browser, served):
    from tests.support.serving import ask, chat_reference

    browser.get(f"http://127.0.0.1:{served.port}/")
    wait(browser, lambda d: rank_phases(d) == {"0": "ready", "1": "ready"})
    assert browser.find_element(By.ID, "status").text == "ok"
    assert "2 of 2 ranks up" in browser.find_element(By.ID, "summary").text
    link = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#links tr[data-link='0-1']"))
    cells = [td.text for td in link.find_elements(By.TAG_NAME, "td")]
    assert cells[1] == "localhost – localhost" and "Gbit/s" in cells[4] and cells[5] == "yes"
    assert "all_sum over 2 ranks" in browser.find_element(By.ID, "allsum").text
    assert ask(served.client).choices[0].message.content == chat_reference(served.model, 16)

    box = browser.find_element(By.ID, "prompt")
    box.send_keys("Tell me about lists")
    browser.find_element(By.ID, "send").click()
    done = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant[data-done]"))
    api = served.client.chat.completions.create(  # what the page sends
        model="m", messages=[{"role": "user", "content": "Tell me about lists"}],
        temperature=0, max_tokens=512,
    )  # fmt: skip
    shown = done.get_property("textContent")  # as it is (.text would fold its whitespace)
    assert shown == api.choices[0].message.content
    shot(browser, "page")

    os.kill(sorted(served.pids)[-1], signal.SIGKILL)  # a rank dies: serve restarts its ranks
    # the page polls every 2 s and a restart of this model can take less: the failure's row
    # says it either way ("not back yet", then "back after"), the status only while it lasts
    wait(browser, lambda d: d.find_element(By.ID, "status").text in ("restarting", "starting")
         or "rank" in d.find_element(By.ID, "failures").text)  # fmt: skip
    wait(browser, lambda d: d.find_element(By.ID, "status").text == "ok"
         and "back after" in d.find_element(By.ID, "failures").text, timeout=90)  # fmt: skip
    failures = browser.find_element(By.ID, "failures").text
    assert "rank" in failures and "back after" in failures, failures
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#links tr[data-link='0-1']"))
    shot(browser, "page-after-restart")


@pytest.fixture
def keyed():
    from cluster.serve.http import Api
    from tests.support.serving import StandIn

    service = StandIn()
    service.cluster = lambda: {
        "status": "ok", "model": "m", "mode": "tensor", "ranks": 1, "ranks_up": 1, "waiting": 0,
        "in_flight": 0, "restarts": 0, "prefilling": [], "dropped_after_failures": [],
        "hosts": [{"name": "studio.local", "address": "10.0.0.1", "memory_gb": 64,
                   "left_out": False, "ranks": [{"rank": 0, "phase": "ready",
                   "heartbeat_age_s": 0.2, "peak_memory_gb": 1.0, "layers": None}]}],
        "failures": [], "window_s": 300, "rates": [], "ttft_s": {"p50": None, "p95": None},
        "answered": 0, "time": 0,
    }  # fmt: skip
    api = Api("127.0.0.1", 0, "sekrit", service)
    api.start()
    yield api
    api.stop()


def test_with_a_key_the_pages_calls_need_it(browser, keyed):
    browser.get(f"http://127.0.0.1:{keyed.address[1]}/")
    problem = wait(browser, lambda d: d.find_element(By.ID, "problem"))
    wait(browser, lambda d: "needs its API key" in problem.text)
    assert rank_phases(browser) == {}  # nothing shown without the key
    browser.find_element(By.ID, "key").send_keys("sekrit\n")
    wait(browser, lambda d: rank_phases(d) == {"0": "ready"})
    assert not browser.find_element(By.ID, "problem").is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('mlx-cluster-key')") == "sekrit"
    assert browser.execute_script("return localStorage.length") == 0  # the tab's session only
