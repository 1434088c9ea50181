"""vLLM as an anchor: --anchors parsing, the fail-fast errors (no vLLM python, sampling), the methods the bench runs
beside ours; the driver's imports, per-request counter differences and JSON round trip under a python without vLLM;
the report's anchors.vllm keys and its line on draft trees; and, where vLLM is installed (slow), its tree probe against
its config, its ngram proposer against ours on random sequences, its plain, ngram and suffix greedy output against
ours, and arctic's suffix tree against ours. vLLM as the way out (serve-config): test_serve_config.py."""

import ast
import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from test_bench_run import tiny_pair, tiny_rows

from specdemo.config import GenerationConfig, SuffixConfig
from specdemo.drafters import NgramDrafter
from specdemo.measure.bench import main as bench_main
from specdemo.measure.bench.cli import bench_config, parser
from specdemo.measure.bench.outputs import html, markdown, vllm_markdown
from specdemo.measure.bench.report import build_report
from specdemo.measure.bench.run import first_setting
from specdemo.measure.bench.vllm import (
    DRIVER,
    PROTOCOL,
    VLLM_PYTHON_ENV,
    VllmOptions,
    VllmUnavailable,
    attach,
    build_request,
    find_python,
    require_python,
    run_driver,
    run_vllm,
    tree_note,
    vllm_methods,
)
from specdemo.serve.serve_config import Lookup


def load_driver():
    """The driver module, imported from its file (it needs only the standard library until it runs vLLM)."""
    spec = importlib.util.spec_from_file_location("vllm_driver_under_test", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- flags ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, hf, vllm", [([], False, False), (["--anchors"], True, False),
                                            (["--anchors", "hf"], True, False), (["--anchors", "vllm"], False, True),
                                            (["--anchors", "hf,vllm"], True, True),
                                            (["--anchors", "--limit", "2"], True, False)])
def test_anchors_take_a_comma_list_and_the_bare_flag_still_means_transformers(argv, hf, vllm):
    bc = bench_config(parser().parse_args(argv), env={})
    assert (bc.anchors, bc.vllm) == (hf, vllm)


def test_vllm_python_comes_from_the_environment_and_bench_fails_fast_without_it(monkeypatch, capsys, tmp_path):
    """SPECDEMO_VLLM_PYTHON wins over .venv-vllm; a missing one is a clear error before any model loads."""
    assert bench_config(parser().parse_args(["--anchors", "vllm"]), env={VLLM_PYTHON_ENV: "/x/python"}
                        ).vllm_options.python == "/x/python"
    assert find_python(str(tmp_path / "none")) is None
    with pytest.raises(VllmUnavailable, match="bash run.sh vllm"):
        require_python(str(tmp_path / "none"))
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(tmp_path / "none"))
    assert bench_main(["--anchors", "vllm", "--limit", "1", "--out", str(tmp_path / "out")]) == 2
    assert "bash run.sh vllm" in capsys.readouterr().err
    assert bench_main(["--anchors", "hf,nope", "--limit", "1", "--out", str(tmp_path / "out")]) == 2
    assert "--anchors takes a comma list" in capsys.readouterr().err
    monkeypatch.setenv(VLLM_PYTHON_ENV, sys.executable)  # exists: the next check is the sampling one
    assert bench_main(["--anchors", "vllm", "--temperature", "0.7", "--limit", "1", "--out", str(tmp_path)]) == 2
    assert "greedy" in capsys.readouterr().err


# --- the bench's vLLM runs -------------------------------------------------------------------------------------------

def test_the_bench_runs_vllms_suffix_beside_ours_for_suffix_decoding():
    """vLLM's methods: plain, ngram, and suffix with our suffix options (for --drafter suffix); the bench's flags set
    those options (and --suffix-cold: no earlier answers kept)."""
    names = [(m["name"], m["k"]) for m in vllm_methods([8], Lookup(1, 8), suffix=SuffixConfig())]
    assert names == [("plain", None), ("ngram", 8), ("suffix", 8)]
    bc = bench_config(parser().parse_args(["--drafter", "suffix", "--suffix-cold", "--suffix-max-tree-depth", "12",
                                           "--suffix-cost-aware"]), env={})
    suffix = bc.drafter_options["suffix"]
    assert bc.suffix_cold and suffix.max_tree_depth == 12 and suffix.cost_aware


