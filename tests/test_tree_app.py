"""Draft trees where users see them: the step inspector's tree (outcomes, layout, p and q, the committed token), the
race summary's tokens per pass with trees beside their first branches, the app's Tree setting through the request
checks, Tune k over k and tree settings, and the bench's chains against trees; on hand-built events and the tiny
models (milliseconds)."""

from __future__ import annotations

import html
import json
import re
from dataclasses import fields

import pytest
import torch
from test_tree_engine import PROMPTS

from specdemo import checks
from specdemo.app.handlers import Handlers, Outputs, RaceOutputs, SettingsOutputs, SweepOutputs
from specdemo.app.race import AppLimits, make_request
from specdemo.app.render import CSS, INSPECTOR_JS, event_segments, segments_html, step_info
from specdemo.app.summary import sweep_table, tree_line
from specdemo.app.tree_view import TREE_JS, layout, outcomes
from specdemo.config import TREE_DEFAULT, GenerationConfig, SamplingConfig, tree_default
from specdemo.drafters import ModelDrafter, NgramDrafter
from specdemo.engine import StepEvent, decode
from specdemo.engine.events import Inspection
from specdemo.engine.timing import ForwardTimer
from specdemo.measure import charts
from specdemo.measure.bench import main as bench_main
from specdemo.measure.bench.batch_run import run_batch_bench
from specdemo.measure.bench.cli import bench_config, parser
from specdemo.measure.bench.outputs import markdown
from specdemo.measure.bench.report import build_report
from specdemo.measure.bench.run import BenchConfig, bench_prompt
from specdemo.measure.bench.timing import target_modules
from specdemo.measure.compare import Pair
from specdemo.measure.metrics import first_branch_tokens, tree_passes
from specdemo.measure.tune_k import plan_trees, sweep
from specdemo.models.loading import LoadedModel
from specdemo.prompts import PromptItem

OUTPUTS = Outputs(*(cls(*(f.name for f in fields(cls))) for cls in (RaceOutputs, SweepOutputs, SettingsOutputs)))
TINY_PROMPT = " ".join(f"w{i}" for i in PROMPTS[1])  # the tiny target's answer repeats it: lookup branches


class WordTokenizer:
    def __init__(self, words):
        self.words = words

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.words[i] for i in ids)


TOK = WordTokenizer([" w0", " w1", " w2", " w3", " w4", " w5"])
# root -> 0 (w1) -> {1 (w2), 2 (w3) -> 5 (w1)}; root -> 3 (w4) -> 4 (w5). The target kept 0 then 2, then corrected
# with w4 where node 5 was drafted.
PARENTS = [-1, 0, 0, -1, 3, 2]
TREE_STEP = StepEvent("spec", [1, 3, 4], " w1 w3 w4", 0.1, 3, drafted=[1, 2, 3, 4, 5, 1], num_accepted=2,
                      correction=4, k=3, parents=PARENTS, accepted_path=[0, 2],
                      inspection=Inspection(top_ids=[[1, 4]] * 3 + [[4, 1]] + [[0, 1]] * 3,
                                            top_probs=[[0.6, 0.3]] * 3 + [[0.7, 0.2]] + [[0.5, 0.1]] * 3,
                                            token_probs=[0.6, 0.1, 0.5, 0.3, 0.2, 0.2], top2_gap=[1.0] * 7),
                      draft_token_probs=[0.9, 0.05, 0.8, 0.5, 0.4, 0.7])


def test_outcomes_follow_the_rule_that_walked_the_tree():
    """Greedy judges every child of the path's nodes (and of the root) at once; recursive rejection sampling tries
    siblings in index order, so a sibling after the accepted one was never reached; a node under a rejected one never
    is."""
    assert outcomes(PARENTS, [0, 2], greedy=True) == ["accepted", "rejected", "accepted", "rejected", "unreached",
                                                      "rejected"]
    assert outcomes(PARENTS, [0, 2], greedy=False) == ["accepted", "rejected", "accepted", "unreached", "unreached",
                                                       "rejected"]
    assert outcomes(PARENTS, [], greedy=False) == ["rejected", "unreached", "unreached", "rejected", "unreached",
                                                   "unreached"]


