"""Run autoregressive then speculative decoding on the same prompt and settings, and report both.

The two runs never overlap: each one's clock counts only its own compute (see engine.StepEvent.elapsed).
This is the one place that builds drafters from user-facing names; the CLI, the app and the benchmark use it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import BUNDLED_HUB_ID, BUNDLED_ID, TRAINED_DRAFT_ID, GenerationConfig
from .drafters import Drafter, HybridDrafter, ModelDrafter, NgramDrafter
from .engine import StepEvent, autoregressive, encode_prompt, generated_ids, speculative
from .loading import BUNDLED_ALIASES, LoadedModel, ModelLoadError, check_tokenizers, load_model
from .metrics import RunStats, run_stats, speedup

log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DRAFTER_KINDS = ("model", "ngram", "hybrid")


@dataclass
class Pair:
    """A loaded target and a drafter for it."""

    target: LoadedModel
    drafter: Drafter
    drafter_kind: str  # "model", "ngram" or "hybrid" (prompt lookup where the context repeats, else the model)
    draft_name: str | None  # None for prompt lookup


def trained_draft_path(target_name: str) -> Path | None:
    """The shipped distilled draft for a target, if there is one."""
    if target_name.lower() in BUNDLED_ALIASES | {BUNDLED_HUB_ID.lower()}:
        path = ASSETS / TRAINED_DRAFT_ID
        return path if _is_trained_draft(path) else None
    return None


def _is_trained_draft(path: Path) -> bool:
    from .eagle import CONFIG_FILE

    return (path / CONFIG_FILE).exists()


def default_draft(target_name: str) -> str | None:
    """The draft used when --drafter model is given without --draft."""
    return TRAINED_DRAFT_ID if trained_draft_path(target_name) else None


# What hybrid_model_k assumes of a draft that carries no held-out figures of its own: the chance that its first and its
# first two drafted tokens are accepted (the held-out chain of the self-written draft shipped until 2026-12-01; the
# one shipped now has 0.51 / 0.26 on harder held-out requests, and both choose one token per step here when the
# load-time timing is steady), and its cost per drafted token over a 1-token target pass where none was measured (the
# shipped draft's, bench/cpu-trained-draft).
DEFAULT_CHAIN = (0.53, 0.30)
DEFAULT_DRAFT_COST = 0.07
PROBE_TEXT = "Speculative decoding lets a small draft propose tokens that the target checks in one pass."


def hybrid_model_k(costs: dict[int, float], chain: tuple[float, float] = DEFAULT_CHAIN,
                   c: float = DEFAULT_DRAFT_COST) -> int | None:
    """The most tokens the model drafts per step in the hybrid, from the measured verify costs (sweep.forward_costs:
    {width: a width-token pass over a 1-token one}) and the model's cost c per drafted token (measured_draft_cost):
    1 where the model's second token, accepted with chance chain[1], does not pay for the wider pass and its own
    drafting, that is where (1 + a1) / (v2 + c) >= (1 + a1 + a2) / (v3 + 2c); else None (k).

    On the 2-core CPU with the shipped draft, v2 = 1.02-1.08 and v3 = 1.34-1.43 as measured at load: about 1.36
    against 1.20 tokens per unit of cost, so 1 (the break-even v3 is 1.22), and on the evaluation prompts at k = 8
    the hybrid measured 1.52-1.53x with the cap, 1.45x without. On a GPU a few more tokens cost about nothing
    (v2 = v3 = 1), so a cheap draft drafts up to k, while one that costs a third of a target pass still drafts one.
    Prompt lookup is never capped: its long copies cost nothing to draft and are accepted far more often.
    """
    a1, a2 = chain
    one = (1 + a1) / (costs[2] + c)
    two = (1 + a1 + a2) / (costs[3] + 2 * c)
    return 1 if one >= two else None


def describe_hybrid_cap(model_k: int | None, costs: dict, draft_cost: float | None = None) -> str:
    """How many tokens the hybrid's model drafts and the measured costs behind it (keys int or, from JSON, str)."""
    v = {int(w): float(x) for w, x in costs.items()}
    why = []
    if 2 in v and 3 in v:
        why.append(f"here a 3-token verify pass costs {v[3]:.2f}× a 1-token one, a 2-token pass {v[2]:.2f}×")
    if draft_cost is not None:
        why.append(f"a drafted token {draft_cost:.2f}×")
    why_text = f" ({', '.join(why)})" if why else ""
    return f"the draft model proposes {'1 token' if model_k == 1 else 'up to k tokens'} per step{why_text}"


