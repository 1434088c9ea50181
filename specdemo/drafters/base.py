"""The drafter seam, batch-shaped: `begin` a batch, `propose` up to k tokens per row, `update` from the target's
verdicts, `select` the rows still decoding (`warm`, before the clock: a graph runner's captures). Batch size 1 is the
ordinary case. What a drafter keeps across requests lives in a SharedState its caller owns; `paused` and `forget` are
all a caller needs of it.

Drafters know token ids and their own state (a KV cache, an n-gram index); they never see text, the UI or how the
target verifies. Imports nothing of the engine, so the engine can import this seam.
"""

from __future__ import annotations

import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # no torch at import: the registry, which imports this package, lists kinds without it
    import torch

    from ..config import SamplingConfig


@dataclass
class DraftRequest:
    """What a drafter is asked, for each row r: continue ids[r] (prompt + generated; the last token is not yet in the
    target's cache) with at most ks[r] tokens (0: nothing this step), sampling from generators[r].

    tree_nodes[r] > 0 lets a drafter that drafts trees propose one of up to that many nodes, none deeper than ks[r]
    (empty or 0: a chain, as every drafter proposes by default). tree_costs (--tree auto): cut each tree where its
    nodes stop paying for the wider step, by these costs ({n: a step verifying n drafted tokens over a 1-token pass},
    the engine's: the target's pass costs timed at load, corrected by the run's own steps, engine.timing.StepCosts);
    None: no cut. tree_extra_scale: what the nodes beyond the chain have given, over what the drafter valued them at
    (Proposal.values), in its recent trees (StepCosts.extra_scale); a cut weighs those nodes' values by it."""

    ids: Sequence[list[int]]
    ks: Sequence[int]
    sampling: SamplingConfig
    generators: Sequence[torch.Generator | None]
    eos_token_ids: frozenset[int] = frozenset()
    tree_nodes: Sequence[int] = ()
    tree_costs: dict[int, float] | None = None
    tree_extra_scale: float = 1.0

    def row(self, r: int, k: int | None = None) -> DraftRequest:
        """Row r alone (with another k when given), for drafters that work row by row."""
        return DraftRequest([self.ids[r]], [self.ks[r] if k is None else k], self.sampling, [self.generators[r]],
                            self.eos_token_ids, self.tree_nodes[r : r + 1], self.tree_costs,
                            self.tree_extra_scale)

    def nodes(self, r: int) -> int:
        """Row r's node budget for a tree (0: a chain)."""
        return self.tree_nodes[r] if r < len(self.tree_nodes) else 0


