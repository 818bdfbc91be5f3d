"""The web app at ``/``, driven in headless Chromium against the real HTTP stack.

The scripted engine double gives a deterministic (and, for Stop, slow) stream. Needs the
Debian ``chromium`` and ``chromium-driver`` packages and the ``selenium`` Python package;
without them the browser tests skip. Every browser test fails on a console error it did not
expect (``console`` fixture).

``LODESTAR_SCREENSHOTS=docs/images pytest tests/serve/test_webui.py -k screenshots`` writes
the screenshots in docs/web-app.md.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from serve_helpers import MODEL, ScriptedEngine, serve_in_thread

from lodestar.formats.registry import ModelRegistry
from lodestar.serve import ServeConfig, build_app
from lodestar.serve.web import models_api
from lodestar.serve.web.models_api import EngineFactory, enable_model_switching
from tests.agent.scripted import Hang, ScriptedClient, call, reply

INSTALL = ("install the browser and its driver: apt-get install chromium chromium-driver, "
           "and pip install selenium")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
STATIC = Path(__file__).parents[2] / "lodestar" / "serve" / "static"
BENCH_RESULTS = Path(__file__).parents[2] / "bench" / "results"
THINKING = ("<think>", "\nLet me", " think.", "\n</think>", "\n\nIt is **sunny**", " today.\n\n",
            "```python\nprint('hi')\n```")
WIDE, NARROW = (1280, 900), (390, 844)


# -- servers and the browser -----------------------------------------------------------------
@contextmanager
def serving(engine, db: Path, agent_client=None, bench_results: Path | None = None, switch_with=None,
            **config):
    """The app on ``engine``; the agent's model is ``agent_client`` (a scripted one) when given;
    ``switch_with`` is (engine factory, model registry) for model switching."""
    app = build_app(engine, ServeConfig(model_names=(MODEL,), keepalive_s=0.1, db_path=db, **config))
    if agent_client is not None:
        app.state.agent_client_factory = lambda session: agent_client
    if bench_results is not None:
        app.state.bench_results = bench_results
    manager = enable_model_switching(app, *switch_with) if switch_with is not None else None
    try:
        with serve_in_thread(app) as url:
            yield url
    finally:
        if manager is not None and manager.state.engine.current is not None:
            manager.state.engine.current.shutdown()        # the model switched to, or the first


@pytest.fixture(scope="module")
def web(fake_engine, tmp_path_factory):
    """The app on the scripted engine, with its own conversation store."""
    with serving(fake_engine, tmp_path_factory.mktemp("web") / "agent.db") as url:
        yield url


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
                 "--disable-dev-shm-usage", f"--window-size={WIDE[0]},{WIDE[1]}",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium never looks for (or downloads) a driver of its own.
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture(autouse=True)
def console(request):
    """Console errors of the test's page; a test adds the substrings of the ones it expects."""
    expected: list[str] = []
    if "browser" not in request.fixturenames:
        yield expected
        return
    driver = request.getfixturevalue("browser")
    driver.get_log("browser")                                   # what earlier tests left
    yield expected
    errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    unexpected = [m for m in errors if not any(s in m for s in expected)]
    assert not unexpected, f"console errors: {unexpected}"