def measured_draft_cost(model: Drafter, target: LoadedModel, probe: list[int], two_token_cost: float,
                        tokens: int = 9) -> float | None:
    """The model's seconds per drafted token over a 1-token target pass, from a short greedy run at k = 1 after
    `probe`: the median draft time of a step over the median time of its 2-token verify pass, scaled by that pass's
    measured cost (`two_token_cost`, forward_costs[2]). The medians skip a first call's warmup. None if the target
    stopped before anything was drafted."""
    from statistics import median

    config = GenerationConfig(max_new_tokens=tokens, num_draft_tokens=1)
    steps = [e for e in speculative(target.model, target.tokenizer, model, probe, config)
             if e.kind == "spec" and e.drafted]
    if not steps:
        return None
    one_pass = median(e.verify_seconds for e in steps) / two_token_cost
    return round(median(e.draft_seconds / len(e.drafted) for e in steps) / one_pass, 3)


# verify costs by width per target model, and draft costs per (target, draft name), measured once: they belong to the
# models on this machine, not to a run
_measured: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def measured_hybrid(model: Drafter, target: LoadedModel, draft_name: str | None = None,
                    probe: list[int] | None = None) -> HybridDrafter:
    """A hybrid whose model cap follows this machine's costs, measured after `probe` (default: PROBE_TEXT) at the
    first hybrid load of the target (a dozen short target passes) and of the draft (a 9-token run); an unnamed draft
    is measured every time, and one that could not be timed is assumed to cost DEFAULT_DRAFT_COST."""
    from .sweep import forward_costs

    probe = probe or target.tokenizer(PROBE_TEXT)["input_ids"]
    memo = _measured.setdefault(target.model, {})
    costs = memo.get("verify")
    if costs is None:
        measured = forward_costs(target.model, probe, [2, 3], repeats=3)
        costs = memo["verify"] = {w: round(v, 3) for w, v in measured.items()}
    key = ("draft", draft_name)
    if draft_name and key in memo:
        c = memo[key]
    else:
        c = measured_draft_cost(model, target, probe, costs[2])
        if draft_name:
            memo[key] = c
    chain = getattr(model, "held_out_chain", None) or DEFAULT_CHAIN
    model_k = hybrid_model_k(costs, chain, DEFAULT_DRAFT_COST if c is None else c)
    log.info("hybrid: %s", describe_hybrid_cap(model_k, costs, c))
    return HybridDrafter(model, model_k=model_k, verify_costs=costs, draft_cost=c)


