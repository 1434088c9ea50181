"""The components the handlers update, by tab, as ui.build_demo builds them; each dataclass's field order is its
event's outputs order. No gradio: a component is only a key of the dicts the handlers return."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

Component = Any  # a gradio component; the handlers use it only as a key of the dicts they return


class OrderedOutputs:
    def order(self) -> list[Component]:
        """The components in field order: the event's outputs list."""
        return [getattr(self, f.name) for f in fields(self)]


@dataclass(frozen=True)
class RaceOutputs(OrderedOutputs):
    """The Race tab, in the /compare event's outputs order (API clients read result_json as outputs[7])."""

    ar_html: Component
    sd_html: Component
    tokens_plot: Component
    speedup_plot: Component
    hist_plot: Component
    stats: Component
    status: Component
    result_json: Component
    runs_state: Component  # the finished race.Runs, so "Replay race" and hiding rejected drafts need no new run
    timeline_plot: Component
    position_plot: Component


@dataclass(frozen=True)
class SweepOutputs(OrderedOutputs):
    """The Tune-k tab, in the /sweep_k event's outputs order."""

    plot: Component
    table: Component  # status line, then the sweep table
    best: Component  # state: the best measured k (with its tree setting, when several ran), for the apply button
    apply: Component  # the "Use best k" button


@dataclass(frozen=True)
class SettingsOutputs:
    """The settings a preset fills (target, drafter, draft) and "Use best k" sets (k, and the Tree setting when the
    sweep ran several); picking a drafter sets k and the preset shown."""

    target: Component
    drafter: Component
    draft: Component
    k: Component
    tree: Component = None
    preset: Component = None


@dataclass(frozen=True)
class Outputs:
    """Everything the handlers update, by tab."""

    race: RaceOutputs
    sweep: SweepOutputs
    settings: SettingsOutputs
