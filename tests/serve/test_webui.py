"""The web chat at ``/``, driven in headless Chromium against the real HTTP stack.

The scripted engine double gives a deterministic (and, for Stop, slow) stream. Needs the
Debian ``chromium`` and ``chromium-driver`` packages and the ``selenium`` Python package;
without them the tests skip.
"""
from __future__ import annotations

import re
import shutil
import time

import httpx
import pytest

from lodestar.serve import ServeConfig, build_app

from serve_helpers import MODEL, serve_in_thread

INSTALL = ("install the browser and its driver: apt-get install chromium chromium-driver, "
           "and pip install selenium")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
THINKING = ("<think>", "\nLet me", " think.", "\n</think>", "\n\nIt is **sunny**", " today.\n\n",
            "```python\nprint('hi')\n```")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    webdriver = pytest.importorskip("selenium.webdriver", reason=f"selenium is not installed; {INSTALL}")
    from selenium.webdriver.chrome.service import Service
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip(f"chromium or chromedriver not found; {INSTALL}")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,900",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    # An explicit driver path: Selenium never looks for (or downloads) a driver of its own.
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def wait(driver, condition, timeout: float = 10.0, message: str = ""):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition, message)


def by_css(driver, selector: str):
    from selenium.webdriver.common.by import By
    return driver.find_elements(By.CSS_SELECTOR, selector)


def open_page(driver, url: str) -> None:
    """A fresh page with empty local storage and the model list loaded (or its error shown)."""
    driver.get(url + "/")
    driver.execute_script("localStorage.clear()")
    driver.refresh()
    wait(driver, lambda d: by_css(d, "#model option") or by_css(d, "#notice:not([hidden])"),
         message="the page neither listed models nor showed an error")


def send(driver, *keys) -> None:
    from selenium.webdriver.common.keys import Keys
    prompt = by_css(driver, "#prompt")[0]
    prompt.send_keys(*keys)
    prompt.send_keys(Keys.ENTER)


def last_reply(driver):
    return by_css(driver, "article.msg.assistant")[-1]


def wait_reply_done(driver, timeout: float = 10.0):
    wait(driver, lambda d: last_reply(d).get_attribute("aria-busy") == "false", timeout, "the reply did not finish")
    return last_reply(driver)


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=5).json()


def test_chat_page_is_served_at_root_and_loads_nothing_from_elsewhere(fake_url):
    page = httpx.get(fake_url + "/")
    assert page.status_code == 200 and 'id="prompt"' in page.text
    css = httpx.get(fake_url + "/static/style.css")
    js = httpx.get(fake_url + "/static/app.js")
    assert css.status_code == js.status_code == 200
    for text in (page.text, css.text):
        assert "http://" not in text and "https://" not in text and "@import" not in text
    assert sorted(set(re.findall(r'fetch\(\s*"([^"]+)"', js.text))) == ["/v1/chat/completions", "/v1/models"]


def test_page_streams_markdown_with_reasoning_stats_and_history(browser, fake_url, fake_engine, script):
    from selenium.webdriver.common.keys import Keys
    script.pieces = THINKING
    script.step_delay = 0.01
    script.cached_tokens = 7
    open_page(browser, fake_url)
    assert [o.text for o in by_css(browser, "#model option")] == [MODEL]
    by_css(browser, "#system")[0].send_keys("Answer briefly.")
    by_css(browser, "#temperature")[0].send_keys("0")
    by_css(browser, "#max-tokens")[0].send_keys("50")
    send(browser, "Weather", Keys.SHIFT, Keys.ENTER, Keys.NULL, "in Paris?")   # Shift+Enter: a new line, not a send

    reply = wait_reply_done(browser)
    body = reply.find_element("css selector", ".markdown")
    assert body.find_element("css selector", "strong").text == "sunny"
    assert body.find_element("css selector", "pre code").text == "print('hi')"
    details = reply.find_element("css selector", "details.reasoning")
    assert details.get_attribute("open") is None                  # reasoning is there, collapsed
    assert details.get_attribute("textContent").endswith("Let me think.")
    stats = reply.find_element("css selector", ".stats").text
    assert "tok/s" in stats and f"{len(THINKING)} tokens" in stats
    assert "7 of " in stats and "prompt tokens cached" in stats
    prompt = fake_engine.prompt_text()
    assert "Answer briefly." in prompt and "Weather\nin Paris?" in prompt
    params = fake_engine.requests[-1][1]
    assert params.temperature == 0 and params.max_tokens == 50
    assert by_css(browser, "#prompt")[0].get_attribute("value") == ""

    script.pieces = ("Yes.",)
    send(browser, "Sure?")
    wait_reply_done(browser)
    assert "It is **sunny** today." in fake_engine.prompt_text()   # the first answer went back as history
    by_css(browser, "#new-chat")[0].click()
    assert by_css(browser, "article.msg") == []
    send(browser, "Fresh start")
    wait_reply_done(browser)
    assert "sunny" not in fake_engine.prompt_text() and "Fresh start" in fake_engine.prompt_text()


