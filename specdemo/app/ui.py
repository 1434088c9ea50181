"""The Gradio layout: gr.Blocks, its components and which handler each event calls. The handlers are in
specdemo.app.handlers; this module holds no logic beyond what the page shows at first.
"""

from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from ..config import (
    BUNDLED_ID,
    MAX_K,
    MIN_K,
    PRESETS,
    TRAINED_DRAFT_ID,
    TREE_CHOICES,
    TREE_DEFAULT,
    TUNE_K_LARGEST,
    TUNE_TREES,
    VERIFICATION_RULES,
    GenerationConfig,
    Runtime,
    SamplingConfig,
    tree_defaults_help,
)
from ..drafters.registry import kinds
from ..drafters.resolve import trained_draft_path
from ..measure import charts
from .batch_tab import BATCH_NOTE, BATCH_SIZES, BatchHandlers, BatchOutputs
from .handlers import Handlers, Outputs, RaceOutputs, SettingsOutputs, SweepOutputs
from .race import AppLimits, preset_choices, preset_fields, preset_k
from .render import CSS, INSPECTOR_JS, inspector_html, legend_html, segments_html
from .summary import RULE_NAMES

TIMING_NOTE = (
    "**How the timing works.** After a short untimed warm-up, the autoregressive and the speculative run take turns "
    "on the hardware, one decoder step at a time, never at the same time: the next step is always the one of the run "
    "whose own clock is behind, so both panels fill side by side and anything else the machine does falls on both "
    "alike. Each clock counts only its own run's compute and pauses while a frame is handed to this page; the plots "
    "are drawn when the timed work is over. The runs are computed in a process of their own. Runs from different "
    "users queue for the hardware rather than share it."
)

EXAMPLES = [  # (category, prompt): prompts written for this app
    ("summarize", "Summarize the following paragraph in two sentences:\n\nThe city council met on Tuesday to discuss "
     "the new bike lane proposal. Supporters argued that protected lanes along Main Street would reduce accidents and "
     "encourage commuters to leave their cars at home. Shop owners worried that removing forty parking spaces would "
     "hurt business during the holiday season. After three hours of debate, the council voted to build the lanes but "
     "to delay construction until February."),
    ("rewrite", "Rewrite this note so it sounds friendly but professional. Keep every fact:\n\nhey, the report you "
     "sent is missing the march numbers again. i need them by friday or the budget meeting is pointless. also the "
     "chart on page 4 has the wrong labels on the axes. fix it."),
    ("code", "Write a Python function `chunk(items, size)` that splits a list into consecutive chunks of the given "
     "size. Include a docstring and two doctest examples."),
    ("structured output", 'Convert this list into a JSON array of objects with the keys "name", "city" and "age":\n\n'
     "Alice, Paris, 31\nBob, Berlin, 45\nChen, Shanghai, 28\nDana, Toronto, 39\nEmeka, Lagos, 52"),
    ("open chat", "What are some good habits for staying focused while working from home?"),
    ("creative", "Write a short poem about a lighthouse keeper who befriends a seagull."),
]


def default_preset() -> str:
    """The bundled target with the trained draft when it is shipped, else with prompt lookup."""
    offline = [p for p in PRESETS if p.offline]
    with_draft = [p for p in offline if p.draft == TRAINED_DRAFT_ID and not p.drafter]
    if with_draft and trained_draft_path(BUNDLED_ID) is not None:
        return with_draft[0].label
    return next(p.label for p in offline if p.draft is None)