# --- the driver's protocol -------------------------------------------------------------------------------------------

def test_driver_imports_only_vllm_and_the_standard_library():
    """It runs under vLLM's venv as a script: no specdemo, torch or transformers at its top level or inside."""
    tree = ast.parse(DRIVER.read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - set(sys.stdlib_module_names) - {"__future__"} <= {"vllm", "torch"}  # torch: vLLM's own, in workers
    assert load_driver().PROTOCOL == PROTOCOL
    assert {p.name for p in DRIVER.parent.glob("*.py")} == {DRIVER.name}  # nothing there can shadow vLLM's imports


def test_driver_counters_are_per_request_differences():
    """vLLM's prometheus counters are cumulative: a request's figures are after - before, summed over engines."""
    d = load_driver()

    def snapshot(drafts, drafted, accepted, per_pos):
        return [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=drafts),
                SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=drafted),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=accepted),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=per_pos),
                SimpleNamespace(name="vllm:generation_tokens", value=999)]

    before = d.read_counters(snapshot(3, 12, 5, [3, 2, 0, 0]))
    after = d.read_counters(snapshot(7, 28, 13, [6, 4, 2, 1]))
    assert d.counter_delta(before, after) == {"num_drafts": 4, "num_draft_tokens": 16, "num_accepted_tokens": 8,
                                              "accepted_per_pos": [3, 2, 2, 1]}
    assert d.read_counters([])["num_drafts"] == 0


def test_driver_round_trip_reports_each_methods_error(tmp_path):
    """The real driver under a python without vLLM: protocol, machine info and one error per method come back."""
    methods = vllm_methods([2], Lookup(1, 8), eagle3="/e3")
    assert [(m["name"], m["k"]) for m in methods] == [("plain", None), ("ngram", 2), ("eagle3", 2)]
    request = build_request("/models/t", [("a", [1, 2, 3]), ("b", [4, 5])], {0, 7}, 16, methods, VllmOptions())
    assert request["eos_token_ids"] == [0, 7] and request["protocol"] == PROTOCOL
    with pytest.raises(ValueError, match="repeats ids"):
        build_request("/m", [("a", [1]), ("a", [2])], {0}, 4, methods)
    result = run_driver(sys.executable, request, tmp_path, {k: v for k, v in os.environ.items()
                                                            if k != "PYTHONPATH"}, timeout_s=120)
    assert result["protocol"] == PROTOCOL and result["machine"]["executable"]
    assert [(m["name"], m["k"]) for m in result["methods"]] == [("plain", None), ("ngram", 2), ("eagle3", 2)]
    assert all("vllm" in m["error"] for m in result["methods"])  # ModuleNotFoundError: No module named 'vllm'
    assert "vllm" in result["trees"]["error"]  # tree_support: unknown without vLLM, said so
    assert (tmp_path / "vllm.log").exists() and json.loads((tmp_path / "request.json").read_text()) == request


