"""The playground (/) and the live view (/dashboard) in a real headless Chromium, against
the real stack (uvicorn, the API, the AsyncEngine) serving the embedded SmolLM2 (issue 36):

- both pages load with no console error, on a desktop and a phone-sized screen;
- a seeded chat typed with the keyboard streams into the page, and its final text equals the
  API's answer to the same request (the body the page sent, read back from it);
- completions coloured by logprob show the alternatives on focus;
- under a bounded load the live view shows running sequences and used KV blocks, and both
  return to zero after;
- with --api-key the event stream refuses a request without the key, and the page works
  once the key is typed in.

Screenshots of both pages are written to PAGEDSERVE_SCREENSHOTS (a folder) when it is set:
`PAGEDSERVE_SCREENSHOTS=docs/images make test ARGS=tests/ui` refreshes the README's.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.worker.model_runner import ModelRunner
from tests.support.livetools import Live, live_server

pytestmark = pytest.mark.slow  # the real SmolLM2

KEY = "sesame"
WAIT_MS = 60_000


@pytest.fixture(scope="module")
def live(smollm2_runner: ModelRunner) -> Iterator[Live]:
    with live_server(smollm2_runner, max_model_len=512, max_num_seqs=4,
                     max_num_batched_tokens=128) as server:
        yield server


def watched_page(context: Any) -> tuple[Any, list[str]]:
    """A new page and the list its console errors and uncaught exceptions go to."""
    p = context.new_page()
    errors: list[str] = []
    p.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    p.on("pageerror", lambda e: errors.append(str(e)))
    return p, errors


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page whose console errors and uncaught exceptions fail the test."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    p, errors = watched_page(context)
    yield p
    context.close()
    assert errors == [], errors


def screenshot(page: Any, name: str) -> None:
    folder = os.environ.get("PAGEDSERVE_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / name), full_page=True)


def card(page: Any, key: str) -> int:
    return int(page.inner_text(f'[data-engine="engine"] [data-k="{key}"]'))


def test_pages_load_on_desktop_and_phone_screens(live: Live, browser: Any) -> None:
    for width, height in ((1280, 860), (390, 844)):
        context = browser.new_context(viewport={"width": width, "height": height})
        p, errors = watched_page(context)
        p.goto(live.url + "/")
        p.wait_for_function("document.getElementById('model').textContent === 'tiny'")
        p.goto(live.url + "/dashboard")
        p.wait_for_function("Number(document.body.dataset.events || 0) >= 1")
        for path in ("/", "/dashboard"):
            p.goto(live.url + path)
            overflow = p.evaluate("document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 1, (width, path, overflow)  # no sideways scrolling
        context.close()
        assert errors == [], (width, errors)


def test_a_seeded_chat_streams_and_equals_the_apis_answer(live: Live, page: Any) -> None:
    page.goto(live.url + "/")
    page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
    page.fill("#system", "You are a concise assistant.")
    page.fill("#temperature", "0.8")
    page.fill("#seed", "11")
    page.fill("#max_tokens", "40")
    # Count how often the answer's text changes while it streams.
    page.evaluate("""() => {
        window.changes = 0;
        new MutationObserver(() => { window.changes += 1; })
            .observe(document.getElementById('log'),
                     {subtree: true, childList: true, characterData: true});
    }""")
    page.focus("#message")
    page.keyboard.type("Name three colours.")
    page.keyboard.press("Enter")  # the keyboard sends
    page.wait_for_selector('.msg.assistant[data-done="true"]', timeout=WAIT_MS)
    shown = page.inner_text(".msg.assistant")
    assert page.evaluate("window.changes") >= 5  # streamed, not set once
    body = page.evaluate("state.lastRequest.body")
    assert body["seed"] == 11 and body["messages"][0]["role"] == "system"
    body.pop("stream_options")
    api = httpx.post(live.url + "/v1/chat/completions", json={**body, "stream": False},
                     timeout=60).json()
    assert shown == api["choices"][0]["message"]["content"] and shown
    stats = page.inner_text("#stats")
    assert "TTFT" in stats and "tokens/s" in stats and "cached" in stats
    assert page.get_attribute("#stats", "data-finish") == api["choices"][0]["finish_reason"]
    screenshot(page, "playground.png")


def test_completion_tokens_are_coloured_with_their_alternatives(live: Live, page: Any) -> None:
    page.goto(live.url + "/")
    page.select_option("#mode", "completion")
    page.fill("#max_tokens", "12")
    page.fill("#seed", "3")
    page.click("#send")
    page.wait_for_selector('#completion-out[data-done="true"]', timeout=WAIT_MS)
    tokens = page.locator("#completion-out .tok")
    generated = re.search(r"(\d+) completion tokens", page.inner_text("#stats"))
    assert generated is not None and tokens.count() == int(generated.group(1)) >= 3
    tokens.nth(2).focus()  # tokens are reachable by keyboard; focus shows the tooltip
    tip = page.inner_text("#tip")
    assert page.is_visible("#tip") and "p=" in tip and len(tip.splitlines()) >= 3
    page.click("#copy-python")
    snippet = page.text_content("#snippet") or ""
    assert "client.completions.create(" in snippet and "seed=3" in snippet


def test_live_view_follows_a_load_and_returns_to_zero(live: Live, page: Any) -> None:
    page.goto(live.url + "/dashboard")
    page.select_option("#rate", "100")
    page.wait_for_function("Number(document.body.dataset.events || 0) >= 1")
    assert card(page, "running") == 0 and card(page, "kv_used") == 0

    def one(i: int) -> None:
        httpx.post(live.url + "/v1/completions", timeout=120,
                   json={"prompt": f"Story {i}: once upon a time", "max_tokens": 48,
                         "ignore_eos": True})

    load = [threading.Thread(target=one, args=(i,)) for i in range(6)]  # > max_num_seqs
    for t in load:
        t.start()
    try:
        page.wait_for_function(
            """() => Number(document.querySelector('[data-k="running"]').textContent) > 0
                  && Number(document.querySelector('[data-k="kv_used"]').textContent) > 0""",
            timeout=WAIT_MS)
        assert page.locator('[data-k="requests"] tr').count() >= 1
        page.wait_for_function(  # the batch full: 4 running, 2 waiting (for the picture)
            """() => Number(document.querySelector('[data-k="running"]').textContent) === 4
                  && Number(document.querySelector('[data-k="waiting"]').textContent) === 2""",
            timeout=WAIT_MS)
        screenshot(page, "dashboard.png")
    finally:
        for t in load:
            t.join(120)
    page.wait_for_function(
        """() => Number(document.querySelector('[data-k="running"]').textContent) === 0
              && Number(document.querySelector('[data-k="kv_used"]').textContent) === 0
              && document.querySelectorAll('[data-k="requests"] tr').length === 0""",
        timeout=WAIT_MS)
    # The timeline saw the batch full: max_num_seqs (4) decode rows in a step.
    assert page.evaluate("Math.max(...panels.engine.steps.map(s => s.decode_rows))") == 4


def test_api_key_guards_the_event_stream_and_the_page_sends_it(
        smollm2_runner: ModelRunner, browser: Any) -> None:
    with live_server(smollm2_runner, api_key=KEY, max_model_len=512) as server:
        r = httpx.get(server.url + "/v1/engine/events?max_events=1", timeout=10)
        assert r.status_code == 401
        context = browser.new_context()
        page, errors = watched_page(context)  # it logs the refused request (401), nothing else
        page.goto(server.url + "/dashboard")
        page.wait_for_function(
            "document.getElementById('status').textContent.includes('401')")
        page.fill("#api-key", KEY)
        page.dispatch_event("#api-key", "change")
        page.wait_for_function("Number(document.body.dataset.events || 0) >= 1")
        assert page.inner_text("#status") == "live"
        context.close()
        assert errors and all("401" in e for e in errors), errors


def test_json_schema_mode_and_tools_send_the_apis_fields(live: Live, page: Any) -> None:
    page.goto(live.url + "/")
    page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "120")
    page.check("#json-mode")
    page.fill("#message", "What is the capital of France? Answer in JSON.")
    page.click("#send")
    page.wait_for_selector('.msg.assistant[data-done="true"]', timeout=WAIT_MS)
    body = page.evaluate("state.lastRequest.body")
    assert body["response_format"]["type"] == "json_schema"
    answer = json.loads(page.inner_text(".msg.assistant"))  # the grammar held
    assert isinstance(answer["answer"], str)

    page.click("#clear")
    page.uncheck("#json-mode")
    page.check("#tools-mode")
    page.fill("#message", "What is the weather in Paris?")
    page.click("#send")
    page.wait_for_selector('.msg.assistant[data-done="true"]', timeout=WAIT_MS)
    body = page.evaluate("state.lastRequest.body")
    assert body["tools"][0]["function"]["name"] == "get_weather"
    assert page.locator(".msg.error").count() == 0
    finish = page.get_attribute("#stats", "data-finish")
    calls = page.locator(".msg.assistant .calls")
    assert finish in ("stop", "length", "tool_calls")
    assert (finish == "tool_calls") == (calls.count() == 1)
