"""The playground at ``/``, driven in a real headless browser (Debian's chromium through Selenium).

The page is loaded from ``kvexport serve``'s app, a prompt typed, the stream started, and
the streamed text compared with the API's greedy text for the same request. A screenshot
is saved under ``test-artifacts/`` (git-ignored) for a person to look at.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from kvexport.serving.config import ApiConfig
from tests.test_serving import _server

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert binary and driver, "the browser test needs Debian's chromium and chromium-driver (scripts/install.sh installs them)"
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1100,800"):
        options.add_argument(flag)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield chrome
    finally:
        chrome.quit()


def _run_page(
    browser: webdriver.Chrome, url: str, prompt: str, *, tokens: int, mode: str | None = None, key: str | None = None, keep: bool = False
) -> str:
    """Type ``prompt``, run it and return the output's text; ``keep``: on the page as it is (else loaded afresh)."""
    if not keep:
        browser.get(url + "/")
    box = browser.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(prompt)
    for field, value in (("max-tokens", str(tokens)), ("temperature", "0")):
        element = browser.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)
    if mode is not None:
        browser.find_element(By.CSS_SELECTOR, f"#mode option[value={mode}]").click()
    if key is not None:
        browser.find_element(By.ID, "api-key").send_keys(key)
    browser.find_element(By.ID, "start").click()
    WebDriverWait(browser, 60).until(lambda b: b.find_element(By.ID, "status").text in ("done", "error"))
    assert browser.find_element(By.ID, "status").text == "done", browser.find_element(By.ID, "output").text
    assert browser.find_element(By.ID, "ttft").text.endswith(" ms")
    return str(browser.execute_script("return document.getElementById('output').textContent"))


def test_the_page_streams_the_apis_greedy_text(browser: webdriver.Chrome, trained_exports: dict[str, Path], tmp_path: Path) -> None:
    template_file = tmp_path / "chat.jinja"
    template_file.write_text(TEMPLATE)
    with _server(trained_exports["none"], ApiConfig(chat_template=str(template_file)), slots=2, max_context=128) as (url, _):
        prompt = "The class statement"
        shown = _run_page(browser, url, prompt, tokens=24, mode="completion")
        want = httpx.post(f"{url}/v1/completions", json={"model": "trained", "prompt": prompt, "max_tokens": 24, "temperature": 0}, timeout=60)
        assert shown == want.json()["choices"][0]["text"] and shown
        ARTIFACTS.mkdir(exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "playground.png"))
        # the chat mode, which the page opens in where the server has a template
        chat_shown = _run_page(browser, url, "What is a class?", tokens=12)
        chat = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "trained", "messages": [{"role": "user", "content": "What is a class?"}], "max_tokens": 12, "temperature": 0},
            timeout=60,
        )
        assert chat_shown == chat.json()["choices"][0]["message"]["content"]


def test_the_page_sends_the_key_when_the_server_has_one(browser: webdriver.Chrome, trained_exports: dict[str, Path]) -> None:
    with _server(trained_exports["none"], ApiConfig(api_key="page-key"), slots=2, max_context=64) as (url, _):
        assert httpx.get(f"{url}/", timeout=10).status_code == 200  # the page itself stays open
        shown = _run_page(browser, url, "The", tokens=6, key="page-key")
        want = httpx.post(
            f"{url}/v1/completions", json={"model": "trained", "prompt": "The", "max_tokens": 6, "temperature": 0},
            headers={"authorization": "Bearer page-key"}, timeout=60,
        )
        assert shown == want.json()["choices"][0]["text"]
        assert browser.find_element(By.ID, "mode-label").is_displayed() is False  # no template, no chat mode


def test_the_page_shows_a_tool_call_and_its_arguments(browser: webdriver.Chrome, trained_exports: dict[str, Path]) -> None:
    """Chat mode with the page's example tool and tool_choice "required": the call shows as the API makes it."""
    template = Path(__file__).parent / "data" / "templates" / "compact-tools.jinja"
    with _server(trained_exports["none"], ApiConfig(chat_template=str(template)), slots=2, max_context=256) as (url, _):
        browser.get(url + "/")
        assert [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#tool-choice option")] == [
            "off", "required", "none",  # no "auto" without --enable-auto-tool-choice
        ]
        browser.find_element(By.CSS_SELECTOR, "#tool-choice option[value=required]").click()
        tools = json.loads(browser.find_element(By.ID, "tools").get_attribute("value") or "")
        shown = _run_page(browser, url, "Weather in Paris?", tokens=40, keep=True)
        body = {
            "model": "trained", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 40, "temperature": 0,
            "tools": tools, "tool_choice": "required", "parallel_tool_calls": False,
        }
        (call,) = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]["tool_calls"]
        assert shown == f"call {call['function']['name']}({call['function']['arguments']})"
        assert browser.find_element(By.CSS_SELECTOR, "#output .call").is_displayed()
        browser.save_screenshot(str(ARTIFACTS / "playground-tool-call.png"))