def test_layout_draws_the_first_branch_straight_and_gives_each_leaf_a_row():
    """Leaves take rows 0, 1, 2 in depth-first order; an inner node sits on its first child's row, so the chain of
    first children (the chain the tree grew from) is one straight line from the root."""
    rows, root, count = layout(PARENTS)
    assert rows == [0, 0, 1, 2, 2, 1] and root == 0 and count == 3
    assert layout([-1, 0, 1]) == ([0, 0, 0], 0, 1)  # a chain: one row
    assert layout([]) == ([], 0, 1)


def test_the_inspector_draws_a_tree_step_and_keeps_a_chain_steps_view():
    """A tree step's info: each node's outcome, parent, p and q, its place; the correction hangs after the path's last
    node, with the target's p of it; the top tokens are those after that node. A chain step has no `tree`."""
    info = step_info(TREE_STEP, TOK, step=4, greedy=True)
    tree = info["tree"]
    assert [n["outcome"] for n in tree["nodes"]] == [d["outcome"] for d in info["drafted"]] == outcomes(
        PARENTS, [0, 2], True)
    assert [d["parent"] for d in info["drafted"]] == PARENTS and tree["path"] == [0, 2]
    assert [(n["p"], n["q"]) for n in tree["nodes"]][2] == (0.5, 0.8)
    assert tree["committed"] == {"text": " w4", "parent": 2, "depth": 3, "row": 2, "outcome": "correction", "p": 0.7,
                                 "q": None}
    assert [n["row"] for n in tree["nodes"]] == [0, 0, 1, 3, 3, 1] and (tree["rows"], tree["depth"]) == (4, 3)
    assert info["top"][0] == {"text": " w4", "p": 0.7} and not info["full"] and info["committed_kind"] == "correction"
    chain = StepEvent("spec", [1, 2], " w1 w2", 0.1, 2, drafted=[1, 3], num_accepted=1, correction=2, k=2)
    assert "tree" not in step_info(chain, TOK, 1, True)


def test_the_tree_travels_in_the_panel_and_the_script_draws_it_as_text():
    """The step's first span carries the tree in its data-info (parsing back to step_info); the panel strikes through
    the branch below the last accepted node, first children down (read as text where the correction goes; a chain's
    whole rejected tail), the tree's other rejected nodes being in the inspector; the script builds SVG through
    textContent (never innerHTML), with q and p on hover."""
    segments = event_segments(TREE_STEP, TOK, speculative=True, step=2)
    assert TREE_STEP.rejected_branch == [1] and len(TREE_STEP.rejected) == 4  # node 5, under the accepted node 2
    assert [s.kind for s in segments] == ["accepted", "accepted", "rejected", "correction"]
    assert [s.text for s in segments] == [" w1", " w3", " w1", " w4"]
    root_rejected = StepEvent("spec", [4], " w4", 0.1, 1, drafted=[1, 2, 3, 4, 5, 1], num_accepted=0, correction=4,
                              k=3, parents=PARENTS, accepted_path=[])
    assert root_rejected.rejected_branch == [1, 2]  # node 0, then its first child 1
    chain = StepEvent("spec", [1, 2], " w1 w2", 0.1, 2, drafted=[1, 3, 5], num_accepted=1, correction=2, k=3)
    assert chain.rejected_branch == chain.rejected == [3, 5]
    attr = re.search(r'data-info="([^"]*)"', segments_html(segments)).group(1)
    assert json.loads(html.unescape(attr)) == step_info(TREE_STEP, TOK, 2, True)
    assert TREE_JS in INSPECTOR_JS and "drawTree(info.tree" in INSPECTOR_JS and "innerHTML" not in INSPECTOR_JS
    assert '"title"' in TREE_JS and "qName" in TREE_JS and "pName" in TREE_JS


def test_first_branch_tokens_are_what_the_chain_of_first_children_keeps():
    """Greedy: a tree step's first branch keeps the accepted path's prefix along first children, plus the target's
    token; here node 0 is a first child and node 2 is not, so 2 tokens against the tree's 3."""
    assert first_branch_tokens(TREE_STEP) == 2
    chain = StepEvent("spec", [1, 2, 3], "", 0.1, 3, drafted=[1, 2, 5], num_accepted=2, correction=3)
    assert first_branch_tokens(chain) == 3
    passes = tree_passes([TREE_STEP, chain], greedy=True)
    assert passes == {"tokens_per_pass": 3.0, "tree_tokens_per_pass": 3.0, "first_branch_tokens_per_pass": 2.5}
    assert tree_passes([TREE_STEP], greedy=False)["first_branch_tokens_per_pass"] is None
    assert tree_passes([chain], greedy=True)["tree_tokens_per_pass"] is None