def make_drafter(target: LoadedModel, kind: str, draft: str | None, device=None, dtype=None,
                 trust_remote_code: bool = False) -> tuple[Drafter, str | None]:
    """Build a drafter by name: prompt lookup, the shipped trained draft, any causal LM sharing the tokenizer, or
    "hybrid": one of those drafts with prompt lookup taking over where the context repeats."""
    if kind == "ngram":
        return NgramDrafter(), None
    if kind == "hybrid":
        model, name = make_drafter(target, "model", draft, device, dtype, trust_remote_code)
        return measured_hybrid(model, target, name), name
    if kind != "model":
        raise ValueError(f"unknown drafter '{kind}'; choose one of {DRAFTER_KINDS}")
    draft = draft or default_draft(target.name)
    if draft is None:
        raise ModelLoadError(
            f"no draft model given for target '{target.name}': pass a draft id (same tokenizer) or use prompt lookup"
        )
    if draft == TRAINED_DRAFT_ID or _is_trained_draft(Path(draft)):
        from .eagle import load_trained_draft

        path = ASSETS / TRAINED_DRAFT_ID if draft == TRAINED_DRAFT_ID else Path(draft)
        if not _is_trained_draft(path):
            raise ModelLoadError(f"the trained draft '{draft}' is not in {path}; train it with `python -m specdemo distill`")
        return load_trained_draft(path, target), draft
    loaded = load_model(draft, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    check_tokenizers(target, loaded.name, loaded.tokenizer)
    return ModelDrafter(loaded.model, target.device), draft


def load_pair(target: str, kind: str = "model", draft: str | None = None, device=None, dtype=None,
              draft_device=None, trust_remote_code: bool = False) -> Pair:
    """Load a target and its drafter (models are cached between calls)."""
    loaded = load_model(target or BUNDLED_ID, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    drafter, draft_name = make_drafter(loaded, kind, draft, draft_device or device, dtype, trust_remote_code)
    return Pair(loaded, drafter, kind, draft_name)


def warmup(pair: Pair, prompt_ids: list[int], config: GenerationConfig) -> None:
    """A few untimed steps of both decoders, so one-off allocation costs do not land on either clock."""
    short = GenerationConfig(max_new_tokens=4, num_draft_tokens=config.num_draft_tokens, sampling=config.sampling)
    for _ in autoregressive(pair.target.model, pair.target.tokenizer, prompt_ids, short):
        pass
    for _ in speculative(pair.target.model, pair.target.tokenizer, pair.drafter, prompt_ids, short):
        pass


def stream_pair(pair: Pair, prompt_ids: list[int], config: GenerationConfig) -> Iterator[tuple[str, StepEvent]]:
    """("ar", event)s until the autoregressive run ends, then ("sd", event)s: sequential, never competing."""
    tok = pair.target.tokenizer
    for event in autoregressive(pair.target.model, tok, prompt_ids, config):
        yield "ar", event
    for event in speculative(pair.target.model, tok, pair.drafter, prompt_ids, config):
        yield "sd", event


def first_mismatch(target: LoadedModel, prompt_ids: list[int], a: list[int], b: list[int]) -> dict | None:
    """Where two greedy outputs first differ, the target's top-2 logit gap there (a near-tie means numerics)."""
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return None
    with torch.inference_mode():
        x = torch.tensor([prompt_ids + a[:i]], device=target.device)
        logits = target.model(input_ids=x, logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2)
    return {"index": i, "ar_token": a[i], "sd_token": b[i], "top2_logit_gap": float(top.values[0] - top.values[1]),
            "top2_tokens": [int(t) for t in top.indices]}


def result_dict(pair: Pair, config: GenerationConfig, ar_events: list[StepEvent], sd_events: list[StepEvent],
                prompt_ids: list[int] | None = None) -> dict:
    """The CLI's `generate --json` object (the app's API returns the same keys)."""
    ar, sd = run_stats(ar_events), run_stats(sd_events)
    ar_ids, sd_ids = generated_ids(ar_events), generated_ids(sd_events)
    out = {
        "target": pair.target.name,
        "draft": pair.draft_name,
        "drafter": pair.drafter_kind,
        "k": config.num_draft_tokens,
        "dynamic_k": config.dynamic_k,
        "temperature": config.sampling.temperature,
        "top_p": config.sampling.top_p,
        "max_new_tokens": config.max_new_tokens,
        "device": str(pair.target.device),
        "dtype": str(pair.target.dtype).replace("torch.", ""),
        "ar": _run_json(ar_events, ar),
        "sd": {**_run_json(sd_events, sd), "acceptance_rate": sd.acceptance_rate, "mean_accepted": sd.mean_accepted,
               "steps": sd.steps, "drafted": sd.drafted, "accepted": sd.accepted,
               "per_position_acceptance": sd.per_position_acceptance, "accepted_histogram": sd.accepted_histogram,
               "draft_seconds": sd.draft_seconds, "verify_seconds": sd.verify_seconds},
        "speedup": speedup(ar, sd),
        "identical": ar_ids == sd_ids,
    }
    if isinstance(pair.drafter, HybridDrafter):  # the model's cap, and the measured pass costs it came from
        out["hybrid_model_k"] = pair.drafter.model_k
        out["hybrid_verify_costs"] = {str(w): v for w, v in pair.drafter.verify_costs.items()}
        out["hybrid_draft_cost"] = pair.drafter.draft_cost
    if config.sampling.greedy and ar_ids != sd_ids and prompt_ids is not None:
        out["mismatch"] = first_mismatch(pair.target, prompt_ids, ar_ids, sd_ids)
    return out


def _run_json(events: list[StepEvent], stats: RunStats) -> dict:
    return {"text": "".join(e.text for e in events), "tokens": stats.tokens, "seconds": stats.seconds,
            "tokens_per_s": stats.tokens_per_s}


def compare(pair: Pair, prompt: str, config: GenerationConfig, do_warmup: bool = True,
            on_event: Callable[[str, StepEvent], None] | None = None) -> dict:
    """Both runs on one prompt, one after the other; returns result_dict."""
    prompt_ids = encode_prompt(pair.target.tokenizer, prompt, config.use_chat_template)
    config.validate()
    if do_warmup:
        warmup(pair, prompt_ids, config)
    runs: dict[str, list[StepEvent]] = {"ar": [], "sd": []}
    for which, event in stream_pair(pair, prompt_ids, config):
        runs[which].append(event)
        if on_event:
            on_event(which, event)
    return result_dict(pair, config, runs["ar"], runs["sd"], prompt_ids)