def wait(driver, condition, timeout: float = 10.0, message: str = ""):
    """``condition`` true within ``timeout``; lists redrawn under a check (stale elements) are looked at again."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, timeout, poll_frequency=0.05,
                         ignored_exceptions=[StaleElementReferenceException]).until(condition, message)


def by_css(root, selector: str):
    return root.find_elements("css selector", selector)


def one(root, selector: str):
    return root.find_element("css selector", selector)


def open_page(driver, url: str, route: str = "#/chat") -> None:
    """A fresh page with empty local storage, showing ``route``."""
    driver.get(f"{url}/{route}")
    driver.execute_script("localStorage.clear(); sessionStorage.clear()")
    driver.refresh()
    wait(driver, lambda d: by_css(d, "#view > section"), message="no view was shown")


def send(driver, *keys, prompt: str = "#prompt") -> None:
    from selenium.webdriver.common.keys import Keys
    box = one(driver, prompt)
    box.send_keys(*keys)
    box.send_keys(Keys.ENTER)


def replies(driver):
    return by_css(driver, "#log article.msg.assistant")


def wait_reply_done(driver, count: int | None = None, timeout: float = 10.0):
    def done(d):
        found = replies(d)
        return found and (count is None or len(found) == count) and found[-1].get_attribute("aria-busy") == "false"
    wait(driver, done, timeout, "the reply did not finish")
    return replies(driver)[-1]


def conversation_id(driver) -> str:
    wait(driver, lambda d: re.search(r"#/chat/\w+", d.current_url), message="no conversation in the address")
    return driver.current_url.rsplit("/", 1)[-1]


def stored(url: str, cid: str) -> dict:
    r = httpx.get(f"{url}/api/conversations/{cid}", timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=5).json()


# -- what the server sends ------------------------------------------------------------------------
def test_app_is_served_at_root_and_loads_nothing_from_elsewhere(web):
    page = httpx.get(web + "/")
    assert page.status_code == 200
    for view in ("chat", "agent", "stats", "models", "report"):
        assert f'id="view-{view}"' in page.text
    scripts = sorted(STATIC.glob("js/*.js")) + sorted(STATIC.glob("vendor/*.js"))
    assert {p.name for p in scripts} >= {"app.js", "chat.js", "agent.js", "dashboard.js", "models.js",
                                         "reports.js", "markdown-it.min.js", "highlight.min.js"}
    for path in scripts:
        r = httpx.get(f"{web}/static/{path.parent.name}/{path.name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/javascript"), path
    css = httpx.get(web + "/static/style.css").text
    for text in (page.text, css):
        assert "http://" not in text and "https://" not in text and "@import" not in text
    for path in STATIC.glob("js/*.js"):
        source = path.read_text()
        # the only absolute URL in the app's own code is the SVG namespace name
        assert set(re.findall(r"https?://[^\s\"'`]+", source)) <= {"http://www.w3.org/2000/svg"}, path
        assert "innerHTML" not in source or path.name == "markdown.js", f"{path}: build DOM with textContent"
        for target in re.findall(r"from \"([^\"]+)\"", source):
            assert target.startswith(("./", "../vendor/")), (path, target)


def test_vendored_files_match_their_readme_and_carry_licenses():
    readme = (STATIC / "vendor" / "README.md").read_text()
    markdown_it = (STATIC / "vendor" / "markdown-it.min.js").read_text()
    highlight = (STATIC / "vendor" / "highlight.min.js").read_text()
    version = re.search(r"markdown-it (\d+\.\d+\.\d+)", markdown_it).group(1)
    assert f"markdown-it@{version}" in readme
    version = re.search(r"Highlight\.js v(\d+\.\d+\.\d+)", highlight).group(1)
    assert f"@highlightjs/cdn-assets@{version}" in readme
    for name in ("markdown-it", "highlight.js", "entities", "linkify-it", "mdurl", "punycode.js", "uc.micro"):
        assert (STATIC / "vendor" / f"{name}.LICENSE").stat().st_size > 500, name
    assert "sourceMappingURL" not in markdown_it + highlight        # no request for a file that is not shipped


# -- chat ------------------------------------------------------------------------------------------
def test_chat_streams_markdown_with_reasoning_stats_and_comes_back_after_a_reload(browser, web, fake_engine,
                                                                                   script):
    from selenium.webdriver.common.keys import Keys
    script.pieces = THINKING + ("\n\n<img src=x onerror=alert(1)> [site](javascript:alert(1))",)
    script.step_delay = 0.01
    script.cached_tokens = 7
    open_page(browser, web)
    send(browser, "Weather", Keys.SHIFT, Keys.ENTER, Keys.NULL, "in Paris?")   # Shift+Enter: a new line, not a send

    reply = wait_reply_done(browser)
    body = one(reply, ".markdown")
    assert one(body, "strong").text == "sunny"
    assert one(body, "pre code").text == "print('hi')"
    assert by_css(body, "pre code span[class^='hljs-']")                 # highlighted
    assert one(body, "pre button.copy").text == "Copy"
    assert by_css(body, "img") == [] and "<img src=x" in body.text         # raw HTML shows as text
    assert not by_css(body, "a[href^='javascript']")
    details = one(reply, "details.reasoning")
    assert details.get_attribute("open") is None                           # reasoning is there, folded
    assert details.get_attribute("textContent").strip().endswith("Let me think.")
    stats = one(reply, ".stats").text
    assert "tok/s" in stats and f"{len(THINKING) + 1} tokens" in stats and "first token" in stats
    assert "7 of " in stats and "prompt tokens cached" in stats
    assert "Weather\nin Paris?" in fake_engine.prompt_text()
    assert one(browser, "#prompt").get_attribute("value") == ""

    cid = conversation_id(browser)
    assert one(browser, "#chat-title").text == "Weather in Paris?"
    assert one(browser, f"#conv-list [data-id='{cid}'] a").get_attribute("aria-current") == "page"
    script.pieces = ("Yes.",)
    send(browser, "Sure?")
    wait_reply_done(browser, count=2)
    assert "It is **sunny** today." in fake_engine.prompt_text()          # the first answer went back as history

    browser.refresh()                                                      # the server kept it all
    reply = wait_reply_done(browser, count=2)
    first = replies(browser)[0]
    assert one(first, "strong").text == "sunny" and one(first, ".stats").text == stats
    assert one(first, "details.reasoning").get_attribute("textContent").strip().endswith("Let me think.")
    assert [m.text for m in by_css(browser, "#log .msg.user .body")] == ["Weather\nin Paris?", "Sure?"]

    one(browser, "#new-chat").click()
    wait(browser, lambda d: not by_css(d, "#log .msg") and d.current_url.endswith("#/chat"))
    script.pieces = ("Fresh.",)
    send(browser, "Fresh start")
    wait_reply_done(browser, count=1)
    assert "sunny" not in fake_engine.prompt_text() and "Fresh start" in fake_engine.prompt_text()
    assert conversation_id(browser) != cid


def test_stop_ends_a_slow_stream_the_server_frees_it_and_keeps_what_was_shown(browser, web, fake_engine, script):
    script.pieces = ("tick ",) * 2000
    script.step_delay = 0.02                                      # 40 s if nobody stops it
    open_page(browser, web)
    send(browser, "Count for me")
    wait(browser, lambda d: replies(d) and replies(d)[-1].text.count("tick") >= 5, message="no streamed text")
    reply = replies(browser)[-1]
    assert reply.get_attribute("aria-busy") == "true"            # text is shown while the stream runs
    assert health(web)["running"] == 1
    stop = one(browser, "#stop")
    assert stop.is_enabled() and not one(browser, "#send").is_enabled()

    stop.click()
    wait_reply_done(browser, timeout=5)
    deadline = time.monotonic() + 5
    while health(web)["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health(web)["running"] == 0
    shown = one(reply, ".markdown").text
    time.sleep(0.3)
    assert one(reply, ".markdown").text == shown                 # nothing arrives after Stop
    assert 5 <= shown.count("tick") < 2000
    wait(browser, lambda d: one(reply, ".stats").text.startswith("Stopped · "), message="no Stopped stats")
    assert not stop.is_enabled() and one(browser, "#send").is_enabled()

    answer = stored(web, conversation_id(browser))["messages"][-1]
    assert answer["stopped"] is True and answer["content"].count("tick") >= shown.count("tick")
    browser.refresh()
    reply = wait_reply_done(browser, count=1)
    assert one(reply, ".stats").text.startswith("Stopped")
    script.pieces, script.step_delay = ("ok",), 0.0
    send(browser, "Go on")
    wait_reply_done(browser, count=2)
    assert "tick tick tick" in fake_engine.prompt_text()      # the stopped reply stays in the conversation

    from selenium.webdriver.common.keys import Keys
    script.pieces, script.step_delay = ("tock ",) * 2000, 0.02
    send(browser, "Once more")
    wait(browser, lambda d: len(replies(d)) == 3 and "tock" in replies(d)[-1].text, message="no streamed text")
    one(browser, "#prompt").send_keys(Keys.ESCAPE)             # Esc stops too
    assert one(wait_reply_done(browser, count=3, timeout=5), ".stats").text.startswith("Stopped")


def test_regenerate_and_edit_and_resend_replace_the_later_messages(browser, web, fake_engine, script):
    open_page(browser, web)
    script.pieces = ("First answer.",)
    send(browser, "Apples?")
    wait_reply_done(browser, count=1)
    cid = conversation_id(browser)

    script.pieces = ("Second answer.",)
    one(replies(browser)[-1], "button.regenerate").click()
    wait(browser, lambda d: len(replies(d)) == 1 and one(replies(d)[0], ".markdown").text == "Second answer.")
    wait_reply_done(browser, count=1)
    assert "Apples?" in fake_engine.prompt_text() and "First answer." not in fake_engine.prompt_text()
    wait(browser, lambda d: [m["content"] for m in stored(web, cid)["messages"]] == ["Apples?", "Second answer."])

    from selenium.webdriver.common.keys import Keys
    wait(browser, lambda d: by_css(d, "#log .msg.user button.edit"), message="no Edit button")
    one(browser, "#log .msg.user button.edit").click()
    box = one(browser, "#log .msg.user textarea.edit-input")
    assert box.get_attribute("value") == "Apples?"
    box.clear()
    script.pieces = ("Orange answer.",)
    box.send_keys("Oranges?", Keys.ENTER)
    wait(browser, lambda d: [m.text for m in by_css(d, "#log .msg.user .body")] == ["Oranges?"])
    wait_reply_done(browser, count=1)
    assert one(replies(browser)[0], ".markdown").text == "Orange answer."
    assert "Oranges?" in fake_engine.prompt_text() and "Apples?" not in fake_engine.prompt_text()
    wait(browser, lambda d: [m["content"] for m in stored(web, cid)["messages"]] == ["Oranges?", "Orange answer."])


def test_settings_belong_to_the_conversation_and_bad_ones_are_explained(browser, web, fake_engine, script,
                                                                         console):
    from selenium.webdriver.support.ui import Select
    console.append("status of 400")                                  # the refused top_p
    script.pieces = ("Brief.",)
    open_page(browser, web)
    toggle = one(browser, "#toggle-settings")
    toggle.click()
    assert toggle.get_attribute("aria-expanded") == "true" and one(browser, "#chat-settings").is_displayed()
    one(browser, "#system").send_keys("Answer briefly.")
    one(browser, "#temperature").send_keys("0")
    one(browser, "#max-tokens").send_keys("50")
    Select(one(browser, "#reasoning-effort")).select_by_value("low")
    send(browser, "Settings test")
    wait_reply_done(browser, count=1)
    assert "Answer briefly." in fake_engine.prompt_text()
    params = fake_engine.requests[-1][1]
    assert params.temperature == 0 and params.max_tokens == 50
    cid = conversation_id(browser)
    assert stored(web, cid)["settings"] == {"system": "Answer briefly.", "temperature": 0, "max_tokens": 50,
                                            "reasoning_effort": "low"}

    top_p = one(browser, "#top-p")
    top_p.send_keys("7")                                          # out of range: the server names the field
    wait(browser, lambda d: "top_p" in one(d, "#settings-status").text, message="no error for top_p")
    assert "error-text" in one(browser, "#settings-status").get_attribute("class")
    top_p.clear()
    top_p.send_keys("0.5")
    wait(browser, lambda d: one(d, "#settings-status").text == "Saved.")
    assert stored(web, cid)["settings"]["top_p"] == 0.5

    Select(one(browser, "#response-format")).select_by_value("json_schema")
    one(browser, "#json-schema").send_keys("{not json")
    wait(browser, lambda d: "not valid JSON" in one(d, "#settings-status").text)

    one(browser, "#new-chat").click()                              # another conversation starts blank
    wait(browser, lambda d: one(d, "#system").get_attribute("value") == "")
    browser.get(f"{web}/#/chat/{cid}")
    wait(browser, lambda d: one(d, "#system").get_attribute("value") == "Answer briefly.")
    assert one(browser, "#temperature").get_attribute("value") == "0"
    assert one(browser, "#top-p").get_attribute("value") == "0.5"


def test_sidebar_searches_renames_and_deletes_conversations(browser, web, script):
    from selenium.webdriver.common.keys import Keys
    script.pieces = ("Noted.",)
    open_page(browser, web)
    ids = {}
    for word in ("Zebra", "Quokka"):
        one(browser, "#new-chat").click()
        wait(browser, lambda d: not by_css(d, "#log .msg"))
        send(browser, f"Tell me about the {word.lower()}")
        wait_reply_done(browser, count=1)
        ids[word] = conversation_id(browser)
    items = lambda d: d.execute_script(  # read in one go: the list is redrawn as it changes
        "return [...document.querySelectorAll('#conv-list li.item')].map((li) => li.dataset.id)")
    wait(browser, lambda d: items(d)[:2] == [ids["Quokka"], ids["Zebra"]], message="newest first")

    one(browser, "#conv-search").send_keys("zebra")                # searches the message text too
    wait(browser, lambda d: items(d) == [ids["Zebra"]], message="search did not narrow the list")
    one(browser, f"#conv-list [data-id='{ids['Zebra']}'] button.rename").click()
    box = one(browser, "#conv-list input.rename-input")
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys("Striped horses", Keys.ENTER)
    wait(browser, lambda d: one(d, f"#conv-list [data-id='{ids['Zebra']}'] .item-title").text == "Striped horses")
    assert stored(web, ids["Zebra"])["title"] == "Striped horses"

    one(browser, "#conv-search").clear()
    one(browser, "#conv-search").send_keys("Quokka")
    wait(browser, lambda d: items(d) == [ids["Quokka"]])
    one(browser, f"#conv-list [data-id='{ids['Quokka']}'] button.delete").click()
    one(browser, "#conv-list button.confirm-delete").click()      # asked once more, in place
    wait(browser, lambda d: items(d) == [] and d.current_url.endswith("#/chat"))
    assert httpx.get(f"{web}/api/conversations/{ids['Quokka']}").status_code == 404
    assert not by_css(browser, "#log .msg")                        # the open conversation was the deleted one


def test_a_refused_message_is_shown_inline_and_its_text_kept(browser, web, fake_engine, script, console):
    console.append("status of 503")                                  # the full queue's answer
    script.pieces = ("Later.",)
    open_page(browser, web)
    fake_engine.max_queued = 0
    try:
        send(browser, "Hello?")
        reply = wait_reply_done(browser)
    finally:
        fake_engine.max_queued = 256
    error = one(reply, ".error")
    assert error.is_displayed() and error.get_attribute("role") == "alert"
    assert error.text.startswith("The server is busy: request queue is full")
    assert one(browser, "#prompt").get_attribute("value") == "Hello?"   # ready to send again
    cid = conversation_id(browser)
    assert stored(web, cid)["messages"] == []

    one(browser, "#send").click()
    wait(browser, lambda d: one(d, "#log .msg.assistant:not(.unstored) .markdown").text == "Later.")
    assert [m["content"] for m in stored(web, cid)["messages"]] == ["Hello?", "Later."]


def test_an_engine_failure_mid_answer_is_shown_and_retry_answers_without_a_second_copy(browser, web, script):
    script.pieces = ("Half", " an answer")
    script.fail_after = 1
    open_page(browser, web)
    send(browser, "Will it fail?")
    reply = wait_reply_done(browser)
    assert "simulated failure" in one(reply, ".error").text
    cid = conversation_id(browser)
    wait(browser, lambda d: by_css(d, "#log button.regenerate"), message="no Regenerate for the partial answer")
    assert [m["content"] for m in stored(web, cid)["messages"]] == ["Will it fail?", "Half"]

    script.pieces, script.fail_after = ("Whole answer.",), None
    one(browser, "#log button.regenerate").click()
    wait(browser, lambda d: len(replies(d)) == 1 and one(replies(d)[0], ".markdown").text == "Whole answer.")
    wait_reply_done(browser, count=1)
    assert [m["content"] for m in stored(web, cid)["messages"]] == ["Will it fail?", "Whole answer."]

    script.fail_after = 0                                             # fails before any text: nothing is stored
    send(browser, "Again?")
    wait_reply_done(browser, count=2)
    wait(browser, lambda d: by_css(d, "#log .msg.user button.retry"), message="no Retry button")
    script.pieces, script.fail_after = ("Fine now.",), None
    one(browser, "#log .msg.user button.retry").click()
    wait(browser, lambda d: one(d, "#log .msg.assistant:last-of-type .markdown").text == "Fine now.")
    assert [m["content"] for m in stored(web, cid)["messages"]][-2:] == ["Again?", "Fine now."]


def test_api_key_is_asked_once_kept_in_local_storage_and_sent_as_bearer(browser, fake_engine, script, tmp_path,
                                                                         console):
    console.append("401")                                            # the first requests, before the key
    script.pieces = ("Welcome", " back.")
    with serving(fake_engine, tmp_path / "agent.db", api_key="s3cret") as url:
        open_page(browser, url)
        dialog = one(browser, "#key-dialog")
        wait(browser, lambda d: dialog.get_attribute("open") is not None, message="the page did not ask for the key")
        assert "API key" in dialog.text
        one(browser, "#api-key").send_keys("s3cret")
        one(browser, "#key-save").click()
        wait(browser, lambda d: one(d, "#served-model").text == MODEL, message="models did not load with the key")
        assert dialog.get_attribute("open") is None
        assert browser.execute_script("return localStorage.getItem('lodestar.apiKey')") == "s3cret"
        send(browser, "Hi")
        assert one(wait_reply_done(browser), ".markdown").text == "Welcome back."

        browser.refresh()                                           # the key survives a reload: no second ask
        wait_reply_done(browser, count=1)
        assert one(browser, "#key-dialog").get_attribute("open") is None


@contextmanager
def phone(driver):
    """A 390 px wide phone screen (a headless window cannot be narrower than 500 px: emulate it)."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": NARROW[0], "height": NARROW[1], "deviceScaleFactor": 1, "mobile": True})
    try:
        yield
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_narrow_screen_hides_the_sidebar_behind_a_toggle(browser, web, script):
    script.pieces = ("Small screen answer with a long line of code:\n\n```python\n", "x = 1" + " + 1" * 80, "\n```")
    with phone(browser):
        open_page(browser, web)
        sidebar = one(browser, "#conv-sidebar")
        assert not sidebar.is_displayed()
        send(browser, "Phone question about a long title that does not fit")
        wait_reply_done(browser, count=1)
        # nothing widens the page (a phone would zoom out): long lines scroll inside their block
        assert browser.execute_script("return [window.innerWidth, document.documentElement.scrollWidth]") \
            == [NARROW[0], NARROW[0]]
        code = one(browser, "#log pre")
        assert browser.execute_script("return arguments[0].scrollWidth > arguments[0].clientWidth", code)
        one(browser, "#toggle-conversations").click()
        wait(browser, lambda d: sidebar.is_displayed())
        one(browser, "#conv-list .item-link").click()                    # picking one folds the list away
        wait(browser, lambda d: not sidebar.is_displayed())


