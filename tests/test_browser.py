"""The page in a real browser: Debian chromium driven by Playwright runs a prompt and shows colored tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdemo.ui import EXAMPLES

from test_app_client import server  # noqa: F401  (the shared app.py fixture)

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
JSON_PROMPT = next(p for c, p in EXAMPLES if c == "structured output")  # prompt lookup hits and misses here

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def page(request):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"Debian chromium is not at {CHROMIUM} (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    url = request.getfixturevalue("server")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url)
        yield page
        browser.close()


def set_number(page, label: str, value: int) -> None:
    box = page.get_by_label(f"number input for {label}")
    box.fill(str(value))
    box.press("Enter")


def test_a_run_shows_both_panels_with_every_kind_of_token(page):
    """Prompt lookup on a JSON prompt: accepted, rejected and correction/bonus spans appear, stats show."""
    page.locator("#prompt textarea").fill(JSON_PROMPT)
    page.get_by_label("prompt lookup").check()
    set_number(page, "max new tokens", 24)
    page.locator("#run").click()
    page.wait_for_function("document.querySelector('#status')?.innerText.includes('Done')", timeout=180_000)
    sd = page.locator("#sd-panel")
    counts = {cls: sd.locator(f"span.{cls}").count()
              for cls in ("tok-target", "tok-accepted", "tok-rejected", "tok-correction", "tok-bonus")}
    assert counts["tok-accepted"] > 0 and counts["tok-rejected"] > 0, counts
    assert counts["tok-correction"] + counts["tok-bonus"] > 0, counts
    assert page.locator("#ar-panel span.tok-plain").count() == 24
    assert counts["tok-target"] + counts["tok-accepted"] + counts["tok-correction"] + counts["tok-bonus"] == 24
    stats = page.locator("#stats").inner_text()
    assert "Speedup" in stats and "acceptance rate" in stats and "mean accepted length" in stats
    assert page.locator(".tok-legend").is_visible()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser.png"), full_page=True)
    # hiding rejected drafts re-renders the finished panel without running again
    page.get_by_label("hide rejected drafts").check()
    page.wait_for_selector("#sd-panel .hide-rejected")
    assert sd.locator("span.tok-rejected").first.is_hidden()
