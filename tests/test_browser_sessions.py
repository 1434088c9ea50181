"""Two visitors in Chromium (two browser contexts, so two gradio sessions) on one app.py, with suffix decoding: the
second never drafts from the first's answer nor sees its text; the first's own later run does draft from its earlier
answer, the inspector says so, and after Clear suffix cache it no longer does. Short runs on the bundled model."""

from __future__ import annotations

import pytest
from test_app_client import server  # noqa: F401  (the shared app.py)
from test_browser import STATUS, browser, pick_drafter, run, set_number  # noqa: F401  (browser: one chromium)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CODE = "QUOKKA-7741-ZEPHYR"  # what A's answer repeats, and nothing of B's should
A_PROMPT = f"Repeat this code word three times, separated by spaces: {CODE}"
B_PROMPT = "Repeat this code word three times, separated by spaces: MARLIN-2290-DELTA"
TOKENS = 24
# three visitors (browser contexts): A, B with a related prompt, C with A's very prompt

# every speculative step's inspector data on the panel: its draft source and its drafted texts
STEPS = """() => [...document.querySelectorAll('#sd-panel span[data-info]')].map(s => JSON.parse(s.dataset.info))"""


def visit(chromium, url: str):
    """A new visitor: a browser context of its own (its own cookies and gradio session), suffix decoding at k = 8."""
    page = chromium.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    page.goto(url, wait_until="load")
    page.wait_for_selector("#run")
    pick_drafter(page, "suffix decoding", "suffix")
    set_number(page, "k (draft tokens per step)", 8)
    set_number(page, "max new tokens", TOKENS)
    return page


def race(page, prompt: str) -> list[dict]:
    """Run `prompt`; each step's inspector data."""
    page.locator("#prompt textarea").fill(prompt)
    assert run(page)[-1]["s"].startswith("Done")
    return page.evaluate(STEPS)


def sources(steps: list[dict]) -> set[str]:
    return {s["source"] for s in steps if s["drafted"]}


def test_two_visitors_never_share_suffix_decodings_earlier_answers(server, browser):  # noqa: F811
    a, b, c = (visit(browser, server) for _ in range(3))
    first = race(a, A_PROMPT)
    assert "earlier" not in sources(first)  # nothing before it in this session
    assert "7741" in a.evaluate("document.querySelector('#sd-panel').innerText")  # A's answer holds the code word
    steps = race(b, B_PROMPT)  # a related prompt
    assert "earlier" not in sources(steps), steps  # B's cache holds no answer of A's
    drafts = ["".join(d["text"] for d in s["drafted"]) for s in steps]  # rejected ones too
    panel = b.evaluate("document.querySelector('#sd-panel').innerText")
    assert not any(word in text for word in CODE.split("-") for text in [panel, *drafts]), (panel, drafts)
    page = b.evaluate("document.body.innerText")  # the numbers of B's result may hold any digits
    assert "QUOKKA" not in page and "ZEPHYR" not in page and "QUOKKA" not in b.content()
    same = race(c, A_PROMPT)  # A's very prompt, where A's answer would be the best match of all
    assert sources(same) and "earlier" not in sources(same), same
    again = race(a, A_PROMPT)
    assert "earlier" in sources(again), again  # A's own cache holds its first answer
    step = next(s for s in again if s["source"] == "earlier" and s["drafted"])
    a.locator(f"#sd-panel span[data-step='{step['step']}']").first.click()
    assert "Drafted from: an earlier answer in this browser session" in a.locator("#inspector").inner_text()
    assert "q (suffix decoding: 1)" in a.locator("#inspector").inner_text()
    a.locator("#clear-suffix").click()
    a.wait_for_function(f"{STATUS}.startsWith('Suffix cache cleared')", timeout=30_000)
    cleared = race(a, A_PROMPT)
    assert "earlier" not in sources(cleared), cleared
    for page in (a, b, c):
        page.context.close()