def test_first_branches_replay_as_chains_on_the_tiny_target(tiny_target, tiny_tok):
    """On real greedy tree steps, the first branch's tokens are its longest prefix agreeing with the tokens the
    target committed (its own greedy tokens), plus one: what the chain alone would have kept there."""
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=4, tree="8")
    steps = [s for e in decode(tiny_target, tiny_tok, PROMPTS, config, NgramDrafter()) for s in e.steps
             if e.kind == "spec" and s.parents is not None]
    assert steps
    for s in steps:
        branch, node = [], -1
        while node in s.parents:
            node = s.parents.index(node)
            branch.append(s.drafted[node])
        agree = next((i for i, (a, b) in enumerate(zip(branch, s.tokens)) if a != b), min(len(branch), len(s.tokens)))
        assert first_branch_tokens(s) == min(agree + 1, len(s.tokens))


def test_the_summary_says_tokens_per_pass_with_trees_and_why_there_were_none():
    """With trees: the passes that verified one and tokens per pass, and greedy, what the first branches would have
    given; sampled, that a chain run is needed; without: the plan's reason, auto's fallback included."""
    tree = {"setting": "auto", "nodes": 16, "by_cost": True, "tree_steps": 9, "drafted_steps": 12, "note": "",
            "tokens_per_pass": 2.4, "tree_tokens_per_pass": 2.6, "first_branch_tokens_per_pass": 1.9}
    assert "**9 of 12** drafting passes" in tree_line(tree) and "**2.40** tokens per pass" in tree_line(tree)
    assert "would have given **1.90**" in tree_line(tree)
    assert "needs a run with trees off" in tree_line({**tree, "first_branch_tokens_per_pass": None})
    fell = {**tree, "tree_steps": 0, "note": "auto fell back to chains: no branch paid for the wider pass it needs"}
    assert tree_line(fell).startswith("draft trees (--tree auto): none, auto fell back to chains")
    assert "2.40 tokens per pass with chains" in tree_line(fell)


def test_the_tree_setting_goes_through_the_request_checks():
    """make_request normalises the Tree setting into GenerationConfig.tree (none sent, or "default": the drafter's
    measured default) and refuses a bad one with the sentence every entry point uses; bench's list check takes each
    setting once."""
    ok = dict(prompt="hi", target="smollm2-135m", drafter="ngram", draft="", k=4, dynamic_k=False, temperature=0.0,
              top_p=1.0, max_new_tokens=16, limits=AppLimits())
    for default in (None, "", TREE_DEFAULT):  # none sent (an older client), or the page's default choice
        request = make_request(**ok, tree=default)
        assert request.tree is None and request.config().tree == tree_default("ngram")
    assert make_request(**ok, tree=" AUTO ").config().tree == "auto" and make_request(**ok, tree=8).config().tree == "8"
    with pytest.raises(checks.UserError, match=r"tree must be auto, off or a node count from 1 to 64, got 'many'\."):
        make_request(**ok, tree="many")
    assert checks.trees("off, auto,16,off") == ["off", "auto", "16"] and checks.trees(["8", "auto"]) == ["8", "auto"]
    with pytest.raises(checks.UserError, match="got '0'"):
        checks.trees("off,0")


def tiny_run(h: Handlers, **changes) -> list[dict]:
    values = dict(prompt=TINY_PROMPT, target="tiny", drafter="ngram", draft="", k=3, dynamic_k=False,
                  temperature=0.0, top_p=1.0, max_new_tokens=24, hide_rejected=False, replay=False)
    return list(h.run_compare(**{**values, **changes}))


