"""The page without a server: the layout (components, events, API names and their outputs order). The handlers' own
tests are in test_handlers.py, the token rendering's in test_render.py, the charts' in test_charts.py."""

from __future__ import annotations

import ast
from pathlib import Path

import gradio as gr
import pytest

from specdemo.app.handlers import Handlers
from specdemo.app.race import CUSTOM, AppLimits, preset_choices
from specdemo.app.ui import build_demo, rule_control
from specdemo.config import MAX_K, PRESETS, TREE_CHOICES, TREE_DEFAULT, TUNE_TREES, Runtime

PACKAGE = Path(__file__).resolve().parent.parent / "specdemo"
COMPARE_INPUTS = ["Prompt", "Target model id", "Drafter", "Draft model id (same tokenizer)",
                  "k (draft tokens per step)", "dynamic k", "temperature (0 = greedy)", "top-p", "max new tokens",
                  "hide rejected drafts", "then replay at measured pace", "verification of sampled drafts",
                  "draft trees"]


@pytest.fixture(scope="module")
def demo():
    return build_demo(AppLimits(max_new_tokens=64), Runtime(cache_dir="/nowhere"))


def event(demo: gr.Blocks, api_name: str):
    return next(fn for fn in demo.fns.values() if fn.api_name == api_name)


def test_compare_endpoint_keeps_its_inputs_and_outputs_order(demo):
    """/compare takes the README's 11 inputs in order, then the verification rule, then the draft-tree setting (new
    inputs go last, so older clients keep working); outputs[7] is the result JSON, [6] the status line."""
    fn = event(demo, "compare")
    assert [c.label for c in fn.inputs] == COMPARE_INPUTS
    assert [type(c).__name__ for c in fn.outputs] == ["HTML", "HTML", "Plot", "Plot", "Plot", "Markdown", "Markdown",
                                                      "JSON", "State", "Plot", "Plot"]
    assert [c.elem_id for c in fn.outputs[9:]] == ["timeline", "positions"]
    assert not fn.preprocess  # the handler checks raw values, so a non-numeric k gets its own clear message
    assert [c.elem_id for c in fn.outputs[:2]] == ["ar-panel", "sd-panel"] and fn.outputs[6].elem_id == "status"
    assert fn.outputs == fn.fn.__self__.outputs.race.order()  # the handler's dict keys are the event's outputs


def test_sweep_endpoint_keeps_its_inputs_and_outputs_order(demo):
    """/sweep_k takes the run's inputs with the largest k in k's place, then the tree settings to sweep, and updates
    plot, table, best k, button."""
    fn = event(demo, "sweep_k")
    expected = COMPARE_INPUTS[:4] + ["largest k"] + COMPARE_INPUTS[6:9] + COMPARE_INPUTS[-2:-1] + [
        "draft trees to sweep"]
    assert [c.label for c in fn.inputs] == expected
    assert [type(c).__name__ for c in fn.outputs] == ["Plot", "Markdown", "State", "Button"]
    assert fn.outputs == fn.fn.__self__.outputs.sweep.order()


def test_the_verification_choice_shows_only_while_sampling(demo):
    """The rule radio starts hidden (greedy by default) and offers token and block; a temperature change shows it
    above 0 and hides it at 0, without the queue; a value that is not a number leaves it alone."""
    radio = next(c for c in demo.blocks.values() if getattr(c, "elem_id", None) == "verification")
    assert not radio.visible and [v for _, v in radio.choices] == ["token", "block"] and radio.value == "token"
    fn = next(fn for fn in demo.fns.values() if getattr(fn.fn, "__name__", "") == "rule_control")
    assert [c.label for c in fn.inputs] == ["temperature (0 = greedy)"] and fn.outputs == [radio] and not fn.queue
    assert rule_control(0.7)["visible"] is True and rule_control(0)["visible"] is False
    assert "visible" not in rule_control("abc")


def test_the_tree_setting_and_the_tree_sweep(demo):
    """The Tree setting starts at the drafter's measured default and offers auto, off and node budgets (any other
    typed); Tune k sweeps config.TUNE_TREES unless told others; "Use best k" sets k and the Tree setting."""
    tree = next(c for c in demo.blocks.values() if getattr(c, "elem_id", None) == "tree")
    assert [v for _, v in tree.choices] == [TREE_DEFAULT, *TREE_CHOICES] and tree.value == TREE_DEFAULT
    assert tree.allow_custom_value
    trees = next(c for c in demo.blocks.values() if getattr(c, "elem_id", None) == "sweep-trees")
    assert trees.value == list(TUNE_TREES) and [v for _, v in trees.choices] == list(TREE_CHOICES)
    fn = next(fn for fn in demo.fns.values() if getattr(fn.fn, "__name__", "") == "apply_best_k")
    assert fn.outputs[1] is tree and fn.outputs[0].label == "k (draft tokens per step)"


def test_replay_race_reuses_the_finished_runs_and_stop_only_marks_them(demo):
    """Replay race reads the runs' state and updates the race outputs; the Stop buttons skip the queue and update
    nothing themselves (the run they stop writes "Stopped."), and no gradio cancel is wired to them."""
    fns = {getattr(fn.fn, "__name__", ""): fn for fn in demo.fns.values()}
    race = fns["replay_race"].fn.__self__.outputs.race
    assert fns["replay_race"].inputs[0] is race.runs_state and fns["replay_race"].outputs == race.order()
    for name in ("stop_race", "stop_sweep"):
        assert not fns[name].queue and not fns[name].outputs
    assert not any(fn.is_cancel_function for fn in demo.fns.values())


