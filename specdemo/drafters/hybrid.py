"""The hybrid drafter: prompt lookup where a row's context repeats, a draft (model or EAGLE-3 head) elsewhere, and
its calibration: how many tokens the draft may propose per step on this machine.

The cap comes from verify-pass costs and the draft's own cost timed at load (Leviathan et al.'s expected tokens per
unit of cost); the figures behind it travel as a HybridCalibration for reports. The draft is timed in a short run of
the engine's speculative loop, which its builder passes in (drafters never import the decoding loop).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from statistics import median

import torch

from ..config import MAX_K_ENGINE, GenerationConfig
from ..engine.timing import PROBE_TEXT, forward_costs
from ..engine.verify import draft_rows_batch, one_hot_rows
from ..models.placement import to_device
from .base import DeviceChains, Drafter, DraftRequest, Proposal, Verdict
from .ngram import NgramDrafter
from .trees import best_subtree, lookup_tree, lookup_values, shifted_costs

log = logging.getLogger(__name__)

Speculative = Callable[..., Iterator]  # engine.speculative: (target model, tokenizer, drafter, ids, config) -> events


class HybridDrafter(Drafter):
    """Prompt lookup where a row's context repeats, the draft everywhere else.

    A suffix match of at least `min_match` tokens is strong evidence (copying from the prompt, a list, code); there
    the lookup's copy costs nothing to draft, and it proposes up to k tokens. The lookup half is prompt lookup, or
    another model-free drafter given as `lookup` (suffix decoding, asked for matches of min_match tokens or more).
    Elsewhere the draft proposes at most `model_k` tokens (None: k; calibrate chooses it from this machine's measured
    costs). The choice depends only on the committed context, so each step still has one well-defined proposal
    distribution and rejection sampling stays exact. The draft follows along when skipped: a row that looked up is
    asked for nothing that step, and catches up at its next proposal (ModelDrafter from the ids, Eagle3Drafter from the
    target features it kept pending).

    Where a request allows trees, the lookup half proposes its tree, and the draft's chain gets prompt lookup's
    branches of shorter matches beside it (one-hot nodes after the chain, valued by their share of the matches times
    the chance the chain's first token fails, cut by pass costs under --tree auto; the chain itself is never cut).
    """

    name = "hybrid"

    def __init__(self, model: Drafter, min_match: int = 3, model_k: int | None = None, lookup: Drafter | None = None,
                 pass_costs: dict[int, float] | None = None):
        self.model = model
        self.model_k = model_k
        # a match of min_match tokens or more proposes up to k tokens; a shorter one proposes nothing
        self.lookup = lookup or NgramDrafter(min_ngram=min_match, full_ngram=min_match)
        self.branches = NgramDrafter()  # the branches of any match beside the draft's chain, in a tree
        self.needs_target_hidden = model.needs_target_hidden
        self.target_layers = model.target_layers
        self.drafts_trees = self.lookup.drafts_trees
        self.pass_costs = pass_costs
        if self.lookup.pass_costs is None:
            self.lookup.pass_costs = pass_costs
        self._chains: list[list[int]] = []  # per row: the draft's chain inside this step's tree (its cache holds it)
        self._starts: list[int] = []  # per row: the length of the ids it was asked to continue

    @contextmanager
    def paused(self) -> Iterator[None]:
        with self.model.paused(), self.lookup.paused():
            yield

    def forget(self) -> None:
        self.model.forget()
        self.lookup.forget()

    def settings(self) -> dict[str, dict]:
        """Its halves' settings; a suffix half's section says it is the hybrid's lookup (prompt lookup records none)."""
        out = {**self.model.settings(), **self.lookup.settings()}
        if "suffix" in out:
            out["suffix"] = {**out["suffix"], "hybrid_lookup": "suffix"}
        return out

    def begin(self, prompts, target_hidden=None) -> None:
        self.model.begin(prompts, target_hidden)

    def warm(self, prompts, request=None) -> None:
        self.model.warm(prompts, request)
        self.lookup.begin(prompts)

    def _looked_up(self, request: DraftRequest) -> tuple[list[Proposal], DraftRequest]:
        """The lookup's proposals (source "lookup" unless it names its own) and what the draft is asked for: nothing
        where the lookup proposed, up to the cap elsewhere. Each row's model verdict is cut at its start where the
        lookup served it (update)."""
        looked = self.lookup.propose(request)
        cap = self.model_k if self.model_k is not None else MAX_K_ENGINE
        model_ks = [0 if p.tokens else min(k, cap) for p, k in zip(looked, request.ks)]
        for p in looked:
            p.source = p.source or "lookup"
        self._chains = [[] if p.tokens else None for p in looked]
        self._starts = [len(ids) for ids in request.ids]
        return looked, DraftRequest(request.ids, model_ks, request.sampling, request.generators,
                                    request.eos_token_ids)

    def propose(self, request: DraftRequest) -> list[Proposal]:
        looked, model_request = self._looked_up(request)
        modeled = self.model.propose(model_request)
        for m in modeled:
            m.source = "model"
        return [p if p.tokens else self._with_branches(m, request, r) if request.nodes(r) > len(m.tokens) > 0
                else m for r, (p, m) in enumerate(zip(looked, modeled))]

    def propose_on_device(self, request: DraftRequest) -> DeviceChains | None:
        """Chains: the lookup's rows as the host drafted them (held_chains), the draft's chains elsewhere
        (chains_where), left on the device where the draft leaves them there (else its proposals as drafted), for
        the engine to verify and read back once. None where a request allows trees (the branches beside the draft's
        chain are valued by its q, read on the host: propose)."""
        if any(request.nodes(r) for r in range(len(request.ids))):
            return None
        looked, model_request = self._looked_up(request)
        if max(model_request.ks, default=0) <= 0:  # the host holds every row (the engine moves them)
            return held_chains([p if p.tokens else Proposal([], source="model") for p in looked])
        modeled = self.model.propose_on_device(model_request)
        if modeled is None:  # the draft drafts on the host here
            modeled = held_chains([replace(m, source="model") for m in self.model.propose(model_request)])
        modeled.source = "model"
        return chains_where([bool(p.tokens) for p in looked], held_chains(looked, modeled.tokens.device), modeled)

    def _with_branches(self, chain: Proposal, request: DraftRequest, r: int) -> Proposal:
        """Row r's tree: the draft's chain, then prompt lookup's branches as further children of the pending token
        (one-hot q rows; each node's existence depends only on nodes before it, so tree_accept stays exact)."""
        n, ids = len(chain.tokens), request.ids[r]
        tree, support = lookup_tree(self.branches, ids, request.ks[r], self.branches.branches, request.eos_token_ids)
        if not len(tree):
            return chain
        reach = [1.0]  # the chain's chance of acceptance at each depth, by the draft's own q
        for q in chain.token_probs or [1.0] * n:
            reach.append(reach[-1] * q)
        values = [v * (1.0 - reach[1]) for v in lookup_values(tree, support)]
        costs = shifted_costs(request.tree_costs, n) if request.tree_costs else None
        tree, kept = best_subtree(tree, values, costs, request.nodes(r) - n, start=sum(reach),
                                  scale=request.tree_extra_scale)
        if not len(tree):
            return chain
        self._chains[r] = chain.tokens
        probs = chain.probs
        if probs is not None:
            onehot = torch.zeros(len(tree), probs.shape[1], dtype=probs.dtype, device=probs.device)
            onehot[torch.arange(len(tree)), torch.tensor(tree.tokens)] = 1.0
            probs = torch.cat([probs, onehot])
        return Proposal(chain.tokens + list(tree.tokens), probs,
                        None if chain.token_probs is None else chain.token_probs + [1.0] * len(tree), "model",
                        list(range(-1, n - 1)) + [a + n if a >= 0 else -1 for a in tree.parents],
                        values=reach[1:] + [values[j] for j in kept])

    def update(self, verdicts) -> None:
        model = list(verdicts)
        for r, chain in enumerate(self._chains):
            # the draft's cache holds `chain` past the row's start (a tree's: its chain; a looked-up row's: nothing
            # of what was committed, though a draft that drafts every row on the device fed its own tokens there): it
            # keeps what the committed tokens share with it
            if chain is not None:
                v, start = verdicts[r], self._starts[r]
                new = v.ids[start:]
                same = next((i for i, (a, b) in enumerate(zip(chain, new)) if a != b), min(len(chain), len(new)))
                model[r] = Verdict(v.num_accepted, v.ids[: start + same + 1], v.target_hidden, v.path)
        self._chains = []
        self.model.update(model)
        self.lookup.update(verdicts)

    def select(self, rows) -> None:
        self.model.select(rows)
        self.lookup.select(rows)
        self._chains = []


def held_chains(proposals: list[Proposal], device: torch.device | None = None) -> DeviceChains:
    """Chains the host drafted, as DeviceChains on `device` (None: where their q rows are, else the CPU), each held
    (tokens padded to the longest, q 1 where a proposal gives none); where any proposal has q rows, probs as
    verify.draft_rows_batch makes them (one-hot at a deterministic one's tokens)."""
    qs = [p.probs for p in proposals]
    like = next((q for q in qs if q is not None), None)
    device = device or (like.device if like is not None else torch.device("cpu"))
    rows, width = len(proposals), max((len(p.tokens) for p in proposals), default=0)
    pad = [width - len(p.tokens) for p in proposals]
    tokens = to_device([list(p.tokens) + [0] * n for p, n in zip(proposals, pad)], device, torch.long).view(rows, width)
    q = to_device([list(p.token_probs if p.token_probs is not None else [1.0] * len(p.tokens)) + [1.0] * n
                   for p, n in zip(proposals, pad)], device, torch.float64).view(rows, width)
    lengths = to_device([len(p.tokens) for p in proposals], device, torch.long)
    probs = None if like is None else draft_rows_batch(tokens, qs, like.to(device))
    return DeviceChains(tokens, q, lengths, probs, list(proposals))


def chains_where(rows: list[bool], a: DeviceChains, b: DeviceChains) -> DeviceChains:
    """a's chains in the rows marked True, b's elsewhere (both on one device; the narrower padded), each row held as
    its side holds it."""
    width = max(a.tokens.shape[1], b.tokens.shape[1])
    use = to_device(rows, a.tokens.device)

    def pick(x: torch.Tensor, y: torch.Tensor, fill=0) -> torch.Tensor:
        x, y = (torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1]), value=fill)
                for t in (x, y))
        return torch.where(use.view(-1, *[1] * (x.dim() - 1)), x, y)

    probs = None
    if a.probs is not None or b.probs is not None:
        vocab = (a.probs if a.probs is not None else b.probs).shape[-1]
        probs = pick(*(c.probs if c.probs is not None else one_hot_rows(c.tokens, vocab) for c in (a, b)))
    held = [x if u else y for u, x, y in zip(rows, a.held or [None] * len(rows), b.held or [None] * len(rows))]
    return DeviceChains(pick(a.tokens, b.tokens), pick(a.q, b.q, 1.0), torch.where(use, a.lengths, b.lengths), probs,
                        held, b.source or a.source)


