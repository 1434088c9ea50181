"""Draft trees verified in one target pass: the tree (each node's RoPE position and the ancestry attention mask) and
its acceptance rules, greedy (the longest path the target agrees with) and recursive rejection sampling over siblings.

Pure tensor code beside verify.py, with its names: `p` is the target's distribution, `q` the draft's. Knows nothing of
models, caches or drafters. Entry 0 of a verify pass is the root (the pending token the target already chose); entry
j + 1 is node j.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from ..models.placement import to_device
from .verify import draft_rows_batch, row_uniforms, sample, sample_rows


@dataclass(frozen=True)
class TokenTree:
    """Drafted tokens and each one's parent node (-1: the root), topologically ordered (a parent before its children);
    siblings are tried in index order. A chain is the tree with one child per node."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "parents", tuple(int(a) for a in self.parents))
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        for j, a in enumerate(self.parents):
            if not -1 <= a < j:
                raise ValueError(f"node {j}'s parent {a} is not an earlier node or the root (-1)")

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> TokenTree:
        """tokens as a chain: node i's parent is node i - 1."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> TokenTree:
        """Token sequences merged by their common prefixes (a trie); nodes and siblings in order of first appearance."""
        tokens, parents, index = [], [], {}  # (parent node, token) -> node
        for path in paths:
            node = -1
            for t in path:
                key = (node, int(t))
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(int(t))
                    parents.append(node)
                node = index[key]
        return cls(tuple(tokens), tuple(parents))

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Each node's depth: the root's children are at 1 (a node's RoPE position is the root's plus its depth)."""
        out: list[int] = []
        for a in self.parents:
            out.append(1 if a < 0 else out[a] + 1)
        return tuple(out)

    @cached_property
    def _children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]  # by entry: 0 is the root
        for j, a in enumerate(self.parents):
            kids[a + 1].append(j)
        return tuple(tuple(k) for k in kids)

    def children(self, node: int = -1) -> tuple[int, ...]:
        """A node's children in index order (node -1: the root's)."""
        return self._children[node + 1]

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node` (empty for the root, -1)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self) - 1))

    def off_chain(self, values: Sequence[float], path: Sequence[int]) -> tuple[float, int]:
        """(the summed values of the nodes off the chain of first children, how many nodes of the accepted `path`
        lie past where it leaves that chain): what the branches were valued at, and what they gave."""
        chain, node = set(), -1
        while self.children(node):
            node = self.children(node)[0]
            chain.add(node)
        along = next((i for i, j in enumerate(path) if j not in chain), len(path))
        return sum(v for j, v in enumerate(values) if j not in chain), len(path) - along

    def distinct_siblings(self) -> bool:
        """No two children of one node share a token (what a deterministic drafter's tree should be: a repeated
        sibling can never be accepted after the first is rejected)."""
        return all(len({self.tokens[c] for c in kids}) == len(kids) for kids in self._children)

    def positions(self, start: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
        """(n+1,) position of each verify entry: `start` (the root's position) plus its depth."""
        return start + torch.tensor((0, *self.depths), dtype=torch.long, device=device)

    @cached_property
    def ancestry(self) -> tuple[tuple[bool, ...], ...]:
        """(n+1) rows of (n+1) booleans, [b][a] = entry b may attend to entry a: a is b itself or one of its ancestors
        (the root is every node's). A chain gives the causal mask. On the host: TreeBatch.stack pads them."""
        rows: list[list[bool]] = []
        for b in range(len(self) + 1):
            a = self.parents[b - 1] + 1 if b else -1  # the parent's entry
            row = list(rows[a]) if a >= 0 else [False] * (len(self) + 1)
            row[0] = row[b] = True
            rows.append(row)
        return tuple(map(tuple, rows))

    def attention_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """`ancestry` as an (n+1, n+1) bool tensor."""
        return to_device(self.ancestry, device, torch.bool)

    def select(self, nodes: Sequence[int]) -> TokenTree:
        """The tree of these nodes only (every kept node's parent kept too), in their original order."""
        keep = sorted(set(nodes))
        new = {-1: -1, **{old: i for i, old in enumerate(keep)}}
        missing = [j for j in keep if self.parents[j] not in new]
        if missing:
            raise ValueError(f"nodes {missing} are kept without their parents")
        return TokenTree(tuple(self.tokens[j] for j in keep), tuple(new[self.parents[j]] for j in keep))


@dataclass
class TreeBatch:
    """B trees padded to n nodes, on one device: tokens, parents (-1 root; padding hangs off the root) and real
    (B, n); depths (B, n+1) by entry; mask (B, n+1, n+1) as TokenTree.attention_mask (padding sees only itself)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    real: torch.Tensor
    depths: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def stack(cls, trees: Sequence[TokenTree], nodes: int | None = None,
              device: torch.device | str | None = None) -> TreeBatch:
        n = max((len(t) for t in trees), default=0) if nodes is None else nodes
        b, tokens, parents, real, depths, mask = len(trees), [], [], [], [], []
        for t in trees:  # Python lists, made tensors once each (a tensor op per row and field costs more here)
            m, pad = len(t), n - len(t)
            tokens += [*t.tokens, *[0] * pad]
            parents += [*t.parents, *[-1] * pad]
            real += [True] * m + [False] * pad
            depths += [0, *t.depths, *[0] * pad]
            mask += [v for row in t.ancestry for v in (*row, *[False] * pad)]
            mask += [j == i for i in range(m + 1, n + 1) for j in range(n + 1)]  # padding sees only itself
        return cls(to_device(tokens, device, torch.long).view(b, n), to_device(parents, device, torch.long).view(b, n),
                   to_device(real, device, torch.bool).view(b, n), to_device(depths, device, torch.long).view(b, n + 1),
                   to_device(mask, device, torch.bool).view(b, n + 1, n + 1))  # no wait


def greedy_tree_accept_batch(trees: Sequence[TokenTree], logits: torch.Tensor,
                             batch: TreeBatch | None = None) -> tuple[list[list[int]], list[int]]:
    """Greedy over trees, every row at once: logits (B, W, V) at each row's entries (W >= its nodes + 1) ->
    (accepted nodes along each row's path, next token per row). The path ends at the deepest node whose token and
    every ancestor's equal the target's argmax at its parent (the lowest index among equally deep ones), so the output
    is the target's own greedy output; the next token is the argmax there. `batch`: the trees already stacked."""
    if logits.device.type == "cpu":  # reads cost nothing here: the argmaxes once, then a walk per row
        choices = logits.argmax(-1).tolist()
        ends, nxt = map(list, zip(*(greedy_tree_end(t, c) for t, c in zip(trees, choices)))) if trees else ([], [])
    else:
        w = logits.shape[1]
        batch = batch if batch is not None else TreeBatch.stack(trees, w - 1, logits.device)
        ends, nxt = torch.stack(greedy_tree_verdict(batch, logits)).tolist()  # the one host sync
    return [t.path(e - 1) if e else [] for t, e in zip(trees, ends)], nxt


def greedy_tree_end(tree: TokenTree, choice: Sequence[int]) -> tuple[int, int]:
    """greedy_tree_verdict for one tree on the host, from the target's argmax at each entry (choice, at least
    len(tree) + 1 of them): (the accepted path's last entry, 0 for none; the next token)."""
    good, end = [False] * len(tree), 0
    depths = tree.depths
    for j, (a, t) in enumerate(zip(tree.parents, tree.tokens)):
        good[j] = t == choice[a + 1] and (a < 0 or good[a])
        if good[j] and (not end or depths[j] > depths[end - 1]):  # deeper only: the lowest index of a depth stays
            end = j + 1
    return end, choice[end]


def greedy_tree_verdict(batch: TreeBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_tree_accept_batch's verdict left on the device: each row's last accepted entry (B,) (0: none of its
    nodes; else its accepted path's deepest node + 1) and next token (B,)."""
    b, n = batch.tokens.shape
    choice = logits.argmax(-1)  # (B, W)
    if n == 0:  # nothing drafted: a plain step
        return torch.zeros(b, dtype=torch.long, device=logits.device), choice[:, 0]
    ok = (batch.tokens == choice.gather(1, batch.parents + 1)) & batch.real  # (B, n): the target's pick at its parent
    good = (batch.mask[:, 1:, 1:] <= ok[:, None, :]).all(-1)  # (B, n): every node on the path to it ok
    # the deepest good node, the lowest index among equally deep ones; 0 where none is good
    score = good * (batch.depths[:, 1:] * (n + 1) + torch.arange(n, 0, -1, device=logits.device))
    top, best = score.max(1)  # the first of equal maxima: only 0s tie
    last = (best + 1) * (top > 0)  # entry
    return last, choice.gather(1, last[:, None])[:, 0]


def device_tree_batch(tokens: torch.Tensor, parents: torch.Tensor, keep: torch.Tensor) -> TreeBatch:
    """The TreeBatch of trees given on the device (drafters.base.DeviceTrees' layout: (B, N) each, each row's nodes
    first, a parent before its children), built there: each node's ancestors by repeated squaring of the parent
    relation, its depth their count, padding seeing only itself (as TreeBatch.stack pads)."""
    b, n = tokens.shape
    index = torch.arange(n, device=tokens.device)
    reach = (index[None, :, None] == index[None, None, :]) | ((parents[:, :, None] == index) & keep[:, :, None])
    for _ in range(max(n - 1, 1).bit_length()):  # paths twice as long each round: ancestors or self
        reach |= torch.bmm(reach.float(), reach.float()) > 0
    depths = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=tokens.device),
                        torch.where(keep, reach.sum(-1), 0)], 1)
    mask = torch.eye(n + 1, dtype=torch.bool, device=tokens.device).repeat(b, 1, 1)
    mask[:, 1:, 1:] = reach
    mask[:, 1:, 0] = keep
    return TreeBatch(tokens, parents, keep, depths, mask)


def greedy_tree_accept(tree: TokenTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """greedy_tree_accept_batch for one tree: target_logits (n+1, V) -> (accepted nodes, next token)."""
    paths, nxt = greedy_tree_accept_batch([tree], target_logits[None])
    return paths[0], nxt[0]


Decide = Callable[[int, torch.Tensor, torch.Tensor], bool]  # (node, p(x), q(x)) -> accept node?


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what the target still owes after a rejected draft from q; p itself if nothing is left
    (p == q up to rounding, where a rejection has probability 0)."""
    r = (p - q).clamp(min=0)
    s = r.sum()
    return p if float(s) <= 0 else r / s


def tree_walk(tree: TokenTree, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
              decide: Decide) -> tuple[list[int], torch.Tensor]:
    """Recursive rejection sampling down the tree (SpecInfer's multi-step speculative sampling; EAGLE's
    evaluate_posterior and SGLang's tree_speculative_sampling_target_only for one-hot drafts), with the accept/reject
    choices left to `decide(node, p(x), q(x))`, which accepts with probability min(1, p(x) / q(x)).

    From the root with p = target_probs[0]: try the children in index order; an accepted child's token is kept and
    the walk goes on below it with p = its target row; a rejected child's q is taken off, p <- norm(max(0, p - q)).
    When every child is rejected, or there are none, the walk stops. Returns (accepted nodes, the distribution the
    next token is drawn from: a target row or a residual). draft_probs (n, V): row j is the law node j's token was
    drawn from (see tree_accept); None means one-hot rows (a deterministic drafter)."""
    path, entry, p = [], 0, target_probs[0]
    while True:
        for c in tree.children(entry - 1):
            x = tree.tokens[c]
            if draft_probs is None:
                q = torch.zeros_like(p)
                q[x] = 1.0
            else:
                q = draft_probs[c].to(p.dtype)
            if decide(c, p[x], q[x]):
                path.append(c)
                entry, p = c + 1, target_probs[c + 1]
                break
            p = _residual(p, q)
        else:  # every child rejected, or a leaf: the next token comes from p
            return path, p


def tree_accept(tree: TokenTree, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                generator: torch.Generator | None) -> tuple[list[int], int]:
    """Exact sampling over a draft tree: tree_walk with one uniform per node, then the next token from where it stops.
    tree (n nodes); draft_probs (n, V) or None (one-hot: a deterministic drafter); target_probs (n+1, V) by entry.
    Returns (accepted nodes along the path, next token). On a chain it is rejection_accept, draw for draw.

    Exact (the emitted tokens follow p) when the tree was drafted so that each node's token, given the tokens of
    every earlier node, has the law draft_probs[j] (which may depend on them): children drawn i.i.d. from q with
    replacement (each child's row is q), without replacement (sibling_rows), one-hot rows for tokens fixed by earlier
    ones (top-k of q, lookups), and any mix. Why: at a node, given everything drawn before child i, x_i ~ q_i and one
    step of Leviathan et al.'s rule against the current p_i emits min(p_i, q_i)(x) by accepting and, with the
    remaining mass beta_i = sum max(0, p_i - q_i), hands over to the later siblings with p_{i+1} = norm(max(0, p_i -
    q_i)), which depends on nothing drawn at i; so by induction from the last sibling (whose hand-over is a sample
    from the residual) the token emitted at the node follows p_i, and below an accepted child by induction on depth.
    Not exact for trees pruned after sampling by the sampled tokens' values (keep such pruning to one-hot drafts)."""
    r = torch.rand(len(tree), generator=generator, device=target_probs.device)  # one uniform per node, as
    # rejection_accept draws one per draft; r < p/q accepts, written without division so q == 0 cannot blow up
    path, p = tree_walk(tree, draft_probs, target_probs, lambda c, px, qx: not bool(r[c] * qx > px))
    return path, sample(p, generator)


def sibling_rows(tree: TokenTree, parent_probs: torch.Tensor, replacement: bool = True) -> torch.Tensor:
    """draft_probs for a tree whose children were sampled from q at their parent: parent_probs (n+1, V) is q after
    each entry (row 0: after the root). With replacement every child's row is its parent's q; without, child i's row
    is that q with its earlier siblings' tokens taken out and renormalised (the law it was drawn from)."""
    rows = []
    for j, a in enumerate(tree.parents):
        q = parent_probs[a + 1]
        if not replacement:
            q = q.clone()
            for s in tree.children(a):
                if s == j:
                    break
                q[tree.tokens[s]] = 0.0
            q = q / q.sum()
        rows.append(q)
    return torch.stack(rows) if rows else parent_probs[:0]


def tree_accept_each(trees: Sequence[TokenTree], draft_probs: Sequence[torch.Tensor | None],
                     target_probs: torch.Tensor, generators: Sequence[torch.Generator | None]
                     ) -> tuple[list[list[int]], list[int]]:
    """tree_accept row by row (a read per child tried; on a CPU, where a read costs nothing, cheaper than
    tree_accept_batch's residuals at every entry): the same arguments and results as tree_accept_batch."""
    out = [tree_accept(t, q, target_probs[r, : len(t) + 1], g)
           for r, (t, q, g) in enumerate(zip(trees, draft_probs, generators))]
    return [path for path, _ in out], [nxt for _, nxt in out]


def tree_accept_batch(trees: Sequence[TokenTree], draft_probs: Sequence[torch.Tensor | None],
                      target_probs: torch.Tensor, generators: Sequence[torch.Generator | None]
                      ) -> tuple[list[list[int]], list[int]]:
    """tree_accept for every row at once on the device, read back in one copy: target_probs (B, W, V), W >= each
    tree's nodes + 1; draft_probs each row's (n, V) or None (one-hot). Row r draws from generators[r] what
    tree_accept draws for it alone (one uniform per node, then the next token), and takes the same verdicts: every
    entry's siblings are tried in index order at once across entries and rows (a rejected sibling's q taken off p,
    renormalised, as _residual does), then each row follows its first accepted children down from the root.
    Returns (accepted nodes per row, next token per row)."""
    rows, width, vocab = target_probs.shape
    device, p = target_probs.device, target_probs
    n = [len(t) for t in trees]
    fan = max((len(t.children(e - 1)) for t in trees for e in range(len(t) + 1)), default=0)
    kids = []  # (B, W, C): each entry's children in the order they are tried, -1 past them
    for t in trees:
        entries = [list(t.children(e - 1)) for e in range(len(t) + 1)]
        kids.append([c + [-1] * (fan - len(c)) for c in entries] + [[-1] * fan] * (width - len(entries)))
    kids = torch.tensor(kids, dtype=torch.long).view(rows, width, fan)
    tokens = torch.tensor([list(t.tokens) + [0] * (width - 1 - len(t)) for t in trees], dtype=torch.long)
    kids, tokens = to_device(kids, device), to_device(tokens, device)
    u = row_uniforms(n, width, generators, device)  # (B, W): node j's uniform at j, as tree_accept draws them
    q_all = draft_rows_batch(tokens, draft_probs, p)  # (B, W - 1, V), one-hot rows as tree_walk makes them; or None
    deterministic = q_all is None
    chosen = torch.full((rows, width), -1, dtype=torch.long, device=device)  # entry -> its accepted child node
    done = torch.zeros(rows, width, dtype=torch.bool, device=device)
    for i in range(fan):
        child = kids[:, :, i]  # (B, W)
        live = (child >= 0) & ~done
        c = child.clamp(min=0)
        x = tokens.gather(1, c)  # (B, W)
        px = p.gather(2, x[..., None])[..., 0]
        if deterministic:
            qx = torch.ones_like(px)
            rest = p.scatter(2, x[..., None], 0.0)  # max(0, p - onehot(x))
        else:
            q = q_all.gather(1, c[..., None].expand(rows, width, vocab))  # (B, W, V): each child's own q
            qx = q.gather(2, x[..., None])[..., 0]
            rest = (p - q).clamp(min=0)
        accept = live & ~(u.gather(1, c) * qx > px)  # tree_accept's decide: r < p/q, no division
        chosen = torch.where(accept, child, chosen)
        total = rest.sum(-1, keepdim=True)
        residual = torch.where(total > 0, rest / total, p)  # p == q up to rounding: nothing left to take off
        p = torch.where((live & ~accept)[..., None], residual, p)
        done |= accept
    entry = torch.zeros(rows, 1, dtype=torch.long, device=device)
    path = []
    for _ in range(max((max(t.depths, default=0) for t in trees), default=0)):
        node = chosen.gather(1, entry)  # (B, 1)
        path.append(node[:, 0])
        entry = torch.where(node >= 0, node + 1, entry)
    nxt = sample_rows(p.gather(1, entry[..., None].expand(rows, 1, vocab))[:, 0], generators)
    read = torch.stack(path + [nxt], 1).tolist()  # the one read: each row's walk, then its next token
    paths = [row[:-1] for row in read]
    return [row[: row.index(-1)] if -1 in row else row for row in paths], [row[-1] for row in read]
