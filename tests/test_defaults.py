"""What each drafter starts with (config.DRAFTER_DEFAULTS) against the reports it cites, and every place that starts
a run taking it: --help, serve-config, export, the app's presets, and (slow, on the bundled model) the app's default
run, `generate --json` and `bench` with no flags."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import TEST_KINDS

from specdemo.__main__ import main
from specdemo.app.race import preset_fields, preset_k
from specdemo.app.ui import default_preset
from specdemo.config import (
    BUNDLED_ID,
    DRAFTER_DEFAULTS,
    HYBRID_LOOKUP,
    TRAINED_DRAFT_ID,
    TUNE_K_LARGEST,
    VLLM_SUFFIX,
    DrafterDefault,
    SuffixConfig,
    drafter_default,
)
from specdemo.drafters.registry import names
from specdemo.drafters.resolve import starting_k
from specdemo.measure.bench import main as bench_main

REPO = Path(__file__).resolve().parent.parent


def report(folder: str) -> dict:
    return json.loads((REPO / folder / "bench.json").read_text())


def best_measured(rep: dict) -> tuple[int, float]:
    """The k with the best pooled speedup in a report (the rule of theory.best_measured_k), and that speedup."""
    by_k = rep["by_k"]
    k = max(by_k, key=lambda key: by_k[key]["speedup"])
    return int(k), by_k[k]["speedup"]


def lookup_of(rep: dict) -> str:
    """The hybrid's model-free half in a report: a suffix half records itself, prompt lookup records nothing."""
    return (rep["config"].get("suffix") or {}).get("hybrid_lookup") or "ngram"


def beaten(evidence, kind: str, speedup: float) -> list[str]:
    """The evidence's rivals that ran another drafter or prompt set, or did not lose to `speedup`."""
    winner = report(evidence.report)["config"]
    problems = []
    for rival in evidence.rivals:
        c, (_, theirs) = report(rival)["config"], best_measured(report(rival))
        if c["drafter"] != kind or c["prompts"] != winner["prompts"] or c.get("limit") != winner.get("limit"):
            problems.append(f"{rival} is not a {kind} run on the same prompts as {evidence.report}")
        if theirs >= speedup:
            problems.append(f"{rival} measured {theirs:.3f}x, not below {evidence.report}'s {speedup:.3f}x")
    return problems


def disagreements(d: DrafterDefault, suffix: SuffixConfig = SuffixConfig(), hybrid_lookup: str = HYBRID_LOOKUP
                  ) -> list[str]:
    """What the cited reports contradict in a default (with these suffix options and hybrid lookup); [] if nothing."""
    main_report = report(d.evidence.report)
    c, (k, speedup) = main_report["config"], best_measured(main_report)
    problems = [] if c["drafter"] == d.kind else [f"{d.evidence.report} ran {c['drafter']}, not {d.kind}"]
    if Path(c["prompts"]).name != d.evidence.prompts:
        problems.append(f"{d.evidence.report} ran {c['prompts']}, not {d.evidence.prompts}")
    if d.kind in ("model", "hybrid") and c["draft"] != TRAINED_DRAFT_ID:
        problems.append(f"{d.evidence.report} measured {c['draft']}, not the shipped draft")
    if k != d.k:
        problems.append(f"{d.kind} starts at k = {d.k}; {d.evidence.report} measured k = {k} best")
    problems += beaten(d.evidence, d.kind, speedup)
    if d.kind == "suffix":  # its options are those of the options report, else of the k report
        folder = (d.options or d.evidence).report
        # reports made before bench recorded cost_aware ran without --suffix-cost-aware unless their folder ends -ca
        ran = {"cost_aware": folder.endswith("-ca"), **(report(folder)["config"].get("suffix") or {})}
        if {name: ran.get(name) for name in suffix.as_dict()} != suffix.as_dict():
            problems.append(f"suffix options {suffix.as_dict()} are not those {folder} ran: {ran}")
    if d.options is not None:  # the hybrid's lookup, suffix decoding's options: beat the rivals of their sitting
        options = report(d.options.report)
        if d.kind == "hybrid" and lookup_of(options) != hybrid_lookup:
            problems.append(f"{d.options.report} measured the hybrid with {lookup_of(options)}, not {hybrid_lookup}")
        problems += beaten(d.options, d.kind, best_measured(options)[1])
    return problems


