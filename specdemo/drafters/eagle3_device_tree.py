"""An EAGLE-3 head's greedy draft tree grown on the device: eagle3_tree's dynamic tree (EAGLE-2's expansion) in fixed
shapes, so that a step reads the device once for the whole tree instead of once a depth. Each depth feeds FRONTIER
nodes a row (the chain's, then the most probable others, chosen by a stable sort) through the head's tree level,
captured on CUDA (eagle3_static.HeadRunner.tree_level), with positions and ancestry masks built on the device; nodes
that eagle3_tree would not grow (past a row's k, after an end of sequence, rows drafting no tree) are carried as
dead. The tree is then cut on the device as eagle3_tree cuts its own (_cut: its _proposal's choice, tree_budget's
under --tree auto) and read back once, or, under a node budget, left there for the engine to verify and read with its
verdict (device_trees: that pass is the budget's width, so a cost cut, which sizes the pass, needs the first read).
Under a node budget the proposal is eagle3_tree's node for node; under --tree auto every depth feeds FRONTIER nodes
whatever the cut keeps (on a GPU a wider level costs no more). Used where the head's runner captures (DEVICE_TREES).
Knows the head drafter's state, not the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config import MAX_K_ENGINE
from .base import DeviceTrees, DraftRequest, Proposal
from .eagle3_static import StaticHeadKV
from .eagle3_tree import FRONTIER, TOP, _proposal, _Row

if TYPE_CHECKING:
    from .eagle3 import Eagle3Drafter

# greedy trees grown on the device: "capture" where the head's passes are graph-captured, "always" (the tests, on
# the CPU), "never"
DEVICE_TREES = "capture"
CHAIN_FIRST = 2.0  # added to a chain node's value when a depth's nodes to feed are chosen: values are at most 1


def grows_on_device(drafter: Eagle3Drafter, request: DraftRequest) -> bool:
    """Whether this request's trees grow on the device: greedy, over the head's static cache, where it captures (or
    DEVICE_TREES says always)."""
    kv = drafter.kv
    if DEVICE_TREES == "never" or not request.sampling.greedy or not isinstance(kv, StaticHeadKV):
        return False
    return DEVICE_TREES == "always" or kv.runner.capture


@dataclass
class _Nodes:
    """One depth's nodes, (B, C) each: token (target ids), joint value and q (float64, as eagle3_tree's Python
    floats), on the chain, dead (eagle3_tree would not have it), parent (its index in the whole tree, -1: the root),
    and which fed entry's output (`outs`, (B, W, H)) it was chosen from; ancestry (B, C, M): the tree columns of the
    fed nodes on its path."""

    tokens: torch.Tensor
    values: torch.Tensor
    q: torch.Tensor
    chain: torch.Tensor
    dead: torch.Tensor
    parents: torch.Tensor
    slot: torch.Tensor
    outs: torch.Tensor
    ancestry: torch.Tensor


def _children(drafter: Eagle3Drafter, outs: torch.Tensor, fed: _Nodes, index: torch.Tensor,
              peak_ok: bool) -> _Nodes:
    """The TOP candidates after each fed entry's output outs (B, W, H), most probable first: fed holds the fed
    nodes (B, W) and `index` their indices in the whole tree; `peak_ok` False: the first child of a chain node stays
    on the chain only if the head is confident enough (min_confidence), as eagle3_tree's _Row.add decides."""
    b, w = fed.tokens.shape
    q = torch.softmax(drafter.head.logits(outs).float(), -1)  # (B, W, S)
    top = q.topk(min(TOP, q.shape[-1]), dim=-1)
    n = top.values.shape[-1]
    p = top.values.double()  # (B, W, n)
    first = torch.zeros(n, dtype=torch.bool, device=p.device)
    first[0] = True
    sure = p[:, :, :1] >= drafter.min_confidence if not peak_ok else torch.ones_like(p[:, :, :1], dtype=torch.bool)
    flat = (b, w * n)
    return _Nodes(
        tokens=drafter.head.subset[top.indices].reshape(flat),
        values=(fed.values[:, :, None] * p).reshape(flat),
        q=p.reshape(flat),
        chain=(fed.chain[:, :, None] & first & sure).reshape(flat),
        dead=fed.dead[:, :, None].expand(b, w, n).reshape(flat),
        parents=index[:, :, None].expand(b, w, n).reshape(flat),
        slot=torch.arange(w, device=p.device)[None, :, None].expand(b, w, n).reshape(flat),
        outs=outs,
        ancestry=fed.ancestry[:, :, None, :].expand(b, w, n, fed.ancestry.shape[-1]).reshape(*flat, -1),
    )