def test_the_page_loads_the_inspector_script():
    """launch_options carries the inspector's script; the page has its panel under the speculative one."""
    from specdemo.app.render import INSPECTOR_JS
    from specdemo.app.ui import launch_options

    assert launch_options()["js"] == INSPECTOR_JS


def test_only_the_two_endpoints_are_public(demo):
    """Presets, Stop, Replay race, hide-rejected and "Use best k" are page events, not API endpoints."""
    info = demo.get_api_info()
    assert set(info["named_endpoints"]) == {"/compare", "/sweep_k"} and not info["unnamed_endpoints"]


def test_the_handlers_get_the_apps_limits_and_runtime(demo):
    """build_demo hands its AppLimits and Runtime to one Handlers object shared by every event."""
    owners = {fn.fn.__self__ for fn in demo.fns.values() if isinstance(getattr(fn.fn, "__self__", None), Handlers)}
    assert len(owners) == 1
    (h,) = owners
    assert h.limits == AppLimits(max_new_tokens=64) and h.runtime == Runtime(cache_dir="/nowhere")


def test_sliders_take_their_ranges_from_config_and_limits(demo):
    """k runs to config.MAX_K and max new tokens to the server's cap; the presets respect the allowlist."""
    sliders = {c.label: c for c in demo.blocks.values() if isinstance(c, gr.Slider)}
    assert sliders["k (draft tokens per step)"].maximum == MAX_K
    assert sliders["max new tokens"].maximum == 64
    only_bundled = preset_choices(AppLimits(allowlist=("org/none",)))
    assert only_bundled == [p.label for p in PRESETS if p.offline] + [CUSTOM]


def _layer(parts: list[str]) -> str:
    """A module's layer: its folder under specdemo/, except that the engine's decoding loop (engine.loop, its
    on-device step engine.device_step, and the package, which exports it) sits above drafters/, whose seam
    (drafters.base) it imports."""
    if len(parts) < 2:
        return "__init__"
    if parts[1] == "engine" and (len(parts) == 2 or parts[2] in ("loop", "device_step", "__init__")):
        return "engine.loop"
    return parts[1]


def _targets(parts: list[str], node: ast.ImportFrom) -> list[list[str]]:
    """The modules a relative `from ... import a, b` reads: the module named, or each name that is a submodule of it
    (`from ..engine import graphs` reads engine.graphs, not the package)."""
    base = parts[:-1][: len(parts) - node.level] + (node.module.split(".") if node.module else [])
    folder = PACKAGE.parent.joinpath(*base)
    subs = [base + [a.name] for a in node.names
            if (folder / f"{a.name}.py").is_file() or (folder / a.name / "__init__.py").is_file()]
    return subs if len(subs) == len(node.names) else [base]


def test_imports_point_down():
    """Imports point one way: the top-level modules, then models/, then the engine's cache, verification and clocks,
    then drafters/, then the decoding loop, then checks (the request checks), then measure/, serve/ and train/, then
    app/, then the CLI. So drafters may use the engine's KV cache and probability helpers but never the loop or
    measure/; the engine knows drafters only through their seam (drafters.base), which imports nothing of the engine.
    At most 8 modules sit at the package's top level. (Which packages may import gradio and plotly:
    test_limits.py.)"""
    rank = {"config": 0, "prompts": 0, "cliargs": 0, "__init__": 0, "models": 1, "engine": 2, "drafters": 3,
            "engine.loop": 4, "checks": 4.5, "measure": 5, "serve": 5, "train": 5, "app": 6, "__main__": 7}
    upward, seam = [], []
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        layer = _layer(parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                for target in _targets(parts, node):
                    if rank.get(_layer(target), 0) > rank[layer]:
                        upward.append((".".join(parts), ".".join(target)))
                    if parts[1:2] == ["engine"] and target[1:2] == ["drafters"] and target[2:] != ["base"]:
                        seam.append((".".join(parts), ".".join(target)))
                    if parts[1:3] == ["drafters", "base"] and target[1:2] == ["engine"]:
                        seam.append((".".join(parts), ".".join(target)))
    assert upward == []
    assert seam == []
    assert len([p for p in PACKAGE.glob("*.py")]) <= 8


# modules outside drafters/ that still name a particular drafter, and why
PARTICULAR = {("specdemo/serve/serve_config.py", "NgramDrafter"): "vLLM's ngram method takes our lookup's window",
              ("specdemo/train/heads.py", "drafters.eagle3"): "train/ makes EAGLE-3 heads and drafts with them"}


def test_outside_drafters_only_the_seam_the_registry_and_resolve_are_imported():
    """A drafter's options, state and calibration reach every layer through the seam (drafters.base), the registry
    and resolve_draft, so no module outside drafters/ imports a particular drafter (PARTICULAR aside)."""
    import specdemo.drafters.base as base

    seam = {n for n in vars(base) if not n.startswith("_")}
    found = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[1:2] == ["drafters"]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                target = parts[:-1][: len(parts) - node.level] + (node.module.split(".") if node.module else [])
                if target[1:2] != ["drafters"]:
                    continue
                if len(target) > 2 and target[2] not in ("base", "registry", "resolve"):
                    found.add((rel, ".".join(target[1:3])))
                found |= {(rel, a.name) for a in node.names if len(target) == 2 and a.name not in seam}
    assert found == set(PARTICULAR)
