"""The Batch tab's handlers without a server, on a tiny model: request checks, frames over the tab's outputs only,
the crossover in the plots, the hardware lock released on success and on error."""

import pytest
import torch

from specdemo.app.batch_tab import (
    BATCH_SIZES,
    BatchHandlers,
    BatchOutputs,
    make_batch_request,
)
from specdemo.app.handlers import Handlers
from specdemo.app.race import AppLimits, UserError

OUTPUTS = BatchOutputs("throughput_plot", "speedup_plot", "table")  # names stand in for components
KEYS = {"throughput_plot", "speedup_plot", "table"}
PROMPTS = "w3 w5 w7 w3 w5 w9 w2\nw4 w4 w1\n\nw9 w8 w7 w6 w5"
LIMITS = AppLimits(max_new_tokens=64, device="cpu")


def request(**changes):
    values = dict(prompts_text=PROMPTS, use_examples=False, examples=["an example"], target="smollm2-135m",
                  drafter="ngram", draft="", k=3, auto_k=False, temperature=0.0, top_p=1.0, new_tokens=8, largest=4,
                  anchors=False, limits=LIMITS)
    return make_batch_request(**{**values, **changes})


def test_batch_request_checks_its_values():
    r = request()
    assert r.prompts == ("w3 w5 w7 w3 w5 w9 w2", "w4 w4 w1", "w9 w8 w7 w6 w5")  # one per line, blank lines dropped
    assert r.batch_sizes == (1, 2, 4) and r.k == 3 and r.config.max_new_tokens == 8
    assert request(auto_k=True).k is None and request(use_examples=True).prompts == ("an example",)
    assert request(largest=max(BATCH_SIZES)).batch_sizes == BATCH_SIZES
    assert r.config.sampling.verification == "token"  # the race's rule reaches the sweep's sampling
    assert request(temperature=0.8, verification="block").config.sampling.verification == "block"
    for bad, match in [(dict(prompts_text=" \n "), "No prompts"), (dict(largest=3), "largest batch size"),
                       (dict(new_tokens=65), "max new tokens"), (dict(drafter="magic"), "drafter must be one of"),
                       (dict(prompts_text="p\n" * 65), "At most"), (dict(verification="tree"), "verification")]:
        with pytest.raises(UserError, match=match):
            request(**bad)


def test_batch_sweep_frames_name_only_the_tabs_outputs(tiny_loads):
    """Status lines while the runs are timed (nothing drawn then), then both plots and the table once, saying Done;
    the lock is free."""
    race = Handlers(None, LIMITS)
    lock = race.hardware
    h = BatchHandlers(OUTPUTS, ["w1 w2 w1 w2"], race, LIMITS)
    outs = list(h.run(PROMPTS, False, "tiny", "ngram", "", 3, True, 0.0, 1.0, 8, 2, True))
    assert all(isinstance(o, dict) and set(o) <= KEYS for o in outs)
    plotted = [o for o in outs if "speedup_plot" in o]
    assert plotted == outs[-1:] and set(plotted[-1]) == KEYS
    assert outs[-1]["table"].startswith("Done") and "| 2 |" in outs[-1]["table"]
    assert "Speedup vs batch size" in plotted[-1]["speedup_plot"].layout.title.text
    assert not lock.locked()


def test_the_batch_tab_loads_with_the_servers_device_map_and_draft_device(tiny_loads):
    """As the race does: the server's placement (SPECDEMO_DEVICE_MAP ...) and SPECDEMO_DRAFT_DEVICE reach load_pair."""
    from specdemo.config import placement_from

    limits = AppLimits(max_new_tokens=64, device="cpu", draft_device="cpu",
                       placement=placement_from("sequential", "cpu=1GiB"))
    h = BatchHandlers(OUTPUTS, [], Handlers(None, limits), limits)
    outs = list(h.run(PROMPTS, False, "tiny", "ngram", "", 3, False, 0.0, 1.0, 8, 1, False))
    assert outs[-1]["table"].startswith("Done") and "Where it ran: target on cpu: all" in outs[-1]["table"]
    assert tiny_loads[-1]["placement"] == limits.placement and tiny_loads[-1]["draft_device"] == "cpu"


def test_batch_errors_are_messages_and_release_the_hardware():
    def fails(request, *args):
        raise torch.OutOfMemoryError("CUDA out of memory")
        yield

    race = Handlers(None, LIMITS)
    lock = race.hardware
    h = BatchHandlers(OUTPUTS, [], race, LIMITS, gpu=lambda fn: fails)
    with pytest.warns(UserWarning, match="Out of memory"):
        outs = list(h.run(PROMPTS, False, "tiny", "ngram", "", 3, False, 0.0, 1.0, 8, 2, False))
    assert outs[-1]["table"].startswith("**Error:** Out of memory") and not lock.locked()
    assert list(h.run("", False, "tiny", "ngram", "", 3, False, 0.0, 1.0, 8, 2, False))[-1]["table"].startswith(
        "**Error:** No prompts")


def test_stop_ends_the_batch_sweep_and_frees_the_hardware(tiny_loads):
    """Stop marks the visitor's sweep (as in the race: no gradio cancel); it ends at its next step with "Stopped."."""
    race = Handlers(None, LIMITS)
    h = BatchHandlers(OUTPUTS, [], race, LIMITS)
    run = h.run(PROMPTS, False, "tiny", "ngram", "", 3, False, 0.0, 1.0, 8, 2, False)
    first = next(run)
    assert set(first) <= KEYS
    h.stop()
    outs = list(run)
    assert outs[-1] == {"table": "Stopped."} and not race.hardware.locked()
    assert not race.running and not race.stopping