def _gather(x: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """x (B, C, ...) at sel (B, F) along dim 1."""
    return x.gather(1, sel.view(*sel.shape, *([1] * (x.dim() - 2))).expand(*sel.shape, *x.shape[2:]))


def draft_device_trees(drafter: Eagle3Drafter, request: DraftRequest, feature: torch.Tensor) -> list[Proposal]:
    """Each row's dynamic tree after the catch-up (feature (B, H)), grown and cut on the device (_grow, _cut), read
    back once."""
    return _read(_cut(_pool(_grow(drafter, request, feature)), request))


def device_trees(drafter: Eagle3Drafter, request: DraftRequest, feature: torch.Tensor) -> DeviceTrees:
    """The same trees left on the device, for the engine to verify there and read back with its verdict. Its pass
    feeds every row the whole node budget, so only a fixed budget comes here (no cost cut: see
    Eagle3Drafter.propose_on_device)."""
    assert request.tree_costs is None, "a cost cut needs the pass sized after it: propose() serves --tree auto"
    kept = _cut(_pool(_grow(drafter, request, feature)), request)
    return DeviceTrees(kept["tokens"], kept["parents"], kept["q"], kept["values"], kept["keep"])


def _grow(drafter: Eagle3Drafter, request: DraftRequest, feature: torch.Tensor) -> list[_Nodes]:
    """Each row's dynamic tree after the catch-up (feature (B, H)), depth by depth, as eagle3_tree grows it (the
    nodes it would not grow carried as dead). Every depth writes FRONTIER entries a row into the head's cache past its
    true entries (cut at the next verdict, as a chain's drafted entries are)."""
    rows, k, device = len(request.ids), max(request.ks), feature.device
    kv = drafter.kv
    width = (k - 1) * FRONTIER  # the tree's columns in the head's cache, past each row's true entries
    capacity, start = kv.tree_columns(width)
    ks = torch.tensor(list(request.ks)).to(device, non_blocking=True)
    grow = torch.tensor([request.ks[r] > 0 and request.nodes(r) > 0 for r in range(rows)]).to(device,
                                                                                             non_blocking=True)
    first = torch.tensor(start).to(device, non_blocking=True)  # (B,): each row's true entries end here
    columns = first[:, None] + torch.arange(width, device=device)  # (B, M)
    visible = kv.visible()  # (B, capacity): the true entries
    eos = torch.tensor(sorted(request.eos_token_ids), dtype=torch.long).to(device, non_blocking=True)
    root = _Nodes(tokens=torch.zeros(rows, 1, dtype=torch.long, device=device),
                  values=torch.ones(rows, 1, dtype=torch.float64, device=device), q=None,
                  chain=torch.ones(rows, 1, dtype=torch.bool, device=device), dead=~grow[:, None], parents=None,
                  slot=None, outs=None, ancestry=torch.zeros(rows, 1, width, dtype=torch.bool, device=device))
    levels = [_children(drafter, feature[:, None], root, torch.full((rows, 1), -1, device=device), True)]
    offset = 0
    for depth in range(1, k):
        nodes = levels[-1]
        blocked = nodes.dead | torch.isin(nodes.tokens, eos) | (ks <= depth)[:, None]
        key = torch.where(blocked, float("-inf"), nodes.values + CHAIN_FIRST * nodes.chain)
        sel = key.sort(dim=1, descending=True, stable=True).indices[:, :FRONTIER]  # (B, F): the nodes to feed
        fed = _Nodes(tokens=nodes.tokens.gather(1, sel), values=nodes.values.gather(1, sel), q=None,
                     chain=nodes.chain.gather(1, sel), dead=blocked.gather(1, sel), parents=None, slot=None,
                     outs=None, ancestry=_gather(nodes.ancestry, sel).clone())
        own = (depth - 1) * FRONTIER + torch.arange(FRONTIER, device=device)
        fed.ancestry[:, torch.arange(FRONTIER, device=device), own] = True  # each entry sees itself
        mask = visible[:, None, :].expand(rows, FRONTIER, capacity).clone()
        mask.scatter_(2, columns[:, None, :].expand(rows, FRONTIER, width), fed.ancestry)
        hidden = _gather(nodes.outs, nodes.slot.gather(1, sel))  # each fed node's parent's output
        positions = (first + depth - 1)[:, None].expand(rows, FRONTIER)
        real = torch.ones(rows, FRONTIER, dtype=torch.bool)  # the host's: every row writes FRONTIER entries
        outs = drafter._pass(hidden.to(drafter.dtype), fed.tokens, real, positions, mask[:, None])  # (B, F, H)
        levels.append(_children(drafter, outs, fed, offset + sel, False))
        offset += nodes.tokens.shape[1]
    return levels


def _pool(levels: list[_Nodes]) -> dict[str, torch.Tensor]:
    """Every depth's nodes side by side, (B, C) each, in eagle3_tree's order (depth by depth, fed node by fed
    node)."""
    return {f: torch.cat([getattr(n, f) for n in levels], 1)
            for f in ("tokens", "parents", "values", "q", "chain", "dead")}


def _cut(pool: dict[str, torch.Tensor], request: DraftRequest) -> dict[str, torch.Tensor]:
    """The tree eagle3_tree's _proposal keeps (drafters.trees.branch_out), chosen on the device: the chain's nodes,
    then the others best value first (a node is worth no more than its parent, so its parent is in first), at most
    the row's node budget; under --tree auto the others only up to tree_budget's count. Returns the kept nodes (B, N)
    in _proposal's order (the chain's, then the rest as they were grown): token, parent (among the kept; -1 the
    root), value, q, and whether a row's entry holds a node."""
    dead, chain, values = pool["dead"], pool["chain"], pool["values"]
    b, c = dead.shape
    limits = torch.tensor([min(request.nodes(r), MAX_K_ENGINE) for r in range(b)]).to(values.device,
                                                                                       non_blocking=True)
    n = min(max(min(request.nodes(r), MAX_K_ENGINE) for r in range(b)), c)
    best = torch.where(dead, float("-inf"), values + CHAIN_FIRST * chain).sort(dim=1, descending=True, stable=True)
    rank = torch.arange(n, device=values.device)
    keep = (best.values[:, :n] > float("-inf")) & (rank < limits[:, None])  # (B, N), best first
    chosen = best.indices[:, :n]
    if request.tree_costs is not None:
        keep &= rank < _budget(values.gather(1, chosen), chain.gather(1, chosen) & keep, keep, request)[:, None]
    index = torch.arange(c, device=values.device)
    order = torch.where(keep, index[chosen] - c * chain.gather(1, chosen), 2 * c).sort(dim=1).indices
    kept, keep = chosen.gather(1, order), keep.gather(1, order)
    at = torch.full((b, c + 1), -1, dtype=torch.long, device=values.device)  # pool index + 1 -> its kept position
    at.scatter_(1, torch.where(keep, kept + 1, 0), torch.where(keep, torch.arange(n, device=values.device), -1))
    return dict(tokens=pool["tokens"].gather(1, kept), parents=at.gather(1, pool["parents"].gather(1, kept) + 1),
                values=values.gather(1, kept), q=pool["q"].gather(1, kept), keep=keep)


def _budget(values: torch.Tensor, chain: torch.Tensor, keep: torch.Tensor, request: DraftRequest) -> torch.Tensor:
    """drafters.trees.tree_budget on the device, for every row: how many of a row's kept nodes (values (B, N), best
    first, the chain's first) to verify, its chain's and then the others' that pay for the wider pass by
    request.tree_costs (shifted past the chain's, as branch_out shifts them), their values weighed by
    request.tree_extra_scale."""
    costs = request.tree_costs
    top = max(costs, default=0)
    table = torch.tensor([1.0] + [costs.get(n, 1.0) for n in range(1, top + 1)], dtype=torch.float64)
    table = table.to(values.device, non_blocking=True)  # (top + 1,): n nodes verified -> cost
    length = chain.sum(1)  # (B,): the chain's kept nodes
    start = 1.0 + (values * chain).sum(1)
    b, n = values.shape
    m = torch.arange(1, n + 1, device=values.device)  # extras kept
    extra = torch.where(keep & ~chain, values * request.tree_extra_scale, 0.0)
    # the extras, best first, after the chain: shift each row's so that its first extra is column 0
    shift = (length[:, None] + m[None, :] - 1).clamp(max=n - 1)
    gains = torch.cat([start[:, None], extra.gather(1, shift)], 1).cumsum(1)[:, 1:]  # (B, N): tokens with m extras
    width = length[:, None] + m[None, :]
    fits = (width <= top) & (length[:, None] + m[None, :] - 1 < n) & keep.gather(1, shift)
    cost = table[width.clamp(max=top)] / table[length.clamp(max=top)][:, None]
    ratio = torch.where(fits, gains / cost, float("-inf"))
    paying = torch.cat([start[:, None], ratio], 1).argmax(1)  # the first best: 0 keeps the chain alone
    return length + paying


def _read(kept: dict[str, torch.Tensor]) -> list[Proposal]:
    """The kept trees in one read, as proposals."""
    fields = torch.stack([kept[f].double() for f in ("tokens", "parents", "values", "q", "keep")], -1)
    out = []
    for row in fields.tolist():  # the step's one read of the tree
        row = [x for x in row if x[4]]
        out.append(Proposal([int(x[0]) for x in row], token_probs=[x[3] for x in row],
                            parents=[int(x[1]) for x in row], values=[x[2] for x in row]) if row else Proposal([]))
    return out


def host_cut(pool: dict[str, torch.Tensor], request: DraftRequest) -> list[Proposal]:
    """The same tree (_pool's) read whole and cut on the host by eagle3_tree's _proposal: what _cut must equal (the
    tests)."""
    read = torch.stack([pool[f].double() for f in ("tokens", "parents", "values", "q", "chain", "dead")], -1).tolist()
    out = []
    for r, row in enumerate(read):
        tree, at = _Row(), {}
        for i, (token, parent, value, q, chain, dead) in enumerate(row):
            if dead:
                continue
            at[i] = len(tree.tokens)
            if chain:
                tree.chain.append(at[i])
            tree.tokens.append(int(token))
            tree.parents.append(at[int(parent)] if parent >= 0 else -1)
            tree.values.append(value)
            tree.q.append(q)
        out.append(_proposal(tree, request.nodes(r), request.tree_costs, request.tree_extra_scale))
    return out