def test_stop_ends_a_slow_stream_and_the_server_frees_it(browser, fake_url, fake_engine, script):
    script.pieces = ("tick ",) * 2000
    script.step_delay = 0.02                                      # 40 s if nobody stops it
    open_page(browser, fake_url)
    send(browser, "Count for me")
    wait(browser, lambda d: last_reply(d).text.count("tick") >= 5, message="no streamed text appeared")
    reply = last_reply(browser)
    assert reply.get_attribute("aria-busy") == "true"            # text is shown while the stream runs
    assert health(fake_url)["running"] == 1
    stop = by_css(browser, "#stop")[0]
    assert stop.is_enabled()

    stop.click()
    wait_reply_done(browser, timeout=5)
    deadline = time.monotonic() + 5
    while health(fake_url)["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health(fake_url)["running"] == 0
    shown = reply.find_element("css selector", ".markdown").text
    time.sleep(0.5)
    assert reply.find_element("css selector", ".markdown").text == shown   # nothing arrives after Stop
    assert 5 <= shown.count("tick") < 2000
    assert reply.find_element("css selector", ".stats").text.startswith("Stopped")
    assert not stop.is_enabled() and by_css(browser, "#send")[0].is_enabled()

    script.pieces, script.step_delay = ("ok",), 0.0
    send(browser, "Go on")
    wait_reply_done(browser)
    assert "tick tick tick" in fake_engine.prompt_text()      # the stopped reply stays in the conversation


def test_server_error_is_shown_inline_and_the_text_kept(browser, fake_url, fake_engine):
    open_page(browser, fake_url)
    fake_engine.max_queued = 0
    try:
        send(browser, "Hello?")
        reply = wait_reply_done(browser)
    finally:
        fake_engine.max_queued = 256
    error = reply.find_element("css selector", ".error")
    assert error.is_displayed() and error.get_attribute("role") == "alert"
    assert error.text.startswith("The server is busy: request queue is full")
    assert by_css(browser, "#prompt")[0].get_attribute("value") == "Hello?"   # ready to send again


def test_api_key_is_kept_in_local_storage_and_sent_as_bearer(browser, fake_engine, script):
    script.pieces = ("Welcome", " back.")
    app = build_app(fake_engine, ServeConfig(model_names=(MODEL, "default"), api_key="s3cret"))
    with serve_in_thread(app) as url:
        open_page(browser, url)
        notice = by_css(browser, "#notice")[0]
        assert "Missing API key" in notice.text and by_css(browser, "#model option") == []

        key = by_css(browser, "#api-key")[0]
        key.send_keys("s3cret")
        by_css(browser, "#system")[0].click()                   # leaving the field saves it and reloads models
        wait(browser, lambda d: len(by_css(d, "#model option")) == 2, message="models did not load with the key")
        assert not notice.is_displayed()
        assert browser.execute_script("return localStorage.getItem('lodestar.apiKey')") == "s3cret"
        send(browser, "Hi")
        assert wait_reply_done(browser).find_element("css selector", ".markdown").text == "Welcome back."

        browser.refresh()                                       # the key survives a reload
        wait(browser, lambda d: len(by_css(d, "#model option")) == 2)
        assert by_css(browser, "#api-key")[0].get_attribute("value") == "s3cret"