# What hybrid_model_k assumes of a draft that carries no held-out figures of its own: the chance that its first and
# its first two drafted tokens are accepted (the held-out chain of an earlier trained draft,
# docs/notes/hybrid-cap.md), and its cost per drafted token over a 1-token target pass where none was measured (a
# trained draft's, as the benchmark measures it).
DEFAULT_CHAIN = (0.53, 0.30)
DEFAULT_DRAFT_COST = 0.07


@dataclass(frozen=True)
class HybridCalibration:
    """The hybrid's model cap and the measured costs it came from (for the JSON result, the app and the report)."""

    model_k: int | None  # None: the model drafts up to k
    verify_costs: dict[int, float]  # {width: a width-token target pass over a 1-token one}
    draft_cost: float | None  # the model's seconds per drafted token over a 1-token target pass; None: not timed

    def describe(self) -> str:
        return describe_hybrid_cap(self.model_k, self.verify_costs, self.draft_cost)

    def as_dict(self) -> dict:
        """The keys result_dict and bench.json carry, the cap in words among them (what the app and bench.md show)."""
        return {"hybrid_model_k": self.model_k,
                "hybrid_verify_costs": {str(w): v for w, v in self.verify_costs.items()},
                "hybrid_draft_cost": self.draft_cost, "hybrid_cap": self.describe()}