def test_theme_toggle_overrides_the_system_and_is_remembered(browser, web):
    open_page(browser, web)
    background = lambda d: d.execute_script("return getComputedStyle(document.body).backgroundColor")
    system = background(browser)
    toggle = one(browser, "#theme-toggle")
    toggle.click()                                                   # auto -> light
    assert browser.execute_script("return document.documentElement.dataset.theme") == "light"
    light = background(browser)
    toggle.click()                                                   # light -> dark
    dark = background(browser)
    assert light == system and dark != light
    assert "dark" in toggle.get_attribute("aria-label")
    browser.refresh()
    wait(browser, lambda d: by_css(d, "#view > section"))
    assert background(browser) == dark
    one(browser, "#theme-toggle").click()                            # dark -> auto
    assert background(browser) == system


# -- dashboard ---------------------------------------------------------------------------------------
def _load(url: str, n: int = 3) -> None:
    """n streamed chat completions at once."""
    def one_request():
        body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "load"}]}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            for _ in r.iter_lines():
                pass
    threads = [threading.Thread(target=one_request) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def test_dashboard_charts_move_under_load_and_list_the_requests(browser, fake_engine, script, tmp_path):
    decode = lambda d: one(d, "#chart-decode path[data-series='decode']").get_attribute("d") or ""
    # the path's y values (100 is zero); none while the chart is not drawn yet ("" or "M")
    points = lambda d: [float(xy[1]) for xy in (p.split() for p in decode(d)[1:].split("L")) if len(xy) == 2]
    with serving(fake_engine, tmp_path / "agent.db") as url:                # fresh counters
        open_page(browser, url, "#/stats")
        wait(browser, lambda d: len(points(d)) >= 2, message="the decode chart was not drawn")
        assert set(points(browser)) == {100.0}                              # no load yet: flat on the floor
        assert one(browser, "#requests-table tbody").text == "No finished requests yet."

        script.pieces = ("tok ",) * 60
        script.step_delay = 0.02
        _load(url)
        wait(browser, lambda d: min(points(d)) < 100.0, timeout=5, message="the decode chart did not rise")
        wait(browser, lambda d: len(by_css(d, "#requests-table tbody tr[data-id]")) == 3)
        cells = [c.text for c in by_css(by_css(browser, "#requests-table tbody tr")[0], "td")]
        assert cells[1] == "/v1/chat/completions" and cells[2] == MODEL and cells[5] == "60"
        tiles = {one(t, "dt").text: one(t, "dd").text for t in by_css(browser, "#stat-tiles .tile")}
        assert tiles["Requests"] == "3" and tiles["Generated tokens"] == "180"

        drawn = points(browser)                                             # a visit elsewhere keeps the history
        one(browser, ".views-nav a[data-view='chat']").click()
        wait(browser, lambda d: by_css(d, "#chat-title"))
        one(browser, ".views-nav a[data-view='stats']").click()
        wait(browser, lambda d: by_css(d, "#chart-decode path[data-series='decode']") and decode(d))
        assert len(points(browser)) >= len(drawn) and min(points(browser)) < 100.0


# -- agent ---------------------------------------------------------------------------------------
def test_agent_without_projects_says_how_to_enable_it(browser, web, console):
    console.append("status of 403")
    open_page(browser, web, "#/agent")
    notice = one(browser, "#agent-notice")
    wait(browser, lambda d: notice.is_displayed(), message="no notice")
    assert "--projects" in notice.text
    assert not one(browser, "#agent-prompt").is_enabled()


def test_agent_session_with_approve_deny_and_stop(browser, fake_engine, tmp_path):
    from selenium.webdriver.support.ui import Select
    project = tmp_path / "proj"
    project.mkdir()
    client = ScriptedClient([
        reply("Writing it.", call("write", path="hello.txt", content="hi there\n")),
        reply("Done: hello.txt holds the greeting."),
        reply("", call("shell", id="c2", command="touch made.txt")),
        reply("Understood, I will not."),
        Hang("Thinking about it"),
    ])
    with serving(fake_engine, tmp_path / "agent.db", agent_client=client, projects=(str(project),)) as url:
        open_page(browser, url, "#/agent")
        wait(browser, lambda d: [o.get_attribute("value") for o in by_css(d, "#project option")] == [str(project)])
        assert Select(one(browser, "#agent-mode")).first_selected_option.get_attribute("value") == "ask"
        send(browser, "create hello.txt", prompt="#agent-prompt")

        wait(browser, lambda d: by_css(d, ".tool-card[data-state='waiting'] button.approve"), message="no approval")
        browser.refresh()                                # a reloaded page asks on the stored call's one card
        wait(browser, lambda d: by_css(d, ".tool-card[data-state='waiting'] button.approve"), message="no approval")
        assert len(by_css(browser, ".tool-card")) == 1
        card = one(browser, ".tool-card[data-state='waiting']")
        assert one(card, ".tool-name").text == "write" and "hello.txt" in one(card, ".tool-summary").text
        assert one(browser, "#agent-state").text == "working…" and one(browser, "#agent-stop").is_enabled()
        assert not (project / "hello.txt").exists()                   # nothing runs before the answer
        assert re.search(r"#/agent/\w+", browser.current_url)
        one(card, "button.approve").click()

        wait(browser, lambda d: card.get_attribute("data-state") == "ok", message="the write did not finish")
        assert "+hi there" in [line.text for line in by_css(card, ".diff-line.add")]
        assert one(card, ".decision").text == "Approved by you"
        wait(browser, lambda d: by_css(d, "#agent-log .turn-end"), message="no end of turn")
        assert "Done: hello.txt holds the greeting." in one(browser, "#agent-log").text
        assert one(browser, "#agent-state").text == "idle" and not one(browser, "#agent-stop").is_enabled()
        assert (project / "hello.txt").read_text() == "hi there\n"
        assert "2 model calls · 1 tool run" in one(browser, "#agent-log .turn-end").text

        send(browser, "now touch made.txt", prompt="#agent-prompt")
        wait(browser, lambda d: by_css(d, ".tool-card[data-state='waiting'] button.deny"))
        card = one(browser, ".tool-card[data-state='waiting']")
        one(card, "input.deny-reason").send_keys("not today")
        one(card, "button.deny").click()
        wait(browser, lambda d: len(by_css(d, "#agent-log .turn-end")) == 2)
        assert card.get_attribute("data-state") == "denied"
        assert one(card, ".decision").text == "Denied by you: not today"
        assert not (project / "made.txt").exists()
        assert "not today" in json.dumps(client.requests[-1]["messages"])     # the model heard why

        send(browser, "think", prompt="#agent-prompt")
        wait(browser, lambda d: "Thinking about it" in one(d, "#agent-log").text, message="no streamed text")
        one(browser, "#agent-stop").click()
        wait(browser, lambda d: len(by_css(d, "#agent-log .turn-end")) == 3, message="Stop did not end the run")
        assert by_css(browser, "#agent-log .turn-end")[-1].text.startswith("Stopped")
        assert client.cancelled == 1

        browser.refresh()                                               # the transcript comes back from the store
        wait(browser, lambda d: len(by_css(d, "#agent-log .tool-card")) == 2, message="no stored tool cards")
        write, shell = by_css(browser, "#agent-log .tool-card")
        assert write.get_attribute("data-state") == "ok" and by_css(write, ".diff-line.add")
        assert one(write, ".decision").text == "Approved by you"
        assert shell.get_attribute("data-state") == "denied"
        assert one(shell, ".decision").text == "Denied by you: not today"
        texts = [m.text for m in by_css(browser, "#agent-log .msg.user .body")]
        assert texts == ["create hello.txt", "now touch made.txt", "think"]
        items = by_css(browser, "#session-list .item-link")
        assert len(items) == 1 and items[0].get_attribute("aria-current") == "page"
        assert "create hello.txt" in items[0].text
        browser.get("about:blank")               # leave before the server stops, so the live stream ends cleanly


# -- models ------------------------------------------------------------------------------------------
def standing_in(tokenizer, path) -> ScriptedEngine:
    """A scripted engine standing in for the model file at ``path`` (the model manager reads it)."""
    engine = ScriptedEngine(tokenizer)
    engine.engine = SimpleNamespace(loaded=SimpleNamespace(path=Path(path), mode="packed", device="cpu",
                                                           close=lambda: None))
    return engine


def test_models_view_switches_unloads_adds_verifies_and_explains_a_refused_load(
        browser, tokenizer, tmp_path, monkeypatch, console, smollm_path, gemma_path):
    def double(path) -> ScriptedEngine:
        return standing_in(tokenizer, path)

    # the refused load, the bad path, and the served model's name asked for while none is loaded
    console.extend(["status of 409", "status of 400",
                    ("/v1/models - Failed to load resource: the server responded with a status of 503")])
    switch = (EngineFactory(double), ModelRegistry(tmp_path / "models.json"))
    with serving(double(smollm_path), tmp_path / "agent.db", switch_with=switch) as url:
        open_page(browser, url, "#/models")
        row = lambda d, name: one(d, f"#models-table tr[data-name='{name}']")
        loaded = lambda d: d.execute_script(
            "return [...document.querySelectorAll('#models-table tr.loaded')].map((r) => r.dataset.name)")
        wait(browser, lambda d: loaded(d) == ["smollm2-135m"], message="the loaded model is not marked")
        assert one(row(browser, "smollm2-135m"), "button.unload").is_enabled()
        assert one(row(browser, "gemma3-270m"), "button.load").text == "Switch to"

        monkeypatch.setattr(models_api, "available_bytes", lambda device: (1 << 20, "MemAvailable"))
        one(row(browser, "gemma3-270m"), "button.load").click()
        notice = one(browser, "#models-notice")
        wait(browser, lambda d: notice.is_displayed(), message="the refused load was not explained")
        assert notice.text.startswith("Cannot load gemma3-270m: it needs ") and "GiB available (MemAvailable)" in notice.text
        assert loaded(browser) == ["smollm2-135m"]
        monkeypatch.undo()

        wait(browser, lambda d: one(row(d, "gemma3-270m"), "button.load").is_enabled())
        one(row(browser, "gemma3-270m"), "button.load").click()
        wait(browser, lambda d: loaded(d) == ["gemma3-270m"], message="the switch did not happen")
        assert not notice.is_displayed()
        wait(browser, lambda d: one(d, "#served-model").text == "gemma3-270m")
        assert one(browser, "#loaded-model").text.startswith("loaded: gemma3-270m")

        one(row(browser, "gemma3-270m"), "button.unload").click()
        wait(browser, lambda d: one(d, "#loaded-model").text == "no model loaded")
        wait(browser, lambda d: one(d, "#served-model").text == "no model loaded")
        assert {b.text for b in by_css(browser, "#models-table button.load")} == {"Load"}
        one(row(browser, "smollm2-135m"), "button.load").click()
        wait(browser, lambda d: loaded(d) == ["smollm2-135m"])

        one(row(browser, "smollm2-135m"), "button.verify").click()
        panel = one(browser, "#verify-result")
        wait(browser, lambda d: panel.is_displayed() and re.search(r"[0-9a-f]{64}", panel.text), timeout=30)

        one(browser, "#model-path").send_keys(str(tmp_path / "nowhere.gguf"))
        one(browser, "#add-model-button").click()
        wait(browser, lambda d: notice.is_displayed() and "nowhere.gguf" in notice.text)
        one(browser, "#model-path").clear()
        one(browser, "#model-path").send_keys(str(gemma_path))
        one(browser, "#model-name").send_keys("my-gemma")
        one(browser, "#add-model-button").click()
        wait(browser, lambda d: by_css(d, "#models-table tr[data-name='my-gemma']"), message="the added model is missing")
        assert "added" in row(browser, "my-gemma").text and one(browser, "#model-path").get_attribute("value") == ""


def test_a_real_model_switch_in_the_browser_answers_the_next_message_with_the_new_model(
        browser, tmp_path, smollm_path):
    from lodestar.engine.async_engine import AsyncLLMEngine
    from lodestar.engine.llm_engine import EngineConfig, LLMEngine
    from lodestar.engine.loader import load_model

    def build(model: str) -> AsyncLLMEngine:
        return AsyncLLMEngine(lambda: LLMEngine(load_model(model, progress=False), EngineConfig(
            max_num_seqs=2, kv_tokens=1024, max_model_len=512)), max_queued=4)

    switch = (EngineFactory(build, context=512, kv_tokens=1024), ModelRegistry(tmp_path / "models.json"))
    first = build(str(smollm_path))
    with serving(first, tmp_path / "agent.db", switch_with=switch) as url:
        open_page(browser, url, "#/models")
        button = lambda d: one(d, "#models-table tr[data-name='gemma3-270m'] button.load")
        wait(browser, lambda d: button(d).is_enabled(), message="the models were not listed")
        button(browser).click()
        wait(browser, lambda d: one(d, "#served-model").text == "gemma3-270m", timeout=60,
             message="the switch to the real gemma3-270m did not happen")

        r = httpx.post(f"{url}/api/conversations", json={"settings": {"temperature": 0, "max_tokens": 8}}, timeout=10)
        cid = r.json()["id"]
        open_page(browser, url, f"#/chat/{cid}")
        send(browser, "The capital of France is")
        answer = wait_reply_done(browser, count=1, timeout=60)
        text = stored(url, cid)["messages"][-1]["content"]
        assert text.strip() and text.strip()[:20] in answer.text
        direct = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "gemma3-270m", "messages": [{"role": "user", "content": "The capital of France is"}],
            "temperature": 0, "max_tokens": 8}).json()
        assert direct["choices"][0]["message"]["content"] == text        # the page was answered by gemma3
        assert [r["model"] for r in httpx.get(f"{url}/api/stats", timeout=10).json()["requests"]] == ["gemma3-270m"] * 2
        browser.get("about:blank")