def test_a_tree_bench_says_in_one_line_that_vllms_rows_are_chains(tmp_path):
    """`bench --anchors vllm --tree auto|N`: vLLM 0.32 verifies no trees, so its rows are chains; the report says so
    (config.vllm.tree_note, the Markdown's vLLM section) from what the driver found in the installed vLLM, and says
    nothing for chains against chains. Here through the real driver under a python without vLLM: unknown, said so.
    With a list of settings vLLM's figures go beside the first setting's rows, whose runs `ours` holds."""
    no_trees = {"vllm": "0.32.0", "speculative_token_tree": False, "tree_attention_backend": False}
    assert tree_note(["off"], no_trees) is None
    note = tree_note(["auto", "off", "8"], no_trees)
    assert note == ("vLLM 0.32.0 verifies no draft trees (no speculative_token_tree in its SpeculativeConfig and no "
                    "tree attention backend; docs/vllm.md#draft-trees): its rows are chains at the same k, set beside "
                    "our --tree auto rows")
    assert tree_note(["off", "auto"], no_trees).endswith("beside our --tree off rows")  # where `runs` has them
    assert "runs only its chains" in tree_note(["4"], {**no_trees, "speculative_token_tree": True,
                                                       "tree_attention_backend": True})
    assert "no tree attention backend" in tree_note(["4"], {**no_trees, "speculative_token_tree": True})
    assert "**Draft trees:** " + note + "." in vllm_markdown({"anchors": {}, "config": {"vllm": {"tree_note": note}},
                                                             "results": []})
    target = SimpleNamespace(source="folder", name="/models/t", dtype="float32")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    meta = run_vllm([], target, [("a", [1, 2, 3])], [0], 8, [2], Lookup(1, 8), {}, VllmOptions(python=sys.executable),
                    tmp_path, env, trees=["auto"])
    assert meta["tree_note"].startswith("this vLLM: whether it verifies draft trees is unknown (ModuleNotFoundError")
    assert meta["tree_note"].endswith("its rows are chains at the same k, set beside our --tree auto rows")
    assert [f["name"] for f in meta["failed"]] == ["plain", "ngram"]
    rows = [{"id": "a", "verification": "greedy", "tree": t} for t in ("auto", "off", "8")]
    config = GenerationConfig(tree="auto")  # greedy: the rule the vLLM anchor requires
    assert first_setting(rows, config) == rows[:1]  # vLLM's figures go beside the first setting's rows only


# --- report -------------------------------------------------------------------------------------------------------

def fake_result(rows, runs, items=("a", "b", "c"), k=2):
    """A driver answer in the protocol's shape: vLLM plain equal to our AR except on prompt c, ngram equal to it."""
    ar = {it: runs[k][i][0].ids for i, it in enumerate(items)}
    plain = [{"id": it, "token_ids": ar[it] if it != "c" else ar[it][:-1] + [(ar[it][-1] + 1) % 16], "seconds": 2.0,
              "counters": {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []},
              "forward_seconds": 1.5, "forward_calls": 10} for it in items]
    ngram = [{"id": it, "token_ids": ar[it], "seconds": 1.0,
              "counters": {"num_drafts": 4, "num_draft_tokens": 8, "num_accepted_tokens": 6,
                           "accepted_per_pos": [4, 2]}, "forward_seconds": 0.5, "forward_calls": 5} for it in items]
    return {"protocol": PROTOCOL, "machine": {}, "methods": [
        {"name": "plain", "k": None, "prompts": plain, "vllm": "test"},
        {"name": "ngram", "k": k, "prompts": ngram, "vllm": "test"},
        {"name": "eagle3", "k": k, "error": "ValueError: no such head"}]}


def test_report_has_the_vllm_keys_beside_ours(tiny_target, tiny_tok, tmp_path):
    """anchors.vllm: vLLM's tokens/s, its speedup over its own plain decoding, acceptance and mean accepted from its
    counters, identical = equal to our AR's ids, and our AR over vLLM's plain; Markdown and HTML show them."""
    pair = tiny_pair(tiny_target, tiny_tok, NgramDrafter(), "ngram")
    rows, runs = tiny_rows(pair, [2], anchors=False)
    ours = {(r["id"], 2): runs[2][i] for i, r in enumerate(rows)}
    seen = []
    failed = attach(rows, fake_result(rows, runs), ours, lambda pid, ids: seen.append(pid) or {"top2_logit_gap": 0.01})
    assert failed == [{"name": "eagle3", "k": 2, "error": "ValueError: no such head"}] and seen == ["c"]
    report = build_report({"k": [2], "drafter": "ngram", "vllm": {"failed": failed, "methods": []}}, {}, rows)
    v = report["anchors"]["vllm"]
    tokens = sum(r["vllm_plain_tokens"] for r in rows)
    assert v["plain_tokens_per_s"] == pytest.approx(tokens / 6.0)
    assert v["ar_vs_vllm_plain"] == pytest.approx(v["ar_tokens_per_s"] / v["plain_tokens_per_s"])
    assert v["ngram_speedup"] == pytest.approx(2.0)  # 6 s of plain over 3 s of ngram
    assert v["ngram_tokens_per_s"] == pytest.approx(sum(r["vllm_ngram_tokens"] for r in rows) / 3.0)
    assert v["ngram_acceptance_rate"] == pytest.approx(18 / 24)
    assert v["ngram_mean_accepted"] == pytest.approx(1 + 18 / 12)  # vLLM's: bonus included, per drafting step
    assert v["ngram_per_position_acceptance"] == pytest.approx([1.0, 0.5])
    assert v["ngram_identical_fraction"] == 1.0 and v["plain_identical_fraction"] == pytest.approx(2 / 3)
    assert v["plain_forward_ms_per_pass"] == pytest.approx(150.0) and v["plain_outside_forward_ms_per_pass"] == 50.0
    assert "eagle3_speedup" not in v and set(v["by_category"]) == {"extractive", "chat"}
    assert v["ours_speedup"] == pytest.approx(report["overall"]["speedup"])
    md = markdown(report)
    assert "## vLLM" in md and "decodes faster" in md and "**vLLM eagle3 (k = 2) failed:**" in md
    assert "| vLLM | ngram | " in md and "top-2 logit gaps" in md
    assert "vLLM ngram" in html(report)
    assert "anchors" in report and "ar_vs_hf_generate" not in report["anchors"]  # no transformers anchors asked