def hybrid_model_k(costs: dict[int, float], chain: tuple[float, float] = DEFAULT_CHAIN,
                   c: float = DEFAULT_DRAFT_COST) -> int | None:
    """The most tokens the model drafts per step in the hybrid, from the measured verify costs (timing.forward_costs:
    {width: a width-token pass over a 1-token one}) and the model's cost c per drafted token (measured_draft_cost):
    1 where the model's second token, accepted with chance chain[1], does not pay for the wider pass and its own
    drafting, that is where (1 + a1) / (v2 + c) >= (1 + a1 + a2) / (v3 + 2c); else None (k).

    On a small CPU, where a 3-token pass costs clearly more than a 2-token one, this usually chooses 1 for a trained
    draft (docs/notes/hybrid-cap.md has a measured case). On a GPU a few more tokens cost about nothing (v2 = v3 = 1),
    so a cheap draft drafts up to k, while one that costs a third of a target pass still drafts one.
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


def measured_draft_cost(model: Drafter, target, probe: list[int], two_token_cost: float, speculative: Speculative,
                        tokens: int = 9) -> float | None:
    """The model's seconds per drafted token over a 1-token target pass, from a short greedy run of `speculative`
    (engine.speculative) at k = 1 after `probe`: the median draft time of a step over the median time of its 2-token
    verify pass, scaled by that pass's measured cost (`two_token_cost`, forward_costs[2]). The medians skip a first
    call's warmup. None if the target stopped before anything was drafted. `target` is a loading.LoadedModel."""
    config = GenerationConfig(max_new_tokens=tokens, num_draft_tokens=1)
    steps = [e for e in speculative(target.model, target.tokenizer, model, probe, config, inspect=False)
             if e.kind == "spec" and e.drafted]
    if not steps:
        return None
    one_pass = median(e.verify_seconds for e in steps) / two_token_cost
    return round(median(e.draft_seconds / len(e.drafted) for e in steps) / one_pass, 3)