# -- reports -------------------------------------------------------------------------------------
def test_reports_view_shows_the_bench_report_in_a_sandboxed_frame(browser, fake_engine, tmp_path, console):
    if not (BENCH_RESULTS / "cpu-decode.json").is_file():
        pytest.skip(f"{BENCH_RESULTS} holds no cpu-decode.json (a source checkout has it)")
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(BENCH_RESULTS / "cpu-decode.json", results)
    with serving(fake_engine, tmp_path / "agent.db", bench_results=results) as url:
        open_page(browser, url, "#/report")
        frame = one(browser, "#report-frame")
        wait(browser, lambda d: frame.get_attribute("srcdoc"), message="the report did not load")
        assert frame.get_attribute("sandbox") == ""                       # no scripts in the report's frame
        browser.switch_to.frame(frame)
        try:
            wait(browser, lambda d: by_css(d, "table"), message="the report has no table")
        finally:
            browser.switch_to.default_content()
        assert one(browser, "#report-open").get_attribute("href") == url + "/report"

        console.append("status of 404")
        shutil.rmtree(results)
        open_page(browser, url, "#/report")
        notice = one(browser, "#report-notice")
        wait(browser, lambda d: notice.is_displayed(), message="no notice without results")
        assert "--bench-results" in notice.text and not one(browser, "#report-frame").is_displayed()