def test_a_race_with_trees_reports_them_and_inspects_them(tiny_loads):
    """The Tree setting reaches the engine: with 8 nodes prompt lookup verifies trees, the output is still the
    target's own, the summary gives tokens per pass beside the first branches', and the panel holds the trees; off
    drafts chains and says so; the calibration is the setting's own; the result is JSON as gradio writes it."""
    import orjson

    h = Handlers(OUTPUTS, AppLimits(device="cpu"))
    last = tiny_run(h, tree="8")[-1]
    result = last["result_json"]
    assert result["identical"] and result["tree"]["setting"] == "8" and result["tree"]["tree_steps"] > 0
    assert result["tree"]["first_branch_tokens_per_pass"] <= result["tree"]["tokens_per_pass"]
    assert orjson.loads(orjson.dumps(result))["tree"]["step_ms_by_width"]  # gradio's JSON: string keys only
    assert "drafting passes verified a tree" in last["stats"] and "first branches alone" in last["stats"]
    assert "&quot;tree&quot;: {&quot;nodes&quot;" in last["sd_html"]
    off = tiny_run(h, tree="off")[-1]
    assert off["result_json"]["tree"]["tree_steps"] == 0 and "none, chains (--tree off)" in off["stats"]
    assert "&quot;tree&quot;:" not in off["sd_html"]
    with pytest.warns(UserWarning):
        outs = tiny_run(h, tree="lots")
    assert len(outs) == 1 and "tree must be auto, off or a node count" in outs[0]["status"]


def tiny_pair(model, tok, drafter, kind="ngram") -> Pair:
    return Pair(LoadedModel("tiny", model, tok, torch.device("cpu"), torch.float32, "folder"), drafter, kind, None)


def test_tune_k_sweeps_k_and_tree_settings(tiny_target, tiny_tok):
    """Each k under each setting, every point lossless; the tree points verified trees and the chain points none;
    alpha, c and the theory come from the chains; the fastest point names its k and setting."""
    pair = tiny_pair(tiny_target, tiny_tok, NgramDrafter())
    result = sweep(pair, [TINY_PROMPT], ks=[1, 3], config=GenerationConfig(max_new_tokens=16),
                   measure_verify_costs=False, trees=["off", "8"])
    assert [(p.tree, p.k) for p in result.points] == [("off", 1), ("off", 3), ("8", 1), ("8", 3)]
    assert all(p.identical for p in result.points)
    assert [p.tree_steps > 0 for p in result.points] == [False, False, True, True]
    best = max(result.points, key=lambda p: p.speedup)
    assert (result.best_measured_k, result.best_measured_tree) == (best.k, best.tree)
    assert result.alpha == pytest.approx(sum(p.alpha * p.sd_tokens / p.mean_accepted for p in result.points[:2])
                                         / sum(p.sd_tokens / p.mean_accepted for p in result.points[:2]))
    assert set(result.trees) == {"off", "8"} and "trees of up to 8 nodes" in result.trees["8"]
    table = sweep_table(result)
    assert table.count("\n| ") == 4 and "| 8 | 3 |" in table and "**8**: trees of up to 8 nodes" in table


def test_settings_that_draft_the_same_chains_run_once(tiny_target, tiny_draft, tiny_tok):
    """A drafter without trees: off, auto and 8 all draft chains, so only off runs and the others say why."""
    pair = tiny_pair(tiny_target, tiny_tok, ModelDrafter(tiny_draft), "model")
    run, notes = plan_trees(pair, GenerationConfig(), ["off", "auto", "8"])
    assert run == ["off"] and notes["8"] == "runs as off: chains: this drafter drafts no trees"
    sampled = plan_trees(tiny_pair(tiny_target, tiny_tok, NgramDrafter()),
                         GenerationConfig(sampling=SamplingConfig(1.0, verification="block")), ["auto", "8"])
    assert sampled[0] == ["auto"] and "block verification judges chains only" in sampled[1]["8"]


