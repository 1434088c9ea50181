"""CPU seconds each process spends while the page runs the race (app.py as a user starts it, Debian's chromium, the
default run on the default prompt, 128 tokens), one page run per tree setting given, after one cold run: the compute
process (the two decoders), chromium, and app.py's server, over the whole run and over its compute phase (while the
compute process is busy, which is when the runs are timed).

    python scripts/page_cpu_share.py off auto off auto --out bench/app-live/cpu-share     # about 2 minutes

What it answers: whether a setting (draft trees) makes the page's own work (the server, the browser) take more of the
cores the runs are timed on. Linux only (/proc); needs the browser tests' chromium and playwright.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
os.chdir(ROOT)

from test_app_client import running_app  # noqa: E402
from test_browser import ARGS, CHROMIUM, EXAMPLES, SUMMARY, run, set_number  # noqa: E402

GROUPS = ("worker", "chromium", "app")


def group(cmd: str) -> str:
    if "chrom" in cmd:
        return "chromium"
    if "app.py" in cmd:
        return "app"
    if "multiprocessing" in cmd:
        return "worker"
    return "other"


def cpu_by_group() -> dict[str, float]:
    """CPU seconds (user + system) so far of every process, summed by group."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
        g = group(cmd)
        out[g] = out.get(g, 0.0) + (int(stat[11]) + int(stat[12])) / tick
    return out


def measured_run(page) -> dict:
    """One page run with the process groups' CPU sampled every half second."""
    samples, stop, t0 = [], threading.Event(), time.monotonic()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.monotonic() - t0, cpu_by_group()))
            time.sleep(0.5)

    thread = threading.Thread(target=sample)
    thread.start()
    run(page)
    stop.set()
    thread.join()
    samples.append((time.monotonic() - t0, cpu_by_group()))
    busy = [i for i in range(1, len(samples))
            if samples[i][1].get("worker", 0) - samples[i - 1][1].get("worker", 0) > 0.3]
    first, last = samples[0][1], samples[-1][1]
    out = {"wall_s": round(samples[-1][0], 1), "cpu_s": {g: round(last.get(g, 0) - first.get(g, 0), 2) for g in GROUPS}}
    if busy:
        a, b = samples[busy[0] - 1], samples[busy[-1]]
        out["compute_phase_s"] = round(b[0] - a[0], 1)
        out["compute_phase_cpu_s"] = {g: round(b[1].get(g, 0) - a[1].get(g, 0), 2) for g in GROUPS}
    m = SUMMARY.search(page.locator("#stats").inner_text())
    out["speedup"], out["sd_tokens_per_s"], out["ar_tokens_per_s"] = (float(x) for x in m.groups())
    return out


def main() -> None:
    from playwright.sync_api import sync_playwright

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+", help="the Tree setting of each measured run, in order (auto, off, N)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="out/page-cpu-share")
    args = ap.parse_args()
    runs = []
    with running_app(as_a_user=True) as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url, wait_until="load")
        page.wait_for_selector("#run")
        page.locator("#prompt textarea").fill(EXAMPLES[1][1])
        set_number(page, "max new tokens", args.max_new_tokens)  # opens More settings, where the Tree setting is
        run(page)  # cold: loads and times the pair
        for tree in args.trees:
            page.locator("#tree input").click()
            page.get_by_role("option", name=tree, exact=True).click()
            runs.append({"tree": tree, **measured_run(page)})
            print(json.dumps(runs[-1]), flush=True)
        browser.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"what": __doc__.split("\n\n")[0], "max_new_tokens": args.max_new_tokens, "runs": runs,
              "load_average": os.getloadavg(), "cpus": os.cpu_count()}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