# --- the real engine ---------------------------------------------------------------------------------------------

def vllm_python():
    python = find_python(os.environ.get(VLLM_PYTHON_ENV))
    if python is None:
        return None
    probe = "import importlib.util, sys; sys.exit(not importlib.util.find_spec('vllm'))"
    ok = subprocess.run([str(python), "-c", probe],
                        capture_output=True)
    return python if ok.returncode == 0 else None


NEEDS_VLLM = pytest.mark.skipif(vllm_python() is None,
                                reason="vLLM is not installed (bash run.sh vllm, or SPECDEMO_VLLM_PYTHON)")
VLLM_PROPOSALS = """
import json, sys
import numpy as np
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as find
cases = json.load(sys.stdin)
print(json.dumps([find(np.array(c["ids"], dtype=np.int32), c["min"], c["max"], 1 << 20, c["k"]).tolist()
                  for c in cases]))
"""


@pytest.mark.slow
@NEEDS_VLLM
def test_vllms_speculative_config_takes_our_rejection_sample_methods():
    """The field serve-config writes, and each value it writes, exist in the installed vLLM's SpeculativeConfig."""
    from specdemo.serve.serve_config import VLLM_REJECTION

    code = ("import dataclasses, json, typing\nfrom vllm.config.speculative import SpeculativeConfig as S, "
            "RejectionSampleMethod as R\nprint(json.dumps([[f.name for f in dataclasses.fields(S)], "
            "list(typing.get_args(R))]))")
    out = subprocess.run([str(vllm_python()), "-c", code], capture_output=True, text=True, check=True)
    fields, methods = json.loads(out.stdout.strip().splitlines()[-1])
    assert "rejection_sample_method" in fields and set(VLLM_REJECTION.values()) <= set(methods)


@pytest.mark.slow
@NEEDS_VLLM
def test_the_drivers_tree_probe_matches_what_vllms_config_accepts():
    """tree_support, run in vLLM's venv, agrees with its SpeculativeConfig: where it finds no speculative_token_tree
    the config refuses that key (0.32.0's CPU build: refused, and no tree attention backend, as docs/vllm.md says)."""
    code = ("import json, sys\nsys.path.insert(0, sys.argv[1])\nimport vllm_driver\n"
            "from vllm.config import SpeculativeConfig\ntry:\n    SpeculativeConfig(method='ngram', "
            "num_speculative_tokens=2, speculative_token_tree='[(0,), (1,)]')\n    refused = None\n"
            "except Exception as exc:\n    refused = str(exc)\n"
            "print(json.dumps([vllm_driver.tree_support(), refused]))")
    out = subprocess.run([str(vllm_python()), "-c", code, str(DRIVER.parent)], capture_output=True, text=True,
                         check=True)
    support, refused = json.loads(out.stdout.strip().splitlines()[-1])
    if not support["speculative_token_tree"]:
        assert "speculative_token_tree" in refused and "Unexpected keyword argument" in refused
    if support["vllm"] == "0.32.0":
        assert not support["speculative_token_tree"] and not support["tree_attention_backend"]