# -- screenshots for docs/web-app.md -------------------------------------------------------------
ANSWER = ("<think>", "The user wants", " to read a file", " lazily, line by line.", "</think>",
          "Iterate over the file object: it yields", " one line at a time, so even a huge file", " never sits in memory.",
          "\n\n```python\nwith open(\"server.log\", encoding=\"utf-8\") as f:\n    for number, line in enumerate(f, 1):",
          "\n        if \"ERROR\" in line:\n            print(number, line.rstrip())\n```\n\n",
          "- `encoding=` avoids", " the platform default\n", "- `line.rstrip()` drops", " the newline\n")
APP_PY = "def main():\n    print(\"hello\")\n"


def _agent_demo(project: Path) -> ScriptedClient:
    (project / "tests").mkdir(parents=True)
    (project / "app.py").write_text(APP_PY)
    return ScriptedClient([
        reply("Let me read the file first.", call("read", id="c1", path="app.py")),
        reply("I'll add a `greet` function and call it from `main`.",
              call("edit", id="c2", path="app.py", old=APP_PY,
                   new="def greet(name):\n    return f\"Hello, {name}!\"\n\n\n"
                       "def main():\n    print(greet(\"world\"))\n")),
        reply("Now the tests.", call("shell", id="c3", command="python -m pytest -q tests")),
    ])


