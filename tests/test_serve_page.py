"""The chat page at / in a real browser (Debian's chromium, headless, driven by Selenium with the system's
chromedriver): type a message, see streamed text arrive, press stop; the next message gets an answer and a
tokens/s line. Skipped, with the reason, where no browser or driver is installed."""

from __future__ import annotations

import shutil

import pytest

from serve_helpers import ScriptedModel, engine_for, get, metrics, server, wait_for  # noqa: E402

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is a test extra: pip install -e '.[test]'")


def find(*names: str) -> str | None:
    return next((p for p in map(shutil.which, names) if p), None)


@pytest.fixture(scope="module")
def browser():
    binary = find("chromium", "chromium-browser", "google-chrome")
    driver = find("chromedriver")
    if binary is None or driver is None:
        pytest.skip("no headless browser: apt-get install chromium chromium-driver (found browser="
                    f"{binary}, driver={driver})")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--no-first-run", "--disable-extensions", "--window-size=1000,800"):
        opts.add_argument(arg)
    try:
        b = webdriver.Chrome(service=Service(executable_path=driver), options=opts)
    except Exception as exc:  # noqa: BLE001 - a browser that cannot start here is a skip, with its reason
        pytest.skip(f"chromium did not start: {str(exc).splitlines()[0]}")
    b.set_page_load_timeout(30)
    yield b
    b.quit()


def test_page_has_no_outside_resources(smollm2_model):
    with server(engine_for(str(smollm2_model)), ScriptedModel([1])) as s:
        status, headers, raw = get(s.url, "/")
    html = raw.decode()
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in html and "http://" not in html and "https://" not in html


def test_chat_page_streams_and_stops(smollm2_model, browser):
    from selenium.webdriver.common.by import By

    engine = engine_for(str(smollm2_model))
    model = ScriptedModel(engine.tokenizer.encode(" word" * 500, add_special=False), delay_s=0.02)
    with server(engine, model) as s:
        browser.get(s.url + "/")
        wait_for(lambda: browser.find_element(By.ID, "model").text == "test-model", what="the model name")
        box = browser.find_element(By.ID, "input")
        box.send_keys("Hello there")
        browser.find_element(By.ID, "send").click()

        def reply() -> str:
            found = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .content")
            return found[-1].text if found else ""

        first = wait_for(lambda: reply().count("word") >= 3 and reply(), what="streamed text")
        wait_for(lambda: len(reply()) > len(first), what="more streamed text")  # it keeps arriving
        assert browser.find_element(By.CSS_SELECTOR, ".msg.user").text == "Hello there"
        browser.find_element(By.ID, "stop").click()
        wait_for(lambda: metrics(s.url)["hybrid_requests_cancelled_total"] == 1, what="the server to stop it")
        stats = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"), what="stats")
        assert "(stopped)" in stats[-1].text
        stopped = reply()
        assert 0 < stopped.count("word") < 500
        assert browser.find_element(By.ID, "stop").get_attribute("disabled") is not None

        model.reply, model.delay_s = engine.tokenizer.encode("Bonjour 🎉", add_special=False), 0.0
        box.send_keys("Again")
        browser.find_element(By.ID, "send").click()
        wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")) == 2, what="2nd reply")
        assert reply() == "Bonjour 🎉"
        last = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")[-1].text
        assert "tokens/s" in last and "(stop)" in last
        # the conversation is kept in the page: the second request carried the first turn (found in the cache)
        assert "Again" in engine.tokenizer.decode(model.prompts[-1]) and model.started == 2
        assert metrics(s.url)["hybrid_prompt_cache_tokens_total"] > 0