# verify costs by width per target model, and draft costs per (target, draft name), measured once: they belong to the
# models on this machine, not to a run
_measured: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def calibrate(model: Drafter, target, speculative: Speculative, draft_name: str | None = None,
              probe: list[int] | None = None) -> HybridCalibration:
    """Time the target's 2- and 3-token passes (a dozen short passes, at its first hybrid load) and the draft's cost
    (a 9-token run of `speculative` after `probe`, default PROBE_TEXT) and choose the cap. An unnamed draft is
    measured every time; one that could not be timed is assumed to cost DEFAULT_DRAFT_COST."""
    probe = probe or target.tokenizer(PROBE_TEXT)["input_ids"]
    memo = _measured.setdefault(target.model, {})
    costs = memo.get("verify")
    if costs is None:
        measured = forward_costs(target.model, [probe], [2, 3], repeats=3)
        costs = memo["verify"] = {w: round(v, 3) for w, v in measured.items()}
    key = ("draft", draft_name)
    if draft_name and key in memo:
        c = memo[key]
    else:
        c = measured_draft_cost(model, target, probe, costs[2], speculative)
        if draft_name:
            memo[key] = c
    chain = getattr(model, "held_out_chain", None) or DEFAULT_CHAIN
    calibration = HybridCalibration(hybrid_model_k(costs, chain, DEFAULT_DRAFT_COST if c is None else c), costs, c)
    log.info("hybrid: %s", calibration.describe())
    return calibration


def calibrated_hybrid(model: Drafter, target, speculative: Speculative, draft_name: str | None = None,
                      probe: list[int] | None = None, lookup: Drafter | None = None,
                      pass_costs: dict[int, float] | None = None) -> tuple[HybridDrafter, HybridCalibration]:
    """A hybrid over `model` (and `lookup`, default prompt lookup) whose cap follows this machine's costs (the draft
    timed in a short run of `speculative`, engine.speculative), and the calibration behind it; `pass_costs` size its
    trees (--tree auto)."""
    calibration = calibrate(model, target, speculative, draft_name, probe)
    return HybridDrafter(model, model_k=calibration.model_k, lookup=lookup, pass_costs=pass_costs), calibration