def test_the_tune_k_tab_sweeps_tree_settings_and_uses_the_best(tiny_loads):
    """The handler takes the settings to sweep (a list, as the checkbox group sends them), draws speedup and tokens
    per pass per setting, and "Use best k" sets both k and the Tree setting; a bad setting is refused."""
    h = Handlers(OUTPUTS, AppLimits(device="cpu"))
    outs = list(h.run_sweep(TINY_PROMPT, "tiny", "ngram", "", 2, 0.0, 1.0, 8, "token", ["off", "8"]))
    last = outs[-1]
    k, tree = last["best"]
    assert tree in ("off", "8") and k in (1, 2) and last["table"].startswith(f"Done: best measured k = {k}, draft")
    names = {t.name for t in last["plot"].data}
    assert {"speedup, trees off", "speedup, trees 8", "tokens per pass, trees 8"} <= names
    assert h.apply_best_k(last["best"]) == {"k": k, "tree": tree} and h.apply_best_k(3) == {"k": 3}
    with pytest.warns(UserWarning):
        refused = list(h.run_sweep(TINY_PROMPT, "tiny", "ngram", "", 2, 0.0, 1.0, 8, "token", "off,huge"))
    assert "tree must be auto, off or a node count" in refused[-1]["table"]


def test_the_sweep_chart_keeps_one_setting_as_before():
    """One tree setting: the figure of before (measured speedup, theory, acceptance); several: a speedup and a
    tokens-per-pass line per setting, the best marked with its setting."""
    rows = [{"k": k, "speedup": 1.0 + k / 10, "acceptance_rate": 0.5, "mean_accepted": 1.5 + k / 10, "tree": t}
            for t in ("off", "auto") for k in (1, 2)]
    one = charts.k_sweep(rows[:2], [(1, 1.1), (2, 1.2)], 2, 2)
    assert {t.name for t in one.data} == {"measured speedup", "theory (α, c)", "acceptance rate"}
    several = charts.k_sweep(rows, [(1, 1.1)], 2, 1, "auto")
    assert [t.name for t in several.data] == ["speedup, trees off", "tokens per pass, trees off",
                                             "speedup, trees auto", "tokens per pass, trees auto",
                                             "theory (α, c), chains"]
    assert list(several.data[3].y) == [1.6, 1.7] and several.data[3].yaxis == "y2"
    assert "best: k=2, trees auto" in several.layout.annotations[0].text


def bench_rows(pair, trees: tuple[str, ...]) -> list[dict]:
    items = [PromptItem("a", "extractive", TINY_PROMPT), PromptItem("b", "chat", " ".join(f"w{i}" for i in PROMPTS[2]))]
    timers = (ForwardTimer(target_modules(pair.target.model)), None)
    rows: list[dict] = []
    try:
        for it in items:
            ids = pair.target.tokenizer(it.prompt)["input_ids"]
            rows += bench_prompt(pair, it, ids, [2, 3], GenerationConfig(max_new_tokens=16), timers, False, {},
                                 trees=trees)
    finally:
        timers[0].remove()
    return rows


def test_bench_runs_chains_against_trees_at_the_same_drafter(tiny_target, tiny_tok, tmp_path):
    """`bench --tree off,8`: each prompt and k under each setting after one AR run, all lossless; by_tree holds each
    setting's tokens per pass, its passes with a tree, its speedup over the chain runs, and what verify passes cost
    by the nodes they verified (seconds from the runs' own events); bench.md has the tables."""
    rows = bench_rows(tiny_pair(tiny_target, tiny_tok, NgramDrafter()), ("off", "8"))
    assert [(r["k"], r["tree"]) for r in rows[:4]] == [(2, "off"), (2, "8"), (3, "off"), (3, "8")]
    assert all(r["identical"] for r in rows) and all(r["tree_steps"] == 0 for r in rows if r["tree"] == "off")
    assert sum(r["tree_steps"] for r in rows if r["tree"] == "8") > 0
    for r in rows:
        assert sum(p for p, _ in r["verify_by_nodes"].values()) == r["steps"]
        assert sum(s for _, s in r["verify_by_nodes"].values()) == pytest.approx(r["verify_seconds"])
    report = build_report({"k": [2, 3]}, {}, rows)
    tree3 = [r for r in rows if r["tree"] == "8" and r["k"] == 3]
    by = report["by_tree"]["8"]["3"]
    assert by["mean_accepted"] == pytest.approx(sum(r["spec_tokens"] for r in tree3) / sum(r["steps"] for r in tree3))
    assert by["vs_chains"] == pytest.approx(sum(r["sd_seconds"] for r in rows if r["tree"] == "off" and r["k"] == 3)
                                            / sum(r["sd_seconds"] for r in tree3))
    assert report["by_tree"]["off"]["2"]["vs_chains"] == pytest.approx(1.0)
    costs = report["tree_verify_costs"]["8"]
    one = sum(r["ar_pass_seconds"] for r in tree3) / sum(r["ar_passes"] for r in tree3)
    for n, c in costs.items():
        assert c["passes"] == sum(r["verify_by_nodes"].get(n, [0])[0] for r in rows if r["tree"] == "8")
        assert c["vs_1_token_pass"] == pytest.approx(c["ms_per_pass"] / 1000 / one)  # each k: the same AR runs
    text = markdown(report)
    assert "## Chains against trees" in text and "| 8 | 3 |" in text and "| trees | nodes | passes |" in text
    assert "by_tree" not in build_report({}, {}, [r for r in rows if r["tree"] == "off"])