def build_demo(limits: AppLimits = AppLimits(), runtime: Runtime = Runtime(),
               gpu: Callable | None = None) -> gr.Blocks:
    """The app. `runtime` goes to load_pair; `gpu` is spaces.GPU on ZeroGPU hardware, else None."""
    with gr.Blocks(title="Speculative decoding, shown truthfully") as demo:
        gr.Markdown("## Speculative decoding, shown truthfully\nA draft proposes *k* tokens, the target checks them "
                    "all in one pass and keeps the ones it agrees with: plain autoregressive decoding on the left, "
                    "speculative on the right, same prompt and settings.", elem_id="intro")
        first = preset_fields(default_preset())  # a default preset is never Custom
        # the settings sit beside the tabs, so that after Run both panels are in view on a laptop screen
        with gr.Row(equal_height=False):
            with gr.Column(scale=2, min_width=320, elem_id="settings"):
                prompt = gr.Textbox(label="Prompt", lines=4, max_lines=8, value=EXAMPLES[1][1], elem_id="prompt")
                preset = gr.Dropdown(preset_choices(limits), value=default_preset(), label="Preset pair")
                drafter = gr.Radio([(kind.label, kind.name) for kind in kinds()], value=first[1], label="Drafter")
                with gr.Row():
                    k = gr.Slider(MIN_K, MAX_K, value=preset_k(default_preset(), runtime), step=1,
                                  label="k (draft tokens per step)", scale=3)
                    dynamic_k = gr.Checkbox(label="dynamic k", value=False, scale=1)
                with gr.Accordion("More settings", open=False):
                    target = gr.Textbox(first[0], label="Target model id")
                    draft = gr.Textbox(first[2], label="Draft model id (same tokenizer)",
                                       placeholder="empty: the target's trained draft")
                    with gr.Row():
                        temperature = gr.Slider(0.0, 2.0, value=SamplingConfig.temperature, step=0.05,
                                                label="temperature (0 = greedy)")
                        top_p = gr.Slider(0.05, 1.0, value=SamplingConfig.top_p, step=0.05, label="top-p")
                    verification = gr.Radio([(RULE_NAMES[r], r) for r in VERIFICATION_RULES],
                                            value=SamplingConfig.verification, label="verification of sampled drafts",
                                            visible=SamplingConfig.temperature > 0, elem_id="verification",
                                            info="both keep the target's distribution; block judges the drafts "
                                                 "jointly and accepts at least as many in expectation")
                    tree = gr.Dropdown([(f"default ({tree_defaults_help()})", TREE_DEFAULT), *TREE_CHOICES],
                                       value=TREE_DEFAULT, allow_custom_value=True, label="draft trees",
                                       elem_id="tree", info="default: the drafter's best measured setting; auto: "
                                       "branches where they pay for the wider pass; off: chains; N: up to N nodes "
                                       "per step, verified in one pass")
                    max_new_tokens = gr.Slider(1, limits.max_new_tokens, step=1, label="max new tokens",
                                               value=min(GenerationConfig.max_new_tokens, limits.max_new_tokens))
                    with gr.Row():
                        hide_rejected = gr.Checkbox(label="hide rejected drafts", value=False)
                        replay = gr.Checkbox(label="then replay at measured pace", value=False)
                gr.Examples([[p] for _, p in EXAMPLES], inputs=[prompt],
                            example_labels=[f"{c}: {p[:40]}…" for c, p in EXAMPLES], label="Examples by category")
            with gr.Column(scale=5):
                with gr.Tab("Race"):
                    with gr.Row():
                        run_btn = gr.Button("Run", variant="primary", elem_id="run")
                        replay_btn = gr.Button("Replay race", elem_id="replay")
                        remeasure_btn = gr.Button("Re-measure", elem_id="remeasure")
                        stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                        clear_btn = gr.Button("Clear suffix cache", elem_id="clear-suffix", size="sm")
                    status = gr.Markdown("Ready.", elem_id="status")
                    with gr.Row():
                        with gr.Column():
                            gr.Markdown("**Autoregressive** (target only)")
                            ar_html = gr.HTML(segments_html([]), elem_id="ar-panel")
                        with gr.Column():
                            gr.Markdown("**Speculative** (click a token to inspect its step)")
                            sd_html = gr.HTML(segments_html([]), elem_id="sd-panel")
                    gr.HTML(legend_html())
                    gr.HTML(inspector_html(), elem_id="inspector")
                    stats = gr.Markdown(elem_id="stats")
                    gr.Markdown(TIMING_NOTE)
                    with gr.Row():
                        # blank figures on load: the browser loads plotly now, not while a run is being timed
                        tokens_plot = gr.Plot(charts.blank("tokens"), label="tokens vs time")
                        speedup_plot = gr.Plot(charts.blank("speedup"), label="running speedup")
                        hist_plot = gr.Plot(charts.blank("histogram"), label="accepted drafts per step")
                    with gr.Row():
                        timeline_plot = gr.Plot(charts.blank("timeline"), label="where the time goes",
                                                elem_id="timeline")
                        position_plot = gr.Plot(charts.blank("positions"), label="acceptance by draft position",
                                                elem_id="positions")
                    result_json = gr.JSON(label="result (same keys as `python -m specdemo generate --json`)",
                                          elem_id="result")
                    runs_state = gr.State(None)
                with gr.Tab("Tune k"):
                    gr.Markdown("Sweeps k and the draft-tree setting on the current prompt and settings: one "
                                "autoregressive baseline, then one speculative run per k and tree setting (a setting "
                                "that drafts the same chains as another runs once). The dashed curve is the expected "
                                "speedup of chains from the measured acceptance α and cost ratio c (Leviathan et al. "
                                "2023). Nothing is drawn until the timed runs are over.")
                    with gr.Row():
                        k_max = gr.Slider(2, MAX_K, value=TUNE_K_LARGEST, step=1, label="largest k")
                        sweep_trees = gr.CheckboxGroup(list(TREE_CHOICES),
                                                       value=list(TUNE_TREES), label="draft trees to sweep",
                                                       elem_id="sweep-trees")
                        sweep_btn = gr.Button("Sweep k", variant="primary")
                        sweep_stop = gr.Button("Stop", variant="stop")
                        apply_btn = gr.Button("Use best k", interactive=False)
                    sweep_plot = gr.Plot(label="speedup and acceptance vs k")
                    sweep_md = gr.Markdown()
                    best_state = gr.State(None)
                batch_parts = batch_tab_layout(limits)

        race = RaceOutputs(ar_html, sd_html, tokens_plot, speedup_plot, hist_plot, stats, status, result_json,
                           runs_state, timeline_plot, position_plot)
        tune = SweepOutputs(sweep_plot, sweep_md, best_state, apply_btn)
        settings = SettingsOutputs(target, drafter, draft, k, tree, preset)
        h = Handlers(Outputs(race, tune, settings), limits, runtime, gpu)

        # .input, not .change: each fires on the user's own choice only, so the preset a picked drafter shows does
        # not apply itself again, and a preset's drafter does not set k twice
        preset.input(h.apply_preset, preset, [target, drafter, draft, k], api_name=False)
        drafter.input(h.apply_drafter, [drafter, target, draft], [k, preset], api_name=False, queue=False)
        # greedy decoding has one rule, so the choice is shown only while sampling
        temperature.change(rule_control, temperature, verification, api_name=False, queue=False)
        inputs = [prompt, target, drafter, draft, k, dynamic_k, temperature, top_p, max_new_tokens]
        # preprocess=False: the handlers check raw values themselves, so an API client sending "abc" for k gets a
        # clear message instead of gradio's failed comparison
        # show_progress="hidden": gradio's progress timer redraws the page ten times a second, on the CPU the runs are
        # timed on; the status line says what is happening
        # new inputs go last, so API clients that send the first ones keep working (a missing one: its default)
        run_btn.click(h.run_compare, inputs + [hide_rejected, replay, verification, tree], race.order(),
                      api_name="compare", show_progress="hidden", preprocess=False)
        remeasure_btn.click(h.remeasure, inputs + [hide_rejected, replay, verification, tree], race.order(),
                            api_name=False, show_progress="hidden", preprocess=False)
        replay_btn.click(h.replay_race, [runs_state, hide_rejected], race.order(), api_name=False,
                                        show_progress="hidden")
        # Stop marks the run, which ends itself at its next step (handlers.Stopped); no gradio cancel, whose
        # in-flight frames could land after the "Stopped." line
        stop_btn.click(h.stop_race, None, None, queue=False, api_name=False)
        # suffix decoding's earlier answers are this session's alone: Clear forgets them, and so does closing the tab
        clear_btn.click(h.clear_suffix_cache, None, status, queue=False, api_name=False)
        demo.unload(h.forget_session)
        hide_rejected.change(h.rerender, [runs_state, hide_rejected, sd_html], sd_html, api_name=False)
        sweep_btn.click(h.run_sweep, [prompt, target, drafter, draft, k_max, temperature, top_p, max_new_tokens,
                                      verification, sweep_trees],
                        tune.order(), api_name="sweep_k", show_progress="hidden", preprocess=False)
        sweep_stop.click(h.stop_sweep, None, None, queue=False, api_name=False)
        apply_btn.click(h.apply_best_k, best_state, [k, tree], api_name=False)
        batch_tab_events(batch_parts, h, [target, drafter, draft, k], [temperature, top_p], [verification, tree],
                         limits, runtime, gpu)
    return demo


