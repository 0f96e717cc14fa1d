"""Screenshots of serve's page for docs/: a 2-rank serve of the embedded default model, a
question typed into the chat box, in headless Chromium (as tests/test_page.py drives it).

    python tests/page_shots.py            # writes docs/page.png
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402
from stall import fresh_serve, post  # noqa: E402

from cluster.core.modelcheck import default_model_path  # noqa: E402

QUESTION = "Tell me about lists"


def main() -> None:
    model = default_model_path()
    options = Options()
    for flag in ("--headless=new", "--no-sandbox", "--window-size=1280,1000"):
        options.add_argument(flag)
    with fresh_serve(model, "pipeline", 2) as port:
        for _ in range(3):  # some answers, for the figures
            post(port, "/v1/chat/completions", {"model": model.name, "max_tokens": 48,
                 "messages": [{"role": "user", "content": QUESTION}]}).read()  # fmt: skip
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        try:
            driver.get(f"http://127.0.0.1:{port}/")
            wait = WebDriverWait(driver, 60, poll_frequency=0.1)
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#ranks tbody tr")) == 2)
            driver.find_element(By.ID, "prompt").send_keys(QUESTION)
            driver.find_element(By.ID, "send").click()
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]"))
            out = Path(__file__).parent.parent / "docs" / "page.png"
            driver.save_screenshot(str(out))
            print(out)
        finally:
            driver.quit()


if __name__ == "__main__":
    main()