def test_every_default_is_what_its_report_measured_best():
    """Each kind's k is the best measured k of its report, which beat its rivals of the same sitting and prompts;
    suffix decoding's options are those of that run; the hybrid's lookup is the one of the faster hybrid run."""
    assert {d.kind for d in DRAFTER_DEFAULTS} == set(names()) - set(TEST_KINDS)  # every built-in kind
    for d in DRAFTER_DEFAULTS:
        assert disagreements(d) == [], d


def test_a_default_that_disagrees_with_its_report_fails():
    """Another k, vLLM's suffix options, the rival's setting or the other hybrid lookup: each is caught."""
    for d in DRAFTER_DEFAULTS:
        assert disagreements(replace(d, k=d.k + 1)), d.kind
    suffix = drafter_default("suffix")
    assert disagreements(suffix, suffix=VLLM_SUFFIX)
    assert disagreements(suffix, suffix=SuffixConfig(cost_aware=False))
    rounds = suffix.options.rivals  # the cost-aware cut's rivals, without it: citing one as the winner is caught
    assert disagreements(replace(suffix, options=replace(suffix.options, report=rounds[0], rivals=(
        suffix.options.report, *rounds[1:]))), suffix=SuffixConfig(cost_aware=False))
    rival = suffix.evidence.rivals[0]  # the cost-aware run at k = 16 it beat: citing it as the winner is caught
    assert disagreements(replace(suffix, k=16, evidence=replace(suffix.evidence, report=rival,
                                                                 rivals=(suffix.evidence.report,))),
                         suffix=SuffixConfig(cost_aware=True))
    assert disagreements(drafter_default("hybrid"), hybrid_lookup="suffix")


