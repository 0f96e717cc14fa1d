"""Screenshots of serve's page for docs/: a 2-rank serve of the embedded default model in
headless Chromium (as tests/e2e/test_page.py drives it): a question typed into the chat box
(docs/page.png), then a rank killed, while serve restarts its ranks (docs/page-restarting.png).

    python -m tests.tools.page_shots
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from cluster.core.modelcheck import default_model_path  # noqa: E402
from tests.support.processes import _children, _cmdline, descendant_ranks
from tests.support.serving import BIN, free_port, post, stop, wait_up

QUESTIONS = ["What is a dictionary?", "Explain for loops.", "Tell me about exceptions"]
ASKED = "Tell me about lists"
DOCS = Path(__file__).parent.parent.parent / "docs"


def main() -> None:
    model = default_model_path()
    port = free_port()
    argv = [str(BIN / "mlx-cluster"), "serve", "-n", "2", "--port", str(port)]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    options = Options()
    for flag in ("--headless=new", "--no-sandbox", "--window-size=1280,1100"):
        options.add_argument(flag)
    driver = None
    try:
        wait_up(port, proc)
        for question in QUESTIONS:  # some answers, for the figures
            post(port, "/v1/chat/completions", {"model": model.name, "max_tokens": 200,
                 "messages": [{"role": "user", "content": question}]}).read()  # fmt: skip
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        driver.get(f"http://127.0.0.1:{port}/")
        wait = WebDriverWait(driver, 90, poll_frequency=0.1)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#links tr[data-link='0-1']"))
        driver.find_element(By.ID, "prompt").send_keys(ASKED)
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]"))
        driver.save_screenshot(str(DOCS / "page.png"))
        rank = max(descendant_ranks(proc.pid, _children(), _cmdline))
        os.kill(rank, signal.SIGKILL)  # a rank dies: serve restarts its ranks
        wait.until(lambda d: d.find_element(By.ID, "status").text in ("restarting", "starting"))
        wait.until(lambda d: "not back yet" in d.find_element(By.ID, "failures").text)
        driver.save_screenshot(str(DOCS / "page-restarting.png"))
        wait.until(lambda d: d.find_element(By.ID, "status").text == "ok")
        print(DOCS / "page.png", DOCS / "page-restarting.png")
    finally:
        if driver is not None:
            driver.quit()
        stop([proc])


if __name__ == "__main__":
    main()