@pytest.mark.slow
@NEEDS_VLLM
def test_our_prompt_lookup_is_vllms_ngram_except_for_short_matches():
    """vLLM's own proposer on random sequences: with full_ngram=1 our NgramDrafter proposes exactly its tokens (the
    longest suffix match within [min, max], ties to the earliest, up to k tokens after it); with our default
    full_ngram=3 the only difference is a match shorter than 3, where we propose just its length's prefix."""
    import random

    from specdemo.config import SamplingConfig
    from specdemo.drafters import DraftRequest

    rng = random.Random(0)
    cases = [{"ids": [rng.randrange(4) for _ in range(rng.randrange(2, 40))], "k": rng.randrange(1, 7),
              "min": (lo := rng.randrange(1, 4)), "max": rng.randrange(lo, 9)} for _ in range(400)]
    run = subprocess.run([str(vllm_python()), "-c", VLLM_PROPOSALS], input=json.dumps(cases), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    short = 0
    for case, vllm_tokens in zip(cases, theirs):
        request = DraftRequest([case["ids"]], [case["k"]], SamplingConfig(), [None])
        exact = NgramDrafter(max_ngram=case["max"], min_ngram=case["min"], full_ngram=1)
        assert exact.propose(request)[0].tokens == vllm_tokens, case
        length, _ = exact.match(case["ids"])
        ours = NgramDrafter(max_ngram=case["max"], min_ngram=case["min"]).propose(request)[0].tokens
        if length >= 3 or not vllm_tokens:
            assert ours == vllm_tokens, case
        else:
            short += ours != vllm_tokens
            assert ours == vllm_tokens[:length], case
    assert short > 0  # the difference is real on these sequences


@pytest.mark.slow
@NEEDS_VLLM
def test_vllm_ngram_greedy_output_is_ours_on_three_prompts(tmp_path, monkeypatch):
    """The bench with --anchors vllm on the bundled model: vLLM's plain and ngram (k = 4) greedy tokens equal our
    autoregressive tokens on the first three dev prompts, and its spec-decode counters are consistent. Under
    --tree off,auto its figures sit beside the chain rows only, and the report says in one line that they are chains."""
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(vllm_python()))
    assert bench_main(["--limit", "3", "--max-new-tokens", "32", "--k", "4", "--drafter", "ngram", "--anchors",
                       "vllm", "--tree", "off,auto", "--out", str(tmp_path), "--quiet", "--no-theory"]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    v, tree_rows = report["anchors"]["vllm"], [r for r in report["results"] if r["tree"] == "auto"]
    assert len(tree_rows) == 3 and not any(k.startswith("vllm_") for r in tree_rows for k in r)
    report["results"] = [r for r in report["results"] if r["tree"] == "off"]
    assert "its rows are chains at the same k, set beside our --tree off rows" in report["config"]["vllm"]["tree_note"]
    assert "**Draft trees:** " in (tmp_path / "bench.md").read_text()
    diffs = {r["id"]: {m: r.get(f"vllm_{m}_mismatch") for m in ("plain", "ngram")} for r in report["results"]}
    assert v["plain_identical_fraction"] == 1.0 and v["ngram_identical_fraction"] == 1.0, diffs
    assert not report["config"]["vllm"]["failed"]
    for r in report["results"]:
        assert r["vllm_ngram_tokens"] == r["ar_tokens"] == r["vllm_plain_tokens"]
        assert 0 <= r["vllm_ngram_accepted"] <= r["vllm_ngram_draft_tokens"] <= 4 * r["vllm_ngram_drafts"]
    assert sum(r["vllm_ngram_drafts"] for r in report["results"]) > 0  # extractive prompts: the lookup drafts
    assert v["ngram_tokens_per_s"] > 0 and v["plain_tokens_per_s"] > 0
    # vLLM's own per-request metrics beside ours, under the same names, pooled and per position
    assert v["ngram_speculative_decoding"]["num_spec_steps"] == sum(r["vllm_ngram_drafts"] for r in report["results"])
    theirs = v["ngram_speculative_decoding"]  # its per-position counter: position 1 = steps accepting at least one
    assert theirs["num_accepted_tokens_per_pos"][0] == theirs["num_spec_steps"] - theirs["acceptance_histogram"][0]
    assert len(v["ours_speculative_decoding"]["num_accepted_tokens_per_pos"]) == 4
    assert "accepted at position 1" in (tmp_path / "bench.md").read_text()


ARCTIC_AGAINST_OURS = """
import json, random, sys
from arctic_inference.suffix_decoding._C import SuffixTree as Arctic
from specdemo.config import SuffixConfig
from specdemo.drafters.suffix import SuffixTree

bad = total = 0
for seed in range(30):
    rng = random.Random(seed)
    depth, vocab = rng.choice([4, 8, 24]), rng.choice([3, 8, 50])
    theirs, ours, seqs = Arctic(depth), SuffixTree(depth), {}
    for i in range(4):
        seqs[i] = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
    for start in range(0, 120, 5):  # interleaved, in pieces
        for i, q in seqs.items():
            theirs.extend(i, q[start:start + 5])
            ours.extend(i, q[start:start + 5])
    for i in list(seqs)[: seed % 3]:
        theirs.remove(i)
        ours.remove(i)
        del seqs[i]
    for _ in range(200):
        base = rng.choice(list(seqs.values()))
        j = rng.randrange(1, len(base) + 1)
        ctx = (base[max(0, j - rng.randrange(1, depth + 4)):j] + [rng.randrange(vocab)] * (rng.random() < .3))[-depth:]
        k, f, p = rng.randrange(1, 20), rng.choice([1.0, 0.5, 2.0]), rng.choice([0.1, 0.0, 0.3])
        a = theirs.speculate(ctx, k, f, 0.0, p, False)
        b = ours.speculate(ctx, k, SuffixConfig(depth, 0, f, p))
        total += 1
        bad += (list(a.token_ids), a.match_len, list(a.probs)) != (b.tokens, b.match_len, b.probs)
print(json.dumps([bad, total]))
"""


def arctic_python():
    """vLLM's venv when arctic_inference (vLLM's suffix method) is installed in it, else None."""
    python = vllm_python()
    if python is None:
        return None
    ok = subprocess.run([str(python), "-c", "import arctic_inference.suffix_decoding"], capture_output=True)
    return python if ok.returncode == 0 else None


NEEDS_ARCTIC = pytest.mark.skipif(arctic_python() is None, reason="arctic-inference is not installed in vLLM's venv "
                                                                  "(docs/suffix.md says how)")


@pytest.mark.slow
@NEEDS_ARCTIC
def test_our_suffix_tree_drafts_what_arctics_drafts():
    """arctic_inference's C++ SuffixTree (what vLLM's suffix method calls) and ours, fed the same sequences in pieces,
    some removed: every speculation (tokens, match length, float32 probabilities) is the same."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV")} | {"PYTHONPATH": root}
    run = subprocess.run([str(arctic_python()), "-c", ARCTIC_AGAINST_OURS], capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    bad, total = json.loads(run.stdout.strip().splitlines()[-1])
    assert total > 5000 and bad == 0


@pytest.mark.slow
@NEEDS_ARCTIC
def test_vllm_suffix_greedy_output_is_ours_with_a_warm_cache(tmp_path, monkeypatch):
    """The bench with --drafter suffix --anchors vllm on three dev prompts: vLLM's suffix (its cache carried across
    the prompts, as ours) gives our autoregressive tokens, and drafts."""
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(arctic_python()))
    assert bench_main(["--limit", "3", "--max-new-tokens", "32", "--k", "8", "--drafter", "suffix", "--anchors",
                       "vllm", "--out", str(tmp_path), "--quiet", "--no-theory"]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    v = report["anchors"]["vllm"]
    assert not report["config"]["vllm"]["failed"]
    assert v["suffix_identical_fraction"] == 1.0 and report["overall"]["identical_fraction"] == 1.0
    assert sum(r["vllm_suffix_drafts"] for r in report["results"]) > 0
    assert report["config"]["suffix"] == {**SuffixConfig().as_dict(),
                                          "cache": "one per process, carried across the prompts in order"}