def test_help_shows_the_defaults_each_command_uses_on_the_bundled_pair(capsys):
    """generate, bench, serve-config and export print each kind's starting k; generate and bench the suffix options."""
    ks = ", ".join(f"{d.kind} {d.k}" for d in DRAFTER_DEFAULTS)
    for command, run in ((["generate"], main), (["serve-config"], main), ([], bench_main), (["export"], main)):
        with pytest.raises(SystemExit):
            run([*command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        if command == ["export"]:
            assert f"the shipped draft's best measured k, {drafter_default('model').k}" in text
        else:
            assert ks in text, command
        if command in (["generate"], []):
            assert f"default {SuffixConfig().max_spec_factor}, vLLM's {VLLM_SUFFIX.max_spec_factor}" in text


def test_serve_config_and_export_take_the_measured_k_and_say_where_it_is_from(tmp_path, capsys):
    """With no --k the shipped head is served and exported at its measured k, with the report named; suffix
    decoding's options that differ from vLLM's defaults are set in the config and named in a note."""
    model, suffix = drafter_default("model"), drafter_default("suffix")
    assert main(["serve-config", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["k"] == out["speculative_config"]["num_speculative_tokens"] == model.k
    assert model.evidence.report in out["k_source"]
    assert main(["serve-config", "--drafter", "suffix", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["k"] == suffix.k and out["speculative_config"]["suffix_decoding_max_spec_factor"] == 2.0
    assert any("vLLM's default 1.0" in n and suffix.evidence.report in n for n in out["notes"]), out["notes"]
    assert main(["export", "--draft", TRAINED_DRAFT_ID, "--out", str(tmp_path / "head")]) == 0
    assert json.loads((tmp_path / "head" / "speculative_config.json").read_text())["num_speculative_tokens"] == model.k
    meta = json.loads((tmp_path / "head" / "specdemo.json").read_text())
    assert meta["num_speculative_tokens"] == model.k and model.evidence.report in meta["num_speculative_tokens_source"]
    assert starting_k("model", BUNDLED_ID, str(tmp_path / "head"))[0] == model.k  # the export records it


def test_the_app_starts_each_bundled_preset_at_its_measured_k():
    """The default preset is the bundled target with its trained draft, at the model kind's measured k; every
    bundled preset starts at its kind's; Tune k's largest k reaches every kind's starting k."""
    assert preset_fields(default_preset()) == (BUNDLED_ID, "model", TRAINED_DRAFT_ID)
    assert preset_k(default_preset()) == drafter_default("model").k
    for label in ("Bundled SmolLM2-135M + prompt lookup (offline)",
                  "Bundled SmolLM2-135M + trained draft + prompt lookup (offline)"):
        assert preset_k(label) == drafter_default(preset_fields(label)[1]).k
    assert all(d.k <= TUNE_K_LARGEST for d in DRAFTER_DEFAULTS)


# ---- the same settings from every entry point, on the bundled model ----

PROMPT = "Rewrite more formally: gonna be late, traffic is bad"


def generate_json(capsys, *flags: str) -> dict:
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "8", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def bench_config(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "-".join(flags or ("default",))
    assert bench_main(["--limit", "1", "--max-new-tokens", "8", "--no-theory", "--quiet", "--out", str(out),
                       *flags]) == 0
    return json.loads((out / "bench.json").read_text())["config"]


@pytest.mark.slow
def test_the_app_generate_and_bench_start_the_same_pair_at_the_same_k(tmp_path, capsys):
    """The app's default run (its first preset, as the page opens), `generate --json` and `bench` with no flags run
    the same target, drafter and draft at the measured k; with --drafter suffix, generate and bench at the same k and
    options."""
    from test_handlers import OUTPUTS

    from specdemo.app.handlers import Handlers
    from specdemo.app.race import AppLimits

    label = default_preset()
    frames = list(Handlers(OUTPUTS, AppLimits()).run_compare(PROMPT, *preset_fields(label), preset_k(label), False,
                                                             0.0, 1.0, 8, False, False))
    app = frames[-1]["result_json"]
    cli, bench = generate_json(capsys), bench_config(tmp_path)
    k = drafter_default("model").k
    assert (app["target"], app["drafter"], app["draft"], app["k"]) == (BUNDLED_ID, "model", TRAINED_DRAFT_ID, k)
    assert (cli["target"], cli["drafter"], cli["draft"], cli["k"]) == (BUNDLED_ID, "model", TRAINED_DRAFT_ID, k)
    assert (bench["target"], bench["drafter"], bench["draft"], bench["k"]) == (BUNDLED_ID, "model", TRAINED_DRAFT_ID,
                                                                               [k])
    assert drafter_default("model").evidence.report in bench["k_source"]
    assert app["identical"] and cli["identical"]

    cli, bench = generate_json(capsys, "--drafter", "suffix"), bench_config(tmp_path, "--drafter", "suffix")
    assert cli["k"] == bench["k"][0] == drafter_default("suffix").k
    assert cli["suffix"] == SuffixConfig().as_dict() == {n: bench["suffix"][n] for n in cli["suffix"]}


def same_run(config: dict, other: dict) -> bool:
    """Whether two reports ran the same drafter, prompts and k."""
    return all(config[key] == other[key] for key in ("drafter", "prompts", "k"))


def tree_disagreements(d: DrafterDefault) -> list[str]:
    """What a default's tree evidence contradicts: the winning report ran another drafter, prompt set or tree setting,
    or a rival (another tree setting, same drafter, k and prompts, same sitting) was not slower. A report that ran
    several settings in one paired run (bench --tree a,b,..., by_tree), with its rivals as more such rounds, backs
    auto where auto beat the chains in every round, and chains where they beat auto in every round: a default is one
    of the two, since a fixed budget, however fast on the bundled pair, would not follow another target's or
    machine's pass costs (a steep one makes a wide tree lose)."""
    win = report(d.tree_evidence.report)
    c = win["config"]
    problems = []
    if c["drafter"] != d.kind or Path(c["prompts"]).name != d.tree_evidence.prompts:
        problems.append(f"{d.tree_evidence.report} is not a {d.kind} run on {d.tree_evidence.prompts}")
    if win.get("by_tree"):
        for folder in (d.tree_evidence.report, *d.tree_evidence.rivals):
            r = report(folder)
            if not same_run(r["config"], c):
                problems.append(f"{folder} is not the same drafter, prompts and k as {d.tree_evidence.report}")
            speedups = {setting: by_k[str(c["k"][0])]["speedup"] for setting, by_k in r["by_tree"].items()}
            other = {"auto": "off", "off": "auto"}.get(d.tree)
            if other is None or not {d.tree, other} <= set(speedups) or speedups[d.tree] <= speedups[other]:
                problems.append(f"{d.kind} starts with --tree {d.tree}; {folder} measured {speedups}")
        return problems
    if c["tree"]["setting"] != d.tree:
        problems.append(f"{d.kind} starts with --tree {d.tree}; {d.tree_evidence.report} ran {c['tree']['setting']}")
    for rival in d.tree_evidence.rivals:
        r = report(rival)
        if not same_run(r["config"], c):
            problems.append(f"{rival} is not the same drafter, prompts and k as {d.tree_evidence.report}")
        if r["config"]["tree"]["setting"] == c["tree"]["setting"]:
            problems.append(f"{rival} ran the same tree setting")
        if r["overall"]["speedup"] >= win["overall"]["speedup"]:
            problems.append(f"{rival} measured {r['overall']['speedup']:.3f}x, not below "
                            f"{win['overall']['speedup']:.3f}x")
    return problems


@pytest.mark.parametrize("d", [d for d in DRAFTER_DEFAULTS if d.tree_evidence], ids=lambda d: d.kind)
def test_each_tree_default_is_what_its_report_measured_best(d):
    """Each kind's --tree default (chains for most kinds on this CPU, auto for suffix decoding) is the setting its
    report measured best in the same sitting (of auto and chains); another setting as the default fails, and so does
    the evidence swapped with its rival."""
    assert tree_disagreements(d) == []
    for other in ("off", "auto", "8"):
        if other != d.tree:
            assert any("starts with --tree" in p for p in tree_disagreements(replace(d, tree=other)))
    if not report(d.tree_evidence.report).get("by_tree"):
        swapped = replace(d, tree_evidence=replace(d.tree_evidence, report=d.tree_evidence.rivals[0],
                                                   rivals=(d.tree_evidence.report,)))
        assert tree_disagreements(swapped)


def test_the_heads_tree_default_keeps_the_pages_pace():
    """The trained head starts with auto trees (its five paired CLI rounds: the test above). Before the compiled
    few-row products its trees ran level with the chains and it started with chains; with them the page's default
    run, trees now, kept within the page check's bounds (0.8-1.2 of the CLI's speedup and autoregressive pace)."""
    assert drafter_default("model").tree == "auto"
    for case in ("default", "head_trees"):
        page = json.loads((REPO / f"bench/app-live/page-vs-cli-2026-12-06/page-vs-cli-{case}.json").read_text())
        assert all(0.8 <= page["page_over_cli"][key] <= 1.2 for key in ("speedup", "ar_tokens_per_s")), case
    assert drafter_default("model").tree_evidence.sitting == "2026-12-06 08:05-08:16 UTC"


def test_generate_and_bench_start_each_drafter_with_its_tree_default(capsys):
    """--help of generate and bench names each kind's tree default; bench's config resolves it (no --tree given)."""
    from specdemo.config import tree_default
    from specdemo.measure.bench.run import BenchConfig

    for kind in ("model", "ngram", "suffix", "hybrid"):
        assert BenchConfig(drafter=kind).tree_setting == tree_default(kind) == drafter_default(kind).tree
    assert BenchConfig(drafter="ngram", tree="8").tree_setting == "8"
    for command in (["generate", "--help"], ["bench", "--help"]):
        with pytest.raises(SystemExit):
            main(command) if command[0] == "generate" else bench_main(command[1:])
        out = " ".join(capsys.readouterr().out.split())
        assert "model auto, ngram off, hybrid off, suffix auto" in out