def rule_control(temperature) -> dict:
    """The verification choice is visible only while sampling (temperature > 0)."""
    try:
        return gr.update(visible=float(temperature) > 0)
    except (TypeError, ValueError):
        return gr.update()


def batch_tab_layout(limits: AppLimits) -> dict:
    """The Batch tab's components (inside build_demo's tabs): several prompts decoded together at each batch size."""
    with gr.Tab("Batch"):
        gr.Markdown("Decodes several prompts together at each batch size, autoregressive then speculative (one "
                    "target pass verifies every row's drafts), and plots total throughput and the speedup against "
                    "batch size. Every size runs the same prompts; nothing is drawn until the timed runs are over.")
        with gr.Row():
            prompts = gr.Textbox(label="Prompts, one per line", lines=6, scale=3,
                                 placeholder="one prompt per line (or use the examples)")
            with gr.Column(scale=2):
                use_examples = gr.Checkbox(label="use the example prompts instead", value=True)
                largest = gr.Dropdown(list(BATCH_SIZES), value=8, label="largest batch size (1, 2, 4, … up to it)")
                new_tokens = gr.Slider(1, limits.max_new_tokens, value=min(32, limits.max_new_tokens), step=1,
                                       label="new tokens per prompt")
                with gr.Row():
                    auto_k = gr.Checkbox(label="auto k per batch size", value=True)
                    anchors = gr.Checkbox(label="also time transformers' generate", value=False)
        with gr.Row():
            run_btn = gr.Button("Sweep batch sizes", variant="primary")
            stop_btn = gr.Button("Stop", variant="stop")
        with gr.Row():
            throughput = gr.Plot(label="throughput vs batch size")
            speedup = gr.Plot(label="speedup vs batch size")
        table = gr.Markdown()
        gr.Markdown(BATCH_NOTE)
    return dict(prompts=prompts, use_examples=use_examples, largest=largest, new_tokens=new_tokens, auto_k=auto_k,
                anchors=anchors, run_btn=run_btn, stop_btn=stop_btn, outputs=BatchOutputs(throughput, speedup, table))


def batch_tab_events(parts: dict, h: Handlers, model_inputs: list, sampling_inputs: list, rule_inputs: list,
                     limits: AppLimits, runtime: Runtime, gpu: Callable | None) -> None:
    """The Batch tab's events: it reads the shared target, drafter, draft, k, temperature, top-p, verification rule
    and Tree setting (rule_inputs), and shares the race's hardware lock."""
    b = BatchHandlers(parts["outputs"], [p for _, p in EXAMPLES], h, limits, runtime, gpu)
    parts["run_btn"].click(b.run, [parts["prompts"], parts["use_examples"], *model_inputs, parts["auto_k"],
                                   *sampling_inputs, parts["new_tokens"], parts["largest"], parts["anchors"],
                                   *rule_inputs],
                           parts["outputs"].order(), api_name=False, show_progress="hidden")
    parts["stop_btn"].click(b.stop, None, None, queue=False, api_name=False)  # the run itself writes "Stopped."


def launch_options() -> dict:
    """Theme, css and the step inspector's script for demo.launch() (Gradio 6 takes them there, not in Blocks)."""
    return {"css": CSS, "theme": gr.themes.Soft(), "js": INSPECTOR_JS}