@dataclass
class Proposal:
    """One row's drafted tokens (n,) and their draft distributions q (n, V); probs None means a deterministic drafter.

    parents: None for a chain; for a tree, each node's parent node (-1: the pending token), a parent before its
    children (engine.tree.TokenTree), and then row j of probs is the law node j was drawn from given the nodes before
    it (tree_accept's exactness condition).

    token_probs: q(x_i), the draft's probability of each drafted token under its own processed distribution (greedy
    drafters fill it too: the softmax of their logits at the token); None for a deterministic drafter (q = 1). Only
    the step inspector reads it; acceptance uses `probs`. source: where the tokens came from ("lookup", "model", ...),
    for the inspector; None when the drafter has one source. values: a tree's nodes' estimated chances of acceptance,
    as the drafter valued them when it sized the tree (None: not given); the engine compares them with what the nodes
    gave (StepCosts.extra_scale).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    token_probs: list[float] | None = None
    source: str | None = None
    parents: list[int] | None = None
    values: list[float] | None = None


@dataclass
class DeviceChains:
    """Chains left on the device (Drafter.propose_on_device): tokens (B, k) as target ids, q (B, k) each token's
    draft probability, lengths (B,) how many of each row's tokens it proposes (a row's tokens past its length are
    padding, never accepted), and when sampled, probs (B, k, V) the draft distributions they were drawn from, over the
    target's vocabulary (what rejection sampling needs; None: every row deterministic). Nothing of them has been read
    back to the host. held: per row, the Proposal where the host drafted the row itself (a hybrid's lookup: the
    engine reports it as it is), None where the row was drafted on the device (reported with `source`)."""

    tokens: torch.Tensor
    q: torch.Tensor
    lengths: torch.Tensor
    probs: torch.Tensor | None = None
    held: list[Proposal | None] | None = None
    source: str | None = None

    @classmethod
    def cut(cls, tokens: torch.Tensor, q: torch.Tensor, request: DraftRequest,
            sure: torch.Tensor | None = None, probs: torch.Tensor | None = None) -> DeviceChains:
        """Chains of max(ks) tokens per row, each row's length worked out on the device as Chains.add stops a row:
        at its own k, after an end of sequence, and (with `sure`, (B, k) bool) before its first unsure token. Few
        kernels (each is a launch between a step's graphs): the per-row k only where rows differ in it, the end of
        sequence ids moved to the device once."""
        from ..models.placement import to_device

        k, device = tokens.shape[1], tokens.device
        ks = to_device(list(request.ks), device) if min(request.ks) < k else None
        return cls(tokens, q, chain_lengths(tokens, sure, ks, eos_on(request.eos_token_ids, device)), probs)


def chain_lengths(tokens: torch.Tensor, sure: torch.Tensor | None, ks: torch.Tensor | None,
                  eos: torch.Tensor | None) -> torch.Tensor:
    """Each row's proposed length (B,) for chains tokens (B, k), on the device, as Chains.add stops a row: at its own
    k (ks (B,); None: every row at k), after an end of sequence (eos: the ids; None: none), before its first unsure
    token (sure (B, k) bool; None: every token sure). Straight-line tensor code (a captured chain computes it too)."""
    import torch

    kept = torch.ones_like(tokens, dtype=torch.bool) if sure is None else sure
    if ks is not None:
        kept = kept & (torch.arange(tokens.shape[1], device=tokens.device)[None, :] < ks[:, None])
    if eos is not None:
        ended = at_eos(tokens, eos)
        kept = kept & (ended.cumsum(1) == ended)  # nothing after an end of sequence
    return kept.cumprod(1).sum(1)


def at_eos(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """Where `tokens` are among the end of sequence ids `eos` (eos_on's): a comparison with each, not torch.isin,
    which may sort and synchronise with the host (and then fails under capture)."""
    return (tokens[..., None] == eos).any(-1)


@functools.cache
def eos_on(ids: frozenset[int], device) -> torch.Tensor | None:
    """End of sequence ids as a device tensor, made once per set and device, so that a captured graph may read it
    (chain_lengths' eos); None for none."""
    from ..models.placement import to_device

    return to_device(sorted(ids), device) if ids else None


FIELDS = ("tokens", "parents", "q", "values", "keep")  # what a device tree's step reads back of each node


@dataclass
class DeviceTrees:
    """Greedy draft trees left on the device (Drafter.propose_on_device), (B, N) each: tokens as target ids, parents
    (-1: the pending token; a parent before its children), q of each token, its value (Proposal.values), and keep:
    which entries hold a node (each row's nodes first, padding after). Nothing of them has been read back. Where the
    drafter has them already: `batch`, their layout for the target's pass (engine.tree.TreeBatch, as
    device_tree_batch builds it), and `fields` (B, N, 5), FIELDS' as float64 (what the step reads back)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    q: torch.Tensor
    values: torch.Tensor
    keep: torch.Tensor
    batch: Any = None
    fields: torch.Tensor | None = None


@dataclass
class Verdict:
    """The target's answer to one row's proposal: how many drafts it kept (for a tree: the nodes on the accepted
    path) and the sequence now committed."""

    num_accepted: int
    ids: list[int]  # committed sequence, ending with the target's correction or bonus token
    target_hidden: torch.Tensor | None = None  # (num_accepted + 1, W) target features, for drafters that read them
    path: list[int] | None = None  # a tree's accepted nodes, root to leaf (None: a chain's first num_accepted)


class Chains:
    """Each row's draft chain as a drafter grows it one token per pass (a draft LM, an EAGLE-3 head): the tokens, the
    q rows (sampling only), q of each token, and which rows still draft (a row stops at its k or at end of sequence).
    """

    def __init__(self, request: DraftRequest):
        rows = len(request.ids)
        self.ks, self.eos = request.ks, request.eos_token_ids
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.probs: list[list[torch.Tensor]] = [[] for _ in range(rows)]
        self.q_tokens: list[list[float]] = [[] for _ in range(rows)]
        self.active = [k > 0 for k in request.ks]

    def add(self, r: int, token: int, q: torch.Tensor | None = None) -> None:
        """Row r drafts `token` (q: its full draft distribution when sampling)."""
        self.tokens[r].append(token)
        if q is not None:
            self.probs[r].append(q)
        self.active[r] = token not in self.eos and len(self.tokens[r]) < self.ks[r]

    def proposals(self) -> list[Proposal]:
        import torch

        return [Proposal(t, torch.stack(p) if p else None, qt) for t, p, qt in zip(self.tokens, self.probs,
                                                                                   self.q_tokens)]


class Drafter(ABC):
    """Proposes tokens for the target to verify, for every row of a batch."""

    name: str = "drafter"
    needs_target_hidden: bool = False  # if True, the engine passes the target's last hidden states
    target_layers: tuple[int, ...] = ()  # and, after them, these decoder layers' hidden states
    drafts_trees: bool = False  # whether it proposes a tree when a request allows one (DraftRequest.tree_nodes)
    greedy_trees_only: bool = False  # whether it drafts trees only when greedy (chains when sampling)
    pass_costs: dict[int, float] | None = None  # {n: an (n+1)-token target pass over a 1-token one}, timed on the
    # target at load, for drafters that size their drafts by them (--tree auto, cost-aware suffix decoding)

    @abstractmethod
    def begin(self, prompts: Sequence[list[int]], target_hidden: Sequence[torch.Tensor] | None = None) -> None:
        """Start a batch (drops all state); target_hidden[r] is (len(prompts[r]), W) for drafters that read it."""

    def warm(self, prompts: Sequence[list[int]], request: DraftRequest | None = None) -> None:
        """Before a decode of these prompts is timed (begin comes next): capture the passes its proposals will run,
        where a graph runner serves the drafter's model; `request`: what the decode's first step will ask (its k,
        tree budget and cut), for passes shaped by it. Nothing for most drafters."""

    @abstractmethod
    def propose(self, request: DraftRequest) -> list[Proposal]:
        """Up to request.ks[r] tokens continuing request.ids[r] for each row (fewer, or none, is allowed)."""

    def propose_on_device(self, request: DraftRequest) -> DeviceChains | DeviceTrees | None:
        """Chains (or, greedy where the request allows trees, trees) for the request left on the device, for an
        engine that verifies them there and reads them back once with the target's verdict (one host synchronisation
        per step; the engine asks under a graph-captured target, greedy or sampling under either verification
        rule). Sampled chains carry their draft distributions (DeviceChains.probs). None: propose() serves
        the request, as for most drafters."""
        return None

    def update(self, verdicts: Sequence[Verdict]) -> None:
        """Learn from each row's verdict, e.g. roll a KV cache back to the accepted prefix."""

    def select(self, rows: Sequence[int]) -> None:
        """Keep only these rows, in this order (finished rows leave the batch)."""

    def paused(self) -> AbstractContextManager[None]:
        """A context inside which requests leave nothing in what the drafter keeps across requests (untimed warm-ups,
        a second run of one prompt, a sweep over k or batch size). Nothing to pause for most drafters."""
        return nullcontext()

    def forget(self) -> None:
        """Drop what it keeps across requests (a cold start). Nothing for most drafters."""

    def settings(self) -> dict[str, dict]:
        """The options it drafts under, by section, as results and reports record them ({"suffix": {...}} for suffix
        decoding); {} for a drafter whose kind takes none."""
        return {}


class Calibration(Protocol):
    """What a kind measured on this machine when it was built (the hybrid's cap and the costs behind it): the keys a
    result and bench.json carry, and the same in words."""

    def as_dict(self) -> dict: ...

    def describe(self) -> str: ...


class SharedState:
    """What drafters keep across requests, owned by whoever serves them (the CLI and the bench: one per process; the
    app: one per browser session) and handed to every drafter it builds (registry.BuildOptions.shared): each kind's
    own object by name (suffix decoding's cache of earlier answers), made by that kind at its first use. Thread-safe.
    """

    def __init__(self):
        self._states: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self, name: str, make: Callable[[], Any]) -> Any:
        """Kind `name`'s state, made by make() at its first use."""
        with self._lock:
            if name not in self._states:
                self._states[name] = make()
            return self._states[name]

    def names(self) -> tuple[str, ...]:
        """The kinds that keep state here."""
        with self._lock:
            return tuple(self._states)

    def find(self, name: str) -> Any:
        """Kind `name`'s state, or None when it has made none."""
        with self._lock:
            return self._states.get(name)

    def __len__(self) -> int:
        """What the states hold, summed (a state with a len(): suffix decoding's earlier answers)."""
        with self._lock:
            states = list(self._states.values())
        return sum(len(s) for s in states if hasattr(s, "__len__"))


def cut_at_eos(tokens: list[int], eos: frozenset[int]) -> list[int]:
    """tokens up to and including the first end-of-sequence token."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens
