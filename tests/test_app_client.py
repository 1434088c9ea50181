"""The app as users' programs see it: `python app.py` on 127.0.0.1, driven by gradio_client (slow): the environment
reaching the handlers, /compare streaming the CLI's JSON, a 200,000-character prompt refused within 5 s and the next
run served, bad values refused with a clear message (the sentence every entry point uses), Stop, the verification
rule, and two concurrent clients."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from specdemo.app.handlers import Handlers
from specdemo.app.race import AppLimits, preset_ids
from specdemo.app.ui import EXAMPLES
from specdemo.config import Runtime, tree_default

ROOT = Path(__file__).resolve().parent.parent
REWRITE = next(p for c, p in EXAMPLES if c == "rewrite")
CHAT = next(p for c, p in EXAMPLES if c == "open chat")
RESULT_KEYS = {"target", "draft", "drafter", "k", "dynamic_k", "temperature", "top_p", "max_new_tokens", "device",
               "dtype", "ar", "sd", "speedup", "identical"}

pytestmark = pytest.mark.slow


def test_app_reads_the_environment_and_hands_it_to_the_handlers():
    """make_app builds AppLimits and config.Runtime from the env it is given; the handlers hold exactly those."""
    import app

    env = {"SPECDEMO_MAX_NEW_TOKENS": "64", "SPECDEMO_MODEL_ALLOWLIST": "org/a, org/b", "SPECDEMO_DEVICE": "cpu",
           "SPECDEMO_CACHE": "/nowhere", "SPECDEMO_FAST_LINEAR": "0"}
    demo = app.make_app(env)
    (h,) = {fn.fn.__self__ for fn in demo.fns.values() if isinstance(getattr(fn.fn, "__self__", None), Handlers)}
    assert h.limits == AppLimits(max_new_tokens=64, allowlist=("org/a", "org/b"), device="cpu")
    assert h.runtime == Runtime(cache_dir="/nowhere", fast_linear=False)
    space = app.make_app({"SPACE_ID": "someone/specdemo", "SPECDEMO_MAX_PROMPT_TOKENS": "1000",
                          "SPECDEMO_ALLOW_LOCAL_PATHS": "1"})
    (h,) = {fn.fn.__self__ for fn in space.fns.values() if isinstance(getattr(fn.fn, "__self__", None), Handlers)}
    assert h.limits == AppLimits(allowlist=preset_ids(), max_prompt_tokens=1000, allow_local_paths=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVER_CPU = 0  # with SPECDEMO_TEST_PIN=1: app.py on this core, the browser and the test on the others


def pinned() -> bool:
    """SPECDEMO_TEST_PIN=1: give app.py a core of its own, so that the browser's drawing never shares the core a
    timed run uses (for the README screenshot and the page's timing figures on a small machine)."""
    return os.environ.get("SPECDEMO_TEST_PIN") == "1" and hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1


def launch(port: int, as_a_user: bool = False, **env) -> subprocess.Popen:
    """Start app.py on a port. By default with one torch thread, since the CPU is shared with the test
    (SPECDEMO_TEST_THREADS=2 for figures); `as_a_user`: as `bash run.sh app` starts it, with torch's own thread count
    and no pinning."""
    env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
           "GRADIO_ANALYTICS_ENABLED": "False", "SPECDEMO_MAX_NEW_TOKENS": "512", **env}
    if as_a_user:
        env.pop("OMP_NUM_THREADS", None)
    else:
        env["OMP_NUM_THREADS"] = os.environ.get("SPECDEMO_TEST_THREADS", "1")
    pin = (lambda: os.sched_setaffinity(0, {SERVER_CPU})) if pinned() and not as_a_user else None
    log = tempfile.NamedTemporaryFile("w+", prefix="specdemo-app-", suffix=".log", delete=False)  # a pipe nobody
    # reads would fill up with the server's log and stall it
    proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=pin)
    proc.log_path = log.name
    return proc


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"app.py exited:\n{Path(proc.log_path).read_text()}")
        try:
            with urllib.request.urlopen(url + "/config", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"app.py did not answer on {url}")


@contextmanager
def running_app(as_a_user: bool = False) -> Iterator[str]:
    """app.py on a free port (see launch) until the block ends; yields its URL."""
    port = free_port()
    proc = launch(port, as_a_user)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def server():
    """One app.py for the client and browser tests."""
    with running_app() as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    from gradio_client import Client

    return Client(server, verbose=False)


def args(prompt: str, max_new_tokens: int, replay: bool = True, k: int = 4) -> tuple:
    """/compare inputs: prompt, target, drafter, draft, k, dynamic_k, temperature, top_p, max new tokens,
    hide rejected, replay."""
    return (prompt, "smollm2-135m", "ngram", "", k, False, 0.0, 1.0, max_new_tokens, False, replay)


_first: dict = {}


def test_compare_endpoint_streams_and_returns_the_cli_json(client):
    """Partial outputs arrive before the end; the final JSON has generate --json's keys and identical == True."""
    job = client.submit(*args(REWRITE, 24), api_name="/compare")
    updates = list(job)
    result = job.outputs()[-1][7]
    assert len(updates) >= 3, updates
    assert RESULT_KEYS <= set(result), result
    assert result["identical"] is True and result["sd"]["tokens"] == 24
    assert result["ar"]["text"] == result["sd"]["text"]
    _first["rewrite"] = result