@pytest.mark.skipif(not os.environ.get("LODESTAR_SCREENSHOTS"),
                    reason="set LODESTAR_SCREENSHOTS=DIR to write the screenshots of docs/web-app.md")
def test_screenshots_of_every_view(browser, tokenizer, smollm_path, tmp_path):
    out = Path(os.environ["LODESTAR_SCREENSHOTS"])
    out.mkdir(parents=True, exist_ok=True)
    project = tmp_path / "demo-app"
    client = _agent_demo(project)
    engine = standing_in(tokenizer, smollm_path)
    script = engine.script
    switch = (EngineFactory(lambda path: standing_in(tokenizer, path)), ModelRegistry(tmp_path / "models.json"))
    config = {"agent_client": client, "bench_results": BENCH_RESULTS, "projects": (str(project),),
              "switch_with": switch}
    browser.set_window_size(1280, 800)

    def shoot(route: str, name: str, ready, themes=("light", "dark")):
        for theme in themes:
            browser.execute_script(f"localStorage.setItem('lodestar.theme', '{theme}')")
            browser.get(f"{url}/{route}")
            browser.refresh()
            wait(browser, ready, timeout=15, message=f"{name} was not ready")
            time.sleep(0.3)                                          # the last frame's render
            browser.save_screenshot(str(out / f"{name}-{theme}.png"))

    with serving(engine, tmp_path / "agent.db", **config) as url:
        open_page(browser, url)
        script.pieces, script.cached_tokens = ("Sure: the file object is an iterator.",), 0
        send(browser, "Is a file object an iterator?")
        wait_reply_done(browser)
        one(browser, "#new-chat").click()
        script.pieces, script.step_delay, script.cached_tokens = ANSWER, 0.005, 24
        send(browser, "How do I scan a big log file for errors in Python?")
        wait_reply_done(browser)
        chat = browser.current_url.split("/", 3)[3]
        shoot(chat, "chat", lambda d: replies(d) and replies(d)[-1].get_attribute("aria-busy") == "false")
        with phone(browser):
            shoot(chat, "chat-mobile", lambda d: replies(d), themes=("light",))

        open_page(browser, url, "#/agent")
        wait(browser, lambda d: by_css(d, "#project option"))
        send(browser, "Add a greet function to app.py and run the tests", prompt="#agent-prompt")
        wait(browser, lambda d: by_css(d, ".tool-card[data-state='waiting'] button.approve"), timeout=15)
        one(browser, ".tool-card[data-state='waiting'] button.approve").click()
        wait(browser, lambda d: len(by_css(d, ".tool-card")) == 3 and by_css(d, ".tool-card[data-state='waiting']"))
        agent = browser.current_url.split("/", 3)[3]
        shoot(agent, "agent", lambda d: by_css(d, ".tool-card[data-state='waiting'] button.approve"))

        script.pieces, script.step_delay = ("tok ",) * 80, 0.02
        load = threading.Thread(target=lambda: [_load(url, 4) for _ in range(10)])
        load.start()

        def charts_drawn(d) -> bool:                                 # a few seconds of samples under load
            ys = [float(p.split()[1]) for p in one(d, "#chart-decode path").get_attribute("d")[1:].split("L") if p]
            return len(ys) >= 6 and min(ys) < 100.0 and by_css(d, "#requests-table tbody tr[data-id]")
        shoot("#/stats", "dashboard", charts_drawn)
        load.join()
        shoot("#/models", "models", lambda d: by_css(d, "#models-table tbody tr"))
        shoot("#/report", "report", lambda d: one(d, "#report-frame").get_attribute("srcdoc"))
        browser.get("about:blank")
    browser.set_window_size(*WIDE)
