"""An EAGLE-3 head's greedy draft tree grown on the device: eagle3_tree's dynamic tree (EAGLE-2's expansion) in fixed
shapes, with no host read or copy while it grows, so that the whole growth is one CUDA graph per batch size and k
where the head's runner captures (eagle3_static.HeadRunner.tree, captured in the warm-up) and a step reads the device
once for the tree instead of once a depth. Each depth feeds FRONTIER nodes a row (the chain's, then the most probable
others, chosen by a stable sort) through the head's static storage, with positions and ancestry masks built on the
device; nodes that eagle3_tree would not grow (past a row's k, after an end of sequence, rows drafting no tree) are
carried as dead. In the same graph the tree is cut as eagle3_tree cuts its own (_cut: its _proposal's choice,
tree_budget's under --tree auto, by costs the graph reads from a static input) and laid out for the target's pass
(engine.tree.device_tree_batch); it is read back once, or left there for the engine to verify and read with its
verdict (device_trees: that pass is the budget's width; under --tree auto the engine sizes the budget by the trees it
last read, loop.auto_width). Under a node budget the proposal is eagle3_tree's node for node; under --tree auto
every depth feeds FRONTIER nodes whatever the cut keeps (on a GPU a wider level costs no more). Used where the head's
runner captures (DEVICE_TREES). Knows the head drafter's state, not the engine's loop.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..config import MAX_K_ENGINE
from ..engine.graphs import rungs
from ..engine.static import CAPTURED
from ..engine.tree import TreeBatch, device_tree_batch
from ..models.placement import to_device
from .base import FIELDS, DeviceTrees, DraftRequest, Proposal, at_eos, eos_on
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


def _children(head, min_confidence: float, outs: torch.Tensor, fed: _Nodes, index: torch.Tensor,
              peak_ok: bool) -> _Nodes:
    """The TOP candidates after each fed entry's output outs (B, W, H), most probable first: fed holds the fed
    nodes (B, W) and `index` their indices in the whole tree; `peak_ok` False: the first child of a chain node stays
    on the chain only if the head is confident enough (min_confidence), as eagle3_tree's _Row.add decides."""
    b, w = fed.tokens.shape
    q = torch.softmax(head.logits(outs).float(), -1)  # (B, W, S)
    top = q.topk(min(TOP, q.shape[-1]), dim=-1)
    n = top.values.shape[-1]
    p = top.values.double()  # (B, W, n)
    first = torch.zeros(n, dtype=torch.bool, device=p.device)
    first[0] = True
    sure = p[:, :, :1] >= min_confidence if not peak_ok else torch.ones_like(p[:, :, :1], dtype=torch.bool)
    flat = (b, w * n)
    return _Nodes(
        tokens=head.subset[top.indices].reshape(flat),
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


COST_SLOTS = MAX_K_ENGINE + 1  # the cut's cost table: n nodes verified -> that pass's cost, n = 0..MAX_K_ENGINE
SHARED = ("eos", "cut")  # TreeInputs' fields that are not per row


@dataclass
class TreeInputs:
    """What a tree's growth and cut read, on the device: the catch-up's output (B, H); each row's k, whether it grows
    a tree and its node budget (`per_row`, (B, 3)); the end-of-sequence ids (E,); and the cut's (`cut`,
    (COST_SLOTS + 3,) float64): --tree auto's cost table (cut_inputs), the widest pass it costs, the branches' extra
    scale, and whether to cut by cost at all. A captured growth reads them from static copies
    (eagle3_static.HeadRunner.tree), so that the costs a run learns change no graph."""

    feature: torch.Tensor
    per_row: torch.Tensor
    eos: torch.Tensor
    cut: torch.Tensor

    @property
    def ks(self) -> torch.Tensor:
        return self.per_row[:, 0]

    @property
    def grow(self) -> torch.Tensor:
        return self.per_row[:, 1] > 0

    @property
    def limits(self) -> torch.Tensor:
        return self.per_row[:, 2]

    def blank(self, rows: int) -> TreeInputs:
        """Zeroed inputs of the same kinds for `rows` rows (the static copies a captured growth reads)."""
        return TreeInputs(*(torch.zeros(x.shape if name in SHARED else (rows, *x.shape[1:]), dtype=x.dtype,
                                        device=x.device) for name, x in vars(self).items()))

    def load(self, inputs: TreeInputs) -> None:
        """Hold `inputs` (as many rows or fewer: the rest get k 0, no tree, no budget), copied without waiting."""
        b = inputs.per_row.shape[0]
        for name, x in vars(inputs).items():
            mine = getattr(self, name)
            if name in SHARED:
                mine.copy_(x, non_blocking=True)
            else:
                mine[b:].zero_()
                mine[:b].copy_(x, non_blocking=True)


def tree_inputs(request: DraftRequest, feature: torch.Tensor) -> TreeInputs:
    """The request's TreeInputs, copied to the feature's device without waiting (the end-of-sequence ids once)."""
    device = feature.device
    per_row = [[k, int(k > 0 and request.nodes(r) > 0), limit]
               for r, (k, limit) in enumerate(zip(request.ks, _limits(request)))]
    return TreeInputs(
        feature=feature,
        per_row=to_device(per_row, device, torch.long),
        eos=eos_on(request.eos_token_ids, device) if request.eos_token_ids else torch.zeros(0, dtype=torch.long,
                                                                                             device=device),
        cut=to_device(cut_inputs(request.tree_costs, request.tree_extra_scale), device, torch.float64))


def cut_inputs(costs: dict[int, float] | None, scale: float = 1.0) -> list[float]:
    """TreeInputs.cut for --tree auto's `costs` ({n: a pass verifying n nodes over a 1-token one}; None: no cost cut)
    and `scale`: the table (entry n: costs[n], 1 at 0 and where costs has none, as _budget's table was), then the
    widest n costed (at most MAX_K_ENGINE), the scale, and 1.0 where the cut is by cost."""
    costs_or = costs or {}
    top = min(max(costs_or, default=0), MAX_K_ENGINE)
    table = [1.0] + [costs_or.get(n, 1.0) if n <= top else 1.0 for n in range(1, COST_SLOTS)]
    return [*table, float(top), float(scale), float(costs is not None)]


def cut_costs(cut: torch.Tensor) -> tuple[dict[int, float] | None, float]:
    """cut_inputs read back: (the costs, None where the cut is not by cost; the scale). For the tests."""
    *table, top, scale, by_cost = cut.tolist()
    return ({n: table[n] for n in range(1, int(top) + 1)} if by_cost else None), scale


def _limits(request: DraftRequest) -> list[int]:
    """Each row's node budget, at most the engine's widest tree."""
    return [min(request.nodes(r), MAX_K_ENGINE) for r in range(len(request.ids))]


def node_count(head, request: DraftRequest, k: int) -> int:
    """How many entries a row's kept tree has (padding after its nodes): its budget, at most what k deep grows."""
    return min(max(_limits(request)), widest(head, k))


def widest(head, k: int) -> int:
    """The most nodes a k-deep tree keeps: what it grows, at most the engine's widest tree (grow cuts every tree to
    this width, whatever a row's budget)."""
    top = min(TOP, len(head.subset))
    return min(MAX_K_ENGINE, top + (k - 1) * FRONTIER * top)


def draft_device_trees(drafter: Eagle3Drafter, request: DraftRequest, feature: torch.Tensor) -> list[Proposal]:
    """Each row's dynamic tree after the catch-up (feature (B, H)), grown and cut on the device (device_trees), read
    back once."""
    return _read(device_trees(drafter, request, feature).fields)


OUT = ("tokens", "parents", "keep", "depths", "mask", "fields")  # what grow gives: the kept trees, laid out


def device_trees(drafter: Eagle3Drafter, request: DraftRequest, feature: torch.Tensor) -> DeviceTrees:
    """The request's trees grown and cut (grow: the row's budget, and --tree auto's cost cut) and laid out for the
    target's pass in one CUDA graph per padded batch and k where the head's runner captures (HeadRunner.tree), else
    the same code eagerly, left on the device for the engine to verify there and read back with its verdict; the
    head's cache then holds the growth's entries past each row's true ones (StaticHeadKV.drafted). The trees come as
    wide as the widest a k-deep one keeps and are narrowed to node_count's entries here (views: nothing runs): the
    pass feeds every row the whole node budget (under --tree auto the engine sizes it by the trees it last read:
    loop.auto_width), the cost cut's dropped nodes as padding."""
    k = max(request.ks)
    out = dict(zip(OUT, _growth(drafter, tree_inputs(request, feature), k)))
    drafter.kv.drafted((k - 1) * FRONTIER)
    n = node_count(drafter.head, request, k)
    tokens, parents, keep, fields = (out[f][:, :n] for f in ("tokens", "parents", "keep", "fields"))
    batch = TreeBatch(tokens, parents, keep, out["depths"][:, : n + 1], out["mask"][:, : n + 1, : n + 1])
    return DeviceTrees(tokens, parents, fields[..., 2], fields[..., 3], keep, batch, fields)


POOL = ("tokens", "parents", "values", "q", "chain", "dead")  # what a grown tree gives, (B, C) each


def _growth(drafter: Eagle3Drafter, inputs: TreeInputs, k: int) -> tuple:
    """grow over the drafter's static cache, k deep, through its runner (HeadRunner.tree: one graph per padded batch
    and this key where it captures, captured on first use), with room for the growth's entries. The head's lengths
    are not moved."""
    kv = drafter.kv
    kv.reserve((k - 1) * FRONTIER)
    return kv.runner.tree(kv.storage, (k, len(inputs.eos), drafter.min_confidence), inputs,
                          lambda storage, x: grow(drafter.head, storage, x, k, drafter.min_confidence))


def warm_trees(drafter: Eagle3Drafter, request: DraftRequest) -> None:
    """Capture the growth _grown will replay for this request's batch and each smaller rung of the ladder, at its k
    and each smaller one (the last steps draft less), before the decode is timed; the drafter's cache holds the
    storage its begin takes next. Greedy requests only."""
    if not grows_on_device(drafter, request):
        return
    for b in rungs(len(request.ids)):
        for k in range(1, max(request.ks) + 1):
            asked = replace(request, ids=[request.ids[0]] * b, ks=[k] * b, generators=[None] * b,
                            tree_nodes=[request.nodes(0)] * b)
            feature = torch.zeros(b, drafter.head.c.hidden_size, dtype=drafter.dtype, device=drafter.device)
            _growth(drafter, tree_inputs(asked, feature), k)


def grow(head, storage, inputs: TreeInputs, k: int, min_confidence: float) -> tuple:
    """Every row's tree grown (_grow) and cut (_cut) over the head's static storage, widest(k) entries a row, laid
    out for the target's pass (engine.tree.device_tree_batch): OUT's fields, `fields` (B, N, 5) FIELDS' as float64
    (what the step reads). Device code only, with no host read or copy, so a CUDA graph can hold it whole."""
    kept = _cut(_pool(_grow(head, storage, inputs, k, min_confidence)), inputs.limits, widest(head, k), inputs.cut)
    batch = device_tree_batch(kept["tokens"], kept["parents"], kept["keep"])
    fields = torch.stack([kept[f].double() for f in FIELDS], -1)
    return kept["tokens"], kept["parents"], kept["keep"], batch.depths, batch.mask, fields


CAPTURED.append((sys.modules[__name__], "grow"))  # what specdemo.measure.glue leaves out: a graph where it captures


def _grow(head, storage, inputs: TreeInputs, k: int, min_confidence: float) -> list[_Nodes]:
    """Each row's dynamic tree after the catch-up (inputs.feature (B, H)), depth by depth, as eagle3_tree grows it
    (the nodes it would not grow carried as dead). Depth d's FRONTIER entries a row are written into the head's
    storage at the row's length plus (d - 1) * FRONTIER (HeadStorage.run's offset; the caller moves the lengths after:
    StaticHeadKV.drafted), past its true entries (cut at the next verdict, as a chain's drafted entries are). Device
    code only: every input is a tensor there."""
    feature, ks, eos = inputs.feature, inputs.ks, inputs.eos
    rows, device = feature.shape[0], feature.device
    width, capacity = (k - 1) * FRONTIER, storage.capacity  # the tree's columns past each row's true entries
    first = storage.lengths[:rows]  # (B,): each row's true entries end here
    columns = first[:, None] + torch.arange(width, device=device)  # (B, M)
    visible = storage.slots[None, :] < first[:, None]  # (B, capacity): the true entries
    root = _Nodes(tokens=torch.zeros(rows, 1, dtype=torch.long, device=device),
                  values=torch.ones(rows, 1, dtype=torch.float64, device=device), q=None,
                  chain=torch.ones(rows, 1, dtype=torch.bool, device=device), dead=~inputs.grow[:, None],
                  parents=None, slot=None, outs=None,
                  ancestry=torch.zeros(rows, 1, width, dtype=torch.bool, device=device))
    levels = [_children(head, min_confidence, feature[:, None], root, torch.full((rows, 1), -1, device=device),
                        True)]
    offset = 0
    for depth in range(1, k):
        nodes = levels[-1]
        blocked = nodes.dead | at_eos(nodes.tokens, eos) | (ks <= depth)[:, None]
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
        outs = storage.run(hidden.to(storage.keys.dtype), fed.tokens, positions, mask[:, None],
                           offset=(depth - 1) * FRONTIER)  # (B, F, H)
        levels.append(_children(head, min_confidence, outs, fed, offset + sel, False))
        offset += nodes.tokens.shape[1]
    return levels


def _pool(levels: list[_Nodes]) -> dict[str, torch.Tensor]:
    """Every depth's nodes side by side, (B, C) each, in eagle3_tree's order (depth by depth, fed node by fed
    node)."""
    return {f: torch.cat([getattr(n, f) for n in levels], 1) for f in POOL}


def _cut(pool: dict[str, torch.Tensor], limits: torch.Tensor, n: int, cut: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tree eagle3_tree's _proposal keeps (drafters.trees.branch_out), chosen on the device: the chain's nodes,
    then the others best value first (a node is worth no more than its parent, so its parent is in first), at most
    the row's node budget (limits (B,); n: the widest); where `cut` says so (TreeInputs.cut: --tree auto) the others
    only up to tree_budget's count by its costs, their values weighed by its scale. Returns the kept nodes (B, n) in
    _proposal's order (the chain's, then the rest as they were grown): token, parent (among the kept; -1 the root),
    value, q, and whether a row's entry holds a node."""
    dead, chain, values = pool["dead"], pool["chain"], pool["values"]
    b, c = dead.shape
    best = torch.where(dead, float("-inf"), values + CHAIN_FIRST * chain).sort(dim=1, descending=True, stable=True)
    rank = torch.arange(n, device=values.device)
    keep = (best.values[:, :n] > float("-inf")) & (rank < limits[:, None])  # (B, N), best first
    chosen = best.indices[:, :n]
    budget = _budget(values.gather(1, chosen), chain.gather(1, chosen) & keep, keep, cut)
    keep &= (rank < budget[:, None]) | (cut[-1] == 0)  # the cost cut only where it is asked for
    index = torch.arange(c, device=values.device)
    order = torch.where(keep, index[chosen] - c * chain.gather(1, chosen), 2 * c).sort(dim=1).indices
    kept, keep = chosen.gather(1, order), keep.gather(1, order)
    at = torch.full((b, c + 1), -1, dtype=torch.long, device=values.device)  # pool index + 1 -> its kept position
    at.scatter_(1, torch.where(keep, kept + 1, 0), torch.where(keep, torch.arange(n, device=values.device), -1))
    return dict(tokens=pool["tokens"].gather(1, kept), parents=at.gather(1, pool["parents"].gather(1, kept) + 1),
                values=values.gather(1, kept), q=pool["q"].gather(1, kept), keep=keep)


def _budget(values: torch.Tensor, chain: torch.Tensor, keep: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """drafters.trees.tree_budget on the device, for every row: how many of a row's kept nodes (values (B, N), best
    first, the chain's first) to verify, its chain's and then the others' that pay for the wider pass by the costs
    in `cut` (TreeInputs.cut; shifted past the chain's, as branch_out shifts them), their values weighed by its
    scale."""
    table, top, scale = cut[:COST_SLOTS], cut[COST_SLOTS].long(), cut[COST_SLOTS + 1]  # table: n nodes -> cost
    length = chain.sum(1)  # (B,): the chain's kept nodes
    start = 1.0 + (values * chain).sum(1)
    b, n = values.shape
    m = torch.arange(1, n + 1, device=values.device)  # extras kept
    extra = torch.where(keep & ~chain, values * scale, 0.0)
    # the extras, best first, after the chain: shift each row's so that its first extra is column 0
    shift = (length[:, None] + m[None, :] - 1).clamp(max=n - 1)
    gains = torch.cat([start[:, None], extra.gather(1, shift)], 1).cumsum(1)[:, 1:]  # (B, N): tokens with m extras
    width = length[:, None] + m[None, :]
    fits = (width <= top) & (length[:, None] + m[None, :] - 1 < n) & keep.gather(1, shift)
    cost = table[torch.minimum(width, top)] / table[torch.minimum(length, top)][:, None]
    ratio = torch.where(fits, gains / cost, float("-inf"))
    paying = torch.cat([start[:, None], ratio], 1).argmax(1)  # the first best: 0 keeps the chain alone
    return length + paying


def _read(fields: torch.Tensor) -> list[Proposal]:
    """The kept trees (fields (B, N, 5): FIELDS' of each entry, as grow gives them) in one read, as proposals."""
    out = []
    for row in fields.tolist():  # the step's one read of the tree
        row = [x for x in row if x[4]]
        out.append(Proposal([int(x[0]) for x in row], token_probs=[x[2] for x in row],
                            parents=[int(x[1]) for x in row], values=[x[3] for x in row]) if row else Proposal([]))
    return out


def host_cut(pool: dict[str, torch.Tensor], limits: list[int], costs: dict[int, float] | None = None,
             scale: float = 1.0) -> list[Proposal]:
    """The same tree (_pool's) read whole and cut on the host by eagle3_tree's _proposal (each row's budget from
    `limits`, and `costs` and `scale` as _cut's `cut` holds them: cut_costs): what _cut must equal (the tests)."""
    read = torch.stack([pool[f].double() for f in POOL], -1).tolist()  # each node: POOL's fields, in order
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
        out.append(_proposal(tree, limits[r], costs, scale))
    return out