def test_stop_cancels_a_long_run_promptly_and_the_app_keeps_serving(client):
    """job.cancel() during a long run returns within seconds, and the next request is served right away."""
    job = client.submit(*args(REWRITE, 512), api_name="/compare")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until the engine is timing tokens
        outs = job.outputs()
        if any(isinstance(o[6], str) and o[6].startswith("Racing") for o in outs):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the long run never started: {job.outputs()[-1:]}")
    t0 = time.monotonic()
    job.cancel()
    assert time.monotonic() - t0 < 5
    t0 = time.monotonic()
    result = client.predict(*args(CHAT, 6, replay=False), api_name="/compare")[7]
    # the cancelled 512-token run would take far longer than this if its engine loop were still going
    assert result["identical"] is True and result["sd"]["tokens"] == 6
    assert time.monotonic() - t0 < 60


def test_a_huge_prompt_is_refused_at_once_and_the_next_run_is_served(client):
    """A 200,000-character prompt gets the length error within 5 s (no model work), and a run right after it is
    served normally."""
    t0 = time.monotonic()
    outputs = client.predict(*args("x" * 200_000, 8, replay=False), api_name="/compare")
    assert time.monotonic() - t0 < 5
    assert "too long: 200,000 characters" in outputs[6] and "error" in outputs[7], outputs[6]
    result = client.predict(*args(CHAT, 6, replay=False), api_name="/compare")[7]
    assert result["identical"] is True and result["sd"]["tokens"] == 6


def test_non_numeric_values_through_the_api_get_a_clear_message(client):
    """k = "abc" or max new tokens = "lots" come back as a readable status, not gradio's opaque error."""
    bad_k = (REWRITE, "smollm2-135m", "ngram", "", "abc", False, 0.0, 1.0, 8, False, False)
    outputs = client.predict(*bad_k, api_name="/compare")
    assert "k must be a whole number from 1 to 64, got 'abc'." in outputs[6]
    assert outputs[7] == {"error": outputs[6][len("**Error:** "):]}
    bad_tokens = (REWRITE, "smollm2-135m", "ngram", "", 4, False, 0.0, 1.0, "lots", False, False)
    assert "max new tokens must be a whole number" in client.predict(*bad_tokens, api_name="/compare")[6]
    sweep = client.predict(REWRITE, "smollm2-135m", "ngram", "", "many", 0.0, 1.0, 8, api_name="/sweep_k")
    assert "the largest k must be a whole number from 1 to 16, got 'many'." in sweep[1]


def test_the_api_refuses_with_the_sentence_every_entry_point_uses(client):
    """Each API case of test_checks.py's table through /compare: the error is the row's sentence, as the handler,
    generate and bench give it (the table runs them in test_checks.py). JSON has no nan or inf: a client sends them as
    text, as a command line does."""
    from test_checks import APP, ROWS, says

    for row in (r for r in ROWS if "api" in r.where):
        value = str(row.value) if isinstance(row.value, float) and not math.isfinite(row.value) else row.value
        error = client.predict(*{**APP, **row.also, row.setting: value}.values(), api_name="/compare")[7]["error"]
        assert says(error, row, "", 0), (row, error)


def test_a_sampled_run_through_the_api_takes_the_verification_rule(client):
    """/compare's last input is the rule for sampled drafts: block at temperature 1 comes back in the result; a
    client that sends the first 11 inputs only gets token-wise, the default."""
    sampled = (CHAT, "smollm2-135m", "ngram", "", 4, False, 1.0, 1.0, 8, False, False)
    assert client.predict(*sampled, "block", api_name="/compare")[7]["verification"] == "block"
    assert client.predict(*sampled, api_name="/compare")[7]["verification"] == "token"


def test_the_draft_tree_setting_is_the_last_input(client):
    """/compare's 13th input is the draft-tree setting: 8 nodes for prompt lookup comes back in the result, output
    unchanged; a client that sends the first 12 inputs only gets the drafter's measured default."""
    greedy = (CHAT, "smollm2-135m", "ngram", "", 4, False, 0.0, 1.0, 8, False, False, "token")
    trees = client.predict(*greedy, "8", api_name="/compare")[7]
    assert trees["identical"] is True and trees["tree"]["setting"] == "8" and trees["tree"]["nodes"] == 8
    assert client.predict(*greedy, api_name="/compare")[7]["tree"]["setting"] == tree_default("ngram")


def test_two_concurrent_clients_each_get_their_own_output(server):
    """Two clients at once: both finish, each with the text of its own prompt."""
    from gradio_client import Client

    def one(prompt):
        return Client(server, verbose=False).predict(*args(prompt, 16, replay=False), api_name="/compare")[7]

    with ThreadPoolExecutor(2) as pool:
        rewrite, chat = pool.map(one, [REWRITE, CHAT])
    for result in (rewrite, chat):
        assert result["identical"] is True and result["sd"]["tokens"] == 16
    assert rewrite["ar"]["text"] != chat["ar"]["text"]
    if "rewrite" in _first:  # greedy: the same prompt gives the same text as when it ran alone
        assert _first["rewrite"]["ar"]["text"].startswith(rewrite["ar"]["text"])