def test_the_bench_flag_takes_a_list_of_tree_settings(capsys):
    """--tree off,auto,16 is one normalised list; a bad element is refused with the tree sentence; the batch sweep
    takes one setting."""
    assert bench_config(parser().parse_args(["--tree", "OFF, auto,16"]), env={}).tree == "off,auto,16"
    assert bench_main(["--tree", "off,many", "--out", "/nonexistent/never"]) == 2
    assert "tree must be auto, off or a node count from 1 to 64, got 'many'." in capsys.readouterr().err
    with pytest.raises(ValueError, match="with --batch-size, --tree takes one setting"):
        run_batch_bench(BenchConfig(tree="off,auto", batch_sizes="1,2", k="2", drafter="ngram", limit=1))


@pytest.mark.browser
def test_a_browser_draws_the_tree_on_a_click():
    """In chromium: the inspector's script, on a click on the tree step's token, draws one box per node plus the
    pending token and the correction, coloured by outcome, the accepted path's edges heavy, and p and q in each box's
    hover title; the step's head names the tree, and the why line explains where the path stopped (or that it ran to
    a leaf)."""
    from test_browser import ARGS, CHROMIUM

    sync_api = pytest.importorskip("playwright.sync_api")
    bonus = StepEvent("spec", [3, 4, 5], " w3 w4 w5", 0.2, 6, drafted=[2, 3, 4], num_accepted=2, bonus=5, k=3,
                      parents=[-1, -1, 1], accepted_path=[1, 2],
                      inspection=Inspection([[3]] * 4, [[0.9]] * 4, [0.05, 0.9, 0.8], [2.0] * 4))
    panel = segments_html(event_segments(TREE_STEP, TOK, speculative=True, step=2)
                          + event_segments(bonus, TOK, speculative=True, step=3))
    page_html = (f"<style>{CSS}</style><div id='sd-panel'>{panel}</div>"
                 "<div class='inspector' id='inspector-body'></div>")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page()
            page.set_content(page_html)
            page.evaluate(f"({INSPECTOR_JS})()")
            page.locator("#sd-panel span[data-step='2']").first.click()
            classes = page.eval_on_selector_all("svg.draft-tree g", "gs => gs.map(g => g.getAttribute('class'))")
            titles = page.eval_on_selector_all("svg.draft-tree title", "ts => ts.map(t => t.textContent)")
            heavy = page.eval_on_selector_all("svg.draft-tree line.on", "ls => ls.length")
            head = page.locator("#inspector-body .head").inner_text()
            why = page.locator("#inspector-body .why").inner_text()
            page.locator("#sd-panel span[data-step='3']").first.click()
            leaf = page.locator("#inspector-body .why").inner_text()
        finally:
            browser.close()
    assert classes == ["node node-root"] + [f"node node-{o}" for o in outcomes(PARENTS, [0, 2], True)] + [
        "node node-correction"]
    assert titles[3].startswith('" w3": accepted') and "p (target, softmax at temperature 1) = 0.500" in titles[3]
    assert "q (draft) = 0.800" in titles[3] and "q (draft)" not in titles[-1] and "= 0.700" in titles[-1]
    assert heavy == 3  # root -> 0 -> 2, then the correction
    assert "a tree of 6 drafted nodes, 2 accepted along its path" in head
    assert why == "Why: at depth 3, the one node drafted after the accepted path is not the target's top token."
    assert leaf.startswith("Why: the accepted path runs to a leaf of the tree, so the target adds its bonus token; "
                           "the one other node lies off that path: a rejected one is not the target's top token")
