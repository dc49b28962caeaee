"""The web app in headless Chromium (Debian's chromium + chromium-driver): chat with streaming, Stop, the Monitor."""
import shutil
import time
from pathlib import Path

import pytest

from fakes.server_kit import ROOT, make_config, metrics, running_server, tiny_codec

pytestmark = pytest.mark.browser
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = ROOT / "test-artifacts"


def browser_or_skip():
    try:
        from selenium import webdriver
    except ImportError:
        pytest.skip("selenium is not installed: pip install -r requirements-test.txt")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium or not Path(CHROMEDRIVER).exists():
        pytest.skip("headless Chromium is not installed: apt-get install -y chromium chromium-driver "
                    f"(found chromium={chromium}, {CHROMEDRIVER} exists={Path(CHROMEDRIVER).exists()})")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1200,900"):
        opts.add_argument(arg)
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    return webdriver.Chrome(options=opts, service=service)


def wait_for(pred, what, timeout=30):
    from selenium.common.exceptions import StaleElementReferenceException
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = pred()
        except StaleElementReferenceException:   # the app re-rendered that node meanwhile: look again
            value = None
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_chat_stream_stop_and_monitor(tmp_path, fixtures_dir):
    driver = browser_or_skip()
    from selenium.webdriver.common.by import By
    # a slow fake worker (it echoes the prompt) so that Stop lands mid-answer; --moe for the cache picture
    cfg = make_config(tmp_path, fixtures_dir / "vocab" / "tiny-bpe-1024.gguf", ["--moe", "--token-delay", "0.05"])
    try:
        with running_server(cfg, tiny_codec(fixtures_dir)) as (_, base):
            driver.get(base + "/")
            driver.execute_script("localStorage.clear()")
            driver.get(base + "/")
            driver.find_element(By.ID, "input").send_keys("hello from the browser " * 4)
            driver.find_element(By.ID, "send").click()

            def answer():
                nodes = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .content")
                return nodes[-1].text if nodes else ""

            first = wait_for(lambda: len(answer()) > 10 and answer(), "the streamed answer")
            assert first.startswith("user")           # the echo of the ChatML prompt's text
            assert driver.find_element(By.ID, "stop").is_enabled()
            driver.find_element(By.ID, "stop").click()
            wait_for(lambda: driver.find_element(By.ID, "send").is_enabled(), "the Send button back after Stop")
            wait_for(lambda: [h["finish"] for h in metrics(base)["history"]] == ["cancel"], "the cancelled request")
            stopped = wait_for(answer, "the stopped answer")
            assert stopped and len(stopped) < len("user\n" + "hello from the browser " * 4 + "\nassistant\n")
            wait_for(lambda: "stopped" in driver.find_element(By.CSS_SELECTOR, ".msg.assistant .meta").text,
                     "the 'stopped' note")
            # the conversation survives a reload (localStorage)
            driver.refresh()
            wait_for(lambda: answer() == stopped, "the conversation after a reload")

            driver.find_element(By.ID, "tab-monitor").click()
            note = wait_for(lambda: driver.find_element(By.ID, "cache-note").text, "the cache note")
            assert "4 layers × 16 experts" in note
            wait_for(lambda: "cancel" in driver.find_element(By.ID, "history").text, "the history table")
            colours = driver.execute_script("""
                const c = document.getElementById('cache-canvas'); const d = c.getContext('2d')
                    .getImageData(0, 0, c.width, c.height).data; const s = new Set();
                for (let i = 0; i < d.length; i += 4) s.add(d[i] + ',' + d[i+1] + ',' + d[i+2]);
                return [c.width, c.height, s.size];""")
            assert colours[0] > 0 and colours[1] > 0 and colours[2] > 4     # resident/not, shaded by heat
            wait_for(lambda: driver.find_element(By.ID, "phase").text == "idle", "the idle phase")
            ARTIFACTS.mkdir(exist_ok=True)
            driver.save_screenshot(str(ARTIFACTS / "server-monitor.png"))
            driver.find_element(By.ID, "tab-chat").click()
            driver.save_screenshot(str(ARTIFACTS / "server-chat.png"))
    finally:
        driver.quit()


def test_reasoning_collapsed_and_dense_model_shows_no_experts(tmp_path, fixtures_dir):
    driver = browser_or_skip()
    from selenium.webdriver.common.by import By
    # Qwen3.5's template opens <think> in the prompt; a budget of 3 tokens closes it, then the answer follows.
    cfg = make_config(tmp_path, fixtures_dir / "vocab" / "tiny-bpe-1024.gguf", reasoning_budget_tokens=3)
    try:
        with running_server(cfg, tiny_codec(fixtures_dir, "Qwen3.5-4B.jinja")) as (httpd, base):
            driver.get(base + "/")
            driver.execute_script("localStorage.clear()")
            driver.get(base + "/")
            driver.find_element(By.ID, "input").send_keys("think about it")
            driver.find_element(By.ID, "send").click()
            # The answer's text is part of the wait: under load the page can show the reasoning block (and an
            # enabled Send) a moment before the content node is rendered.
            wait_for(lambda: driver.find_element(By.ID, "send").is_enabled() and
                     driver.find_elements(By.CSS_SELECTOR, ".msg.assistant details") and
                     driver.find_element(By.CSS_SELECTOR, ".msg.assistant .content").text,
                     "the answer with reasoning")
            details = driver.find_element(By.CSS_SELECTOR, ".msg.assistant details")
            assert details.get_attribute("open") is None                   # collapsed
            assert driver.find_element(By.CSS_SELECTOR, ".msg.assistant .content").text.startswith("user")
            driver.find_element(By.CSS_SELECTOR, ".msg.assistant summary").click()
            assert driver.find_element(By.CSS_SELECTOR, ".msg.assistant .reasoning").text

            driver.find_element(By.ID, "tab-monitor").click()
            note = wait_for(lambda: driver.find_element(By.ID, "cache-note").text, "the cache note")
            assert note == "no experts: this model is dense"
            assert not driver.find_element(By.ID, "cache-canvas").is_displayed()
    finally:
        driver.quit()


def test_phone_width_max_tokens_and_a_failing_monitor(tmp_path, fixtures_dir):
    driver = browser_or_skip()
    from selenium.webdriver.common.by import By
    cfg = make_config(tmp_path, fixtures_dir / "vocab" / "tiny-bpe-1024.gguf")
    try:
        with running_server(cfg, tiny_codec(fixtures_dir)) as (httpd, base):
            driver.set_window_size(375, 740)
            driver.get(base + "/")
            driver.execute_script("localStorage.clear()")
            driver.get(base + "/")
            wide = "return document.documentElement.scrollWidth <= window.innerWidth"
            assert driver.execute_script(wide), "the chat is wider than a phone's screen"
            driver.find_element(By.ID, "input").send_keys("hello")
            driver.find_element(By.ID, "send").click()
            wait_for(lambda: metrics(base)["history"], "the answered request")
            gen = [ln for ln in open(cfg.log).read().splitlines() if "fake worker: GEN" in ln][-1]
            assert "max_new=1024 " in gen                 # the app names its limit
            driver.find_element(By.ID, "tab-monitor").click()
            wait_for(lambda: driver.find_element(By.ID, "toks-note").text, "the tok/s chart's note")
            assert driver.execute_script(wide), "the Monitor is wider than a phone's screen"

            def broken():
                raise RuntimeError("snapshot failed")
            httpd.service.snapshot = broken
            banner = wait_for(lambda: driver.find_element(By.ID, "monitor-error").text, "the failure banner")
            assert "Metrics unavailable" in banner
    finally:
        driver.quit()
