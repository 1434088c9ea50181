"""The page in a real browser: Debian chromium driven by Playwright runs a prompt and shows colored tokens, and
takes the README's screenshot (written to assets/screenshot.png when SPECDEMO_UPDATE_SCREENSHOT=1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specdemo.ui import EXAMPLES

from test_app_client import server  # noqa: F401  (the shared app.py fixture)

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
README_SCREENSHOT = Path(__file__).resolve().parent.parent / "assets" / "screenshot.png"
JSON_PROMPT = next(p for c, p in EXAMPLES if c == "structured output")  # prompt lookup hits and misses here
SUMMARIZE = next(p for c, p in EXAMPLES if c == "summarize")  # the bundled target copies much of the paragraph
HYBRID = "Bundled SmolLM2-135M + trained draft + prompt lookup (offline)"

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


def choose(page, label: str, option: str) -> None:
    page.get_by_label(label).click()
    page.get_by_role("option", name=option, exact=True).click()


def wait_done(page) -> None:
    page.wait_for_function("document.querySelector('#status')?.innerText.includes('Done')", timeout=300_000)


def test_a_run_shows_both_panels_with_every_kind_of_token(page):
    """Prompt lookup on a JSON prompt: accepted, rejected and correction/bonus spans appear, stats show."""
    page.locator("#prompt textarea").fill(JSON_PROMPT)
    page.get_by_label("prompt lookup").check()
    set_number(page, "max new tokens", 24)
    page.locator("#run").click()
    wait_done(page)
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


def test_the_readme_screenshot_is_a_finished_hybrid_run(page):
    """The trained draft + prompt lookup preset at k = 4 on the summarize example, 128 tokens, replayed: both
    panels, the summary with the hybrid's line and all three plots are on the page when it is saved, down to the
    plots. The speedup in it is whatever this run measured (look before committing it): an extractive best case,
    since the 135M target repeats much of the paragraph and prompt lookup drafts it."""
    page.reload(wait_until="load")
    choose(page, "Preset pair", HYBRID)
    page.wait_for_function("document.querySelector('input[value=hybrid]')?.checked")
    page.locator("#prompt textarea").fill(SUMMARIZE)
    set_number(page, "k (draft tokens per step)", 4)
    set_number(page, "max new tokens", 128)
    page.locator("#run").click()
    wait_done(page)
    stats = page.locator("#stats").inner_text()
    assert "Speedup" in stats and "hybrid:" in stats and "outputs: identical" in stats, stats
    assert page.locator("#sd-panel span.tok-accepted").count() > 0
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 3")
    ARTIFACTS.mkdir(exist_ok=True)
    path = README_SCREENSHOT if os.environ.get("SPECDEMO_UPDATE_SCREENSHOT") == "1" else ARTIFACTS / "screenshot.png"
    page.mouse.move(0, 0)  # no hover state in the picture
    below = page.locator("#result").bounding_box()  # the page down to the plots; the long JSON stays out
    page.screenshot(path=str(path), full_page=True, clip={"x": 0, "y": 0, "width": 1400, "height": below["y"] - 4})
