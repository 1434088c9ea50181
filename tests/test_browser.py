"""The page in a real browser: Debian chromium driven by Playwright. A run streams the autoregressive tokens, then the
speculative ones, then races them; the step inspector explains a rejection; Stop ends a run; "Use best k" sets k.
The default run's test writes the time from the click to the first token and to the end (SPECDEMO_LIVE_TIMING=<folder>
also times a second, warm run there); a hybrid run takes the README's screenshot (assets/screenshot.png when
SPECDEMO_UPDATE_SCREENSHOT=1)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from specdemo.ui import EXAMPLES

from test_app_client import SERVER_CPU, pinned, server  # noqa: F401  (server: the shared app.py fixture)

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
README_SCREENSHOT = Path(__file__).resolve().parent.parent / "assets" / "screenshot.png"
JSON_PROMPT = next(p for c, p in EXAMPLES if c == "structured output")  # prompt lookup hits and misses here
SUMMARIZE = next(p for c, p in EXAMPLES if c == "summarize")  # the bundled target copies much of the paragraph
HYBRID = "Bundled SmolLM2-135M + trained draft + prompt lookup (offline)"

# Logs (ms since the click on Run, status line, AR tokens shown, SD spans shown) at every change of the page, so the
# order of what was on screen is checked without depending on how fast anything ran.
RECORDER = """
() => {
  window.__log = []; window.__click = null;
  const snap = () => {
    const s = (document.querySelector('#status [data-testid=markdown]')?.innerText || '').trim();
    const ar = document.querySelectorAll('#ar-panel span.tok-plain').length;
    const sd = document.querySelectorAll('#sd-panel .tok-panel span').length;
    const last = window.__log[window.__log.length - 1];
    if (window.__click !== null && (!last || last.s !== s || last.ar !== ar || last.sd !== sd))
      window.__log.push({t: performance.now() - window.__click, s, ar, sd});
  };
  if (!window.__observer) {
    document.querySelector('#run').addEventListener('click', () => { window.__click = performance.now(); }, true);
  } else {
    window.__observer.disconnect();
  }
  window.__observer = new MutationObserver(snap);
  window.__observer.observe(document.body, {subtree: true, childList: true, characterData: true});
}
"""
STATUS = "(document.querySelector('#status [data-testid=markdown]')?.innerText || '').trim()"  # the text, no timer
# Done after this click: a Done status that follows a status of this run
FINISHED = """() => { const log = window.__log || [];
  const i = log.findIndex(e => e.s.startsWith('Computing'));
  return i >= 0 && log.slice(i).some(e => e.s.startsWith('Done')); }"""

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def page(request):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"Debian chromium is not at {CHROMIUM} (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    url = request.getfixturevalue("server")
    if pinned():  # the browser (a child of this process) keeps off the server's core
        os.sched_setaffinity(0, set(range(os.cpu_count())) - {SERVER_CPU})
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url, wait_until="load")
        yield page
        browser.close()


@pytest.fixture
def fresh(page):
    """The page as a new visitor gets it."""
    page.reload(wait_until="load")
    page.wait_for_selector("#run")
    return page


def set_number(page, label: str, value: int) -> None:
    box = page.get_by_label(f"number input for {label}")
    box.fill(str(value))
    box.press("Enter")


def run(page, timeout: float = 300_000) -> list[dict]:
    """Click Run and wait for this run's Done; the page's log of what it showed."""
    page.evaluate(RECORDER)
    page.locator("#run").click()
    page.wait_for_function(FINISHED, timeout=timeout)
    return page.evaluate("window.__log")


def test_the_default_run_streams_live_races_and_explains_a_rejection(fresh):
    """The default preset, prompt and settings: AR tokens show while the status says the AR run is being computed
    and no speculative token exists yet; the speculative panel shows its tokens, all of them before the race
    starts; the race starts from empty panels; then a click on a rejected token opens the inspector with p and q."""
    page = fresh
    log = run(page)
    ar_live = [e for e in log if e["s"].startswith("Computing the autoregressive run") and e["ar"] > 0]
    assert ar_live and ar_live[0]["sd"] == 0, log[:20]
    race = next(i for i, e in enumerate(log) if e["s"].startswith("Race"))
    final = log[-1]
    sd_live = [e["sd"] for e in log[:race] if e["s"].startswith("Computing the speculative run")]
    assert sd_live and max(sd_live) == final["sd"]  # the speculative panel was full before the race started
    assert min(e["sd"] for e in log[race:]) < final["sd"]  # the race replays from t = 0
    stats = page.locator("#stats").inner_text()
    assert "Speedup" in stats and "outputs: identical" in stats and "cost ratio c" in stats, stats
    timing = {"first_token_s": ar_live[0]["t"] / 1000, "race_start_s": log[race]["t"] / 1000,
              "done_s": final["t"] / 1000, "load_average": os.getloadavg(), "summary": stats}

    rejected = page.locator("#sd-panel span.tok-rejected").first
    rejected.click()
    inspector = page.locator("#inspector")
    text = inspector.inner_text()
    assert "rejected" in text and "p (target" in text and "q (draft)" in text and "Why:" in text, text
    assert "Target's top 5" in text and "Top-2 logit gap" in text
    assert page.locator("#sd-panel .tok-selected").count() >= 2  # the clicked step's spans are marked
    _write_timing(page, timing)


def _write_timing(page, first: dict) -> None:
    """tests/artifacts/live-timing.json; with SPECDEMO_LIVE_TIMING=<folder>, a second (warm) run too, there."""
    out = Path(os.environ.get("SPECDEMO_LIVE_TIMING") or ARTIFACTS)
    report = {"what": "seconds from the click on Run to the first visible autoregressive token, to the start of the "
                      "race and to Done, for the default preset, prompt and settings", "first_run": first}
    if os.environ.get("SPECDEMO_LIVE_TIMING"):
        log = run(page)
        live = (e for e in log if e["s"].startswith("Computing the autoregressive run") and e["ar"] > 0)
        report["warm_run"] = {"first_token_s": next(live)["t"] / 1000,
                              "race_start_s": next(e["t"] for e in log if e["s"].startswith("Race")) / 1000,
                              "done_s": log[-1]["t"] / 1000, "load_average": os.getloadavg(),
                              "summary": page.locator("#stats").inner_text()}
        # the same run through the API on the same server, no page drawing it: do the page's own rendering and the
        # live frames change the measured tokens/s? (the browser shares this machine's CPU with the timed runs)
        from gradio_client import Client

        prompt = page.locator("#prompt textarea").input_value()
        api = Client(page.url, verbose=False).predict(prompt, "smollm2-135m", "model", "smollm2-135m-draft", 4,
                                                      False, 0.0, 1.0, 128, False, False, api_name="/compare")[7]
        report["api_run_same_server"] = {k: api[k] for k in ("speedup", "identical")} | {
            "ar_tokens_per_s": api["ar"]["tokens_per_s"], "sd_tokens_per_s": api["sd"]["tokens_per_s"],
            "acceptance_rate": api["sd"]["acceptance_rate"], "load_average": os.getloadavg()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "live-timing.json").write_text(json.dumps(report, indent=2) + "\n")


def test_the_readme_screenshot_is_a_finished_hybrid_run_with_the_inspector_open(fresh):
    """The trained draft + prompt lookup preset at k = 4 on the summarize example, 128 tokens, raced: both panels,
    the inspector open on a rejected draft, the summary with the hybrid's line and all five plots are on the page
    when it is saved. The speedup in it is whatever this run measured (look before committing it): an extractive
    best case, since the 135M target repeats much of the paragraph and prompt lookup drafts it."""
    page = fresh
    page.get_by_label("Preset pair").click()
    page.get_by_role("option", name=HYBRID, exact=True).click()
    page.wait_for_function("document.querySelector('input[value=hybrid]')?.checked")
    page.locator("#prompt textarea").fill(SUMMARIZE)
    set_number(page, "k (draft tokens per step)", 4)
    set_number(page, "max new tokens", 128)
    run(page)
    stats = page.locator("#stats").inner_text()
    assert "Speedup" in stats and "hybrid:" in stats and "outputs: identical" in stats, stats
    page.locator("#sd-panel span.tok-rejected, #sd-panel span.tok-correction").first.click()
    assert "Why:" in page.locator("#inspector").inner_text()
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 5")
    ARTIFACTS.mkdir(exist_ok=True)
    path = README_SCREENSHOT if os.environ.get("SPECDEMO_UPDATE_SCREENSHOT") == "1" else ARTIFACTS / "screenshot.png"
    page.mouse.move(0, 0)  # no hover state in the picture
    page.evaluate("window.scrollTo(0, 0)")  # the click scrolled; the box below is relative to the viewport
    below = page.locator("#result").bounding_box()  # the page down to the plots; the long JSON stays out
    page.screenshot(path=str(path), full_page=True, clip={"x": 0, "y": 0, "width": 1400, "height": below["y"] - 4})


def test_a_run_shows_every_kind_of_token_and_replays_without_computing(fresh):
    """Prompt lookup on a JSON prompt: accepted, rejected and correction/bonus spans appear, stats show; hiding
    rejected drafts re-renders the panel; Replay race races again without computing anything."""
    page = fresh
    page.locator("#prompt textarea").fill(JSON_PROMPT)
    page.get_by_label("prompt lookup").check()
    set_number(page, "max new tokens", 24)
    run(page)
    sd = page.locator("#sd-panel")
    counts = {cls: sd.locator(f"span.{cls}").count()
              for cls in ("tok-target", "tok-accepted", "tok-rejected", "tok-correction", "tok-bonus")}
    assert counts["tok-accepted"] > 0 and counts["tok-rejected"] > 0, counts
    assert counts["tok-correction"] + counts["tok-bonus"] > 0, counts
    assert page.locator("#ar-panel span.tok-plain").count() == 24
    assert counts["tok-target"] + counts["tok-accepted"] + counts["tok-correction"] + counts["tok-bonus"] == 24
    assert page.locator(".tok-legend").is_visible()
    page.get_by_label("hide rejected drafts").check()
    page.wait_for_selector("#sd-panel .hide-rejected")
    assert sd.locator("span.tok-rejected").first.is_hidden()
    page.evaluate(RECORDER)
    page.evaluate("window.__click = performance.now()")
    page.locator("#replay").click()
    page.wait_for_function(f"window.__log.some(e => e.s.startsWith('Race')) && {STATUS}.startsWith('Done')",
                           timeout=60_000)
    assert not any(e["s"].startswith(("Computing", "Loading", "Warming")) for e in page.evaluate("window.__log"))
    assert page.locator("#ar-panel span.tok-plain").count() == 24


def test_stop_ends_a_run_and_the_next_run_is_served(fresh):
    """Stop while the AR run streams: the status says Stopped, stays so, and the panel stopped short of the length;
    the next Run finishes normally."""
    page = fresh
    page.get_by_label("prompt lookup").check()
    set_number(page, "max new tokens", 256)
    page.evaluate(RECORDER)
    page.locator("#run").click()
    page.wait_for_function("window.__log.some(e => e.s.startsWith('Computing the autoregressive') && e.ar > 0)",
                           timeout=300_000)
    page.locator("#stop").click()
    page.wait_for_function(f"{STATUS}.startsWith('Stopped')", timeout=30_000)
    shown = page.locator("#ar-panel span.tok-plain").count()
    assert shown < 256
    page.wait_for_timeout(1000)  # nothing of the stopped run arrives after its "Stopped."
    assert page.evaluate(STATUS) == "Stopped." and page.locator("#ar-panel span.tok-plain").count() == shown
    set_number(page, "max new tokens", 12)
    run(page)
    assert page.locator("#ar-panel span.tok-plain").count() == 12


def test_use_best_k_after_a_sweep_sets_k(fresh):
    """Tune k sweeps k = 1..2 on a short run; the button then carries the best measured k and sets the k slider."""
    page = fresh
    page.get_by_label("prompt lookup").check()
    set_number(page, "max new tokens", 8)
    set_number(page, "k (draft tokens per step)", 7)
    page.get_by_role("tab", name="Tune k").click()
    set_number(page, "largest k", 2)
    page.get_by_role("button", name="Sweep k").click()
    page.wait_for_function("[...document.querySelectorAll('.prose')].some(p => p.innerText.includes("
                           "'Done: best measured k'))", timeout=300_000)
    apply = page.get_by_role("button", name="Use k = ")
    best = int(apply.inner_text().split("=")[1])
    assert best in (1, 2)
    apply.click()
    page.get_by_role("tab", name="Race").click()
    page.wait_for_function(f"document.querySelector('input[aria-label=\"number input for k (draft tokens per "
                           f"step)\"]').value === '{best}'", timeout=10_000)
