"""Suffix decoding (Oliaro et al.; Snowflake's Arctic Inference, vLLM's `suffix` method), model-free: draft the most
frequent continuation of the context's suffix from a tree over this request (prompt and answer so far) and a tree
over earlier answers (a SuffixCache, kept in the SharedState its caller owns: one per process, or one per browser
session).

The trees, the choice between them and the draft follow arctic_inference's SuffixTree / SuffixDecodingCache, which
vLLM calls, so both draft alike (docs/suffix.md says where they may still differ). Knows token ids only.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

from ..config import SuffixConfig
from .base import Drafter, DraftRequest, Proposal, SharedState, cut_at_eos
from .draft_value import DraftValue

_FLOAT = struct.Struct("f")


def _f32(x: float) -> float:
    """x rounded to float32: arctic scores drafts in float32, and ties and the min_token_prob cut follow its rounding
    (one double operation on float32 values, rounded once, is the float32 operation's result)."""
    return _FLOAT.unpack(_FLOAT.pack(x))[0]


SOURCES = ("prompt", "answer", "earlier")  # Proposal.source: where a draft's most recent occurrence lies


class _Node:
    """One substring: how often it occurred, its children, and where it last ended (an index into its sequence)."""

    __slots__ = ("token", "count", "children", "order", "last")

    def __init__(self, token: int, last: int = -1):
        self.token = token
        self.count = 1
        self.children: dict[int, _Node] | None = None  # made at the first child: most nodes are leaves
        self.order: list[_Node] | None = None  # the children, most frequent first (ties: arctic's order, _increment)
        self.last = last


def _increment(parent: _Node, child: _Node) -> None:
    """child.count += 1, keeping parent.order as arctic_inference keeps its sibling list: a child that draws level
    with the run of siblings above it moves to the head of that run, so ties go to whichever it places first."""
    order, c = parent.order, child.count
    if order[0] is child:  # the usual case: nothing above it
        child.count = c + 1
        return
    i = order.index(child)
    if order[i - 1].count <= c + 1:
        top = order[i - 1].count
        j = i - 1
        while j and order[j - 1].count == top:
            j -= 1
        del order[i]
        order.insert(j, child)
    child.count = c + 1


def _decrement(parent: _Node, child: _Node) -> None:
    """child.count -= 1, moving it to the end of the run of siblings that had its count (arctic's order)."""
    order, c = parent.order, child.count
    i = order.index(child)
    j = i + 1
    while j < len(order) and order[j].count == c:
        j += 1
    if j > i + 1:
        del order[i]
        order.insert(j - 1, child)
    child.count = c - 1


@dataclass
class Draft:
    """A speculation: tokens, each one's estimated probability, their sum (the score that picks a tree), the match's
    length and where the drafted substring last ended (-1: none)."""

    tokens: list[int]
    probs: list[float]
    score: float = 0.0
    match_len: int = 0
    last: int = -1


class SuffixTree:
    """Every substring of up to max_depth tokens of some sequences, with occurrence counts: a trie over each
    sequence's suffixes, cut at max_depth. Appending a token updates the max_depth suffixes still growing (O(depth)
    dictionary steps, no scan of the text); removing a sequence undoes its counts."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = _Node(-1)
        self.root.count, self.root.children = 0, {}
        self._seqs: dict[int, list[int]] = {}
        self._active: dict[int, list[_Node]] = {}  # each sequence's growing suffixes, oldest first

    def extend(self, seq: int, tokens: Sequence[int]) -> None:
        """Append tokens to sequence seq (a new one if unseen)."""
        s = self._seqs.setdefault(seq, [])
        active = self._active.setdefault(seq, [])
        root, depth = self.root, self.max_depth
        for token in tokens:
            pos = len(s)
            s.append(token)
            active.append(root)
            root.count += 1
            if len(active) > depth:
                del active[0]
            for i, node in enumerate(active):
                kids = node.children
                child = kids.get(token) if kids is not None else None
                if child is None:
                    child = _Node(token, pos)
                    if kids is None:
                        node.children, node.order = {token: child}, [child]
                    else:
                        kids[token] = child
                        if node is not root:  # drafts never start at the root: its order is not kept
                            node.order.append(child)
                else:
                    if node is root:
                        child.count += 1
                    else:
                        _increment(node, child)
                    child.last = pos
                active[i] = child

    def remove(self, seq: int) -> None:
        """Forget sequence seq: its counts come off, and substrings only it held go."""
        s = self._seqs.pop(seq, None)
        self._active.pop(seq, None)
        root = self.root
        for start in range(len(s or ())):
            node = root
            root.count -= 1
            for token in s[start : start + self.max_depth]:
                child = node.children.get(token) if node.children else None
                if child is None:
                    break
                if child.count == 1:
                    del node.children[token]
                    if node is not root:
                        node.order.remove(child)
                    break
                if node is root:
                    child.count -= 1
                else:
                    _decrement(node, child)
                node = child

    def matches(self, context: Sequence[int], max_tokens: int, config: SuffixConfig,
                min_match: int = 1) -> Iterator[tuple[int, object, int]]:
        """(m, the match's node, the most tokens it may draft: min(max_tokens, max_spec_factor * m)) for each match
        length m >= min_match of context's suffix that the tree holds (m < len(context)), shortest first; arctic's
        loop over match lengths, which speculate and a tree draft (drafters.trees.match_subtrees) both walk."""
        context = list(context[-self.max_depth :])
        n = len(context)
        factor = _f32(config.max_spec_factor)
        for m in range(1, n):
            node = self.root
            for token in context[n - m :]:
                node = node.children.get(token) if node.children else None
                if node is None:
                    return
            if m >= min_match:
                yield m, node, max(0, min(max_tokens, int(_f32(m * factor) + 1e-6)))

    def speculate(self, context: Sequence[int], max_tokens: int, config: SuffixConfig, min_match: int = 1) -> Draft:
        """The best-scoring draft over every match length m of context's suffix (m < len(context); ties to the
        longer): from the node of the match, follow the most frequent child while the product of count ratios stays
        >= min_token_prob, at most min(max_tokens, max_spec_factor * m) tokens (arctic's _speculate_path)."""
        best = Draft([], [])
        min_prob = _f32(config.min_token_prob)
        for m, node, limit in self.matches(context, max_tokens, config, min_match):
            tokens, probs, prob, score = [], [], 1.0, 0.0
            while len(tokens) < limit and node.order:
                child = node.order[0]
                prob = _f32(prob * _f32(child.count / node.count))
                if prob < min_prob:
                    break
                tokens.append(child.token)
                probs.append(prob)
                score = _f32(score + prob)
                node = child
            if score >= best.score:
                best = Draft(tokens, probs, score, m, node.last if tokens else -1)
        return best


class SuffixCache:
    """Earlier answers, for later requests to draft from: one suffix tree over at most max_cached_requests answers,
    the oldest evicted first. It lives in the SharedState of whoever serves requests (the CLI and the bench: one per
    process; the app: one per browser session), so every suffix drafter built with that state drafts from it (`of`);
    clear() forgets everything.

    An answer enters the tree when its request ends (its row finishes, or its drafter begins another batch) or when a
    later request opens on this cache, whichever comes first; so a draft from this tree is always from an earlier
    answer (source "earlier"), never from the answer being written. Thread-safe.
    """

    def __init__(self, max_tree_depth: int = SuffixConfig.max_tree_depth,
                 max_cached_requests: int = SuffixConfig.max_cached_requests):
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.recording = True  # False: requests opened now leave nothing behind (untimed warm-ups, repeated runs)
        self._lock = threading.RLock()
        self._next = 0  # answer ids never repeat, across clear() too
        self.clear()

    @classmethod
    def of(cls, shared: SharedState | None, config: SuffixConfig) -> SuffixCache | None:
        """The cache in `shared` (made with config's sizes at its first use); None without a shared state (the
        drafter then keeps a cache of its own)."""
        if shared is None:
            return None
        return shared.get("suffix", lambda: cls(config.max_tree_depth, config.max_cached_requests))

    def clear(self) -> None:
        """Forget every answer; requests in flight leave nothing behind either."""
        with self._lock:
            self._tree = SuffixTree(self.max_tree_depth)
            self._answers: dict[int, list[int] | None] = {}  # id -> pending tokens, None once in the tree; FIFO
            self.value = DraftValue()  # what its drafts have been worth (cost-aware drafting)

    def __len__(self) -> int:
        """Answers held (in the tree or pending)."""
        return len(self._answers)

    def open(self, n: int) -> list[int | None]:
        """n new answers (a batch's rows): publishes every pending one first (those of earlier requests), evicts the
        oldest beyond max_cached_requests. None where nothing is kept (max_cached_requests 0, or not recording)."""
        with self._lock:
            for key in [key for key, pending in self._answers.items() if pending is not None]:
                self.close(key)
            if not self.recording or self.max_cached_requests == 0:
                return [None] * n
            keys = list(range(self._next, self._next + n))
            self._next += n
            for key in keys:
                self._answers[key] = []
            while len(self._answers) > self.max_cached_requests:
                self._evict(next(iter(self._answers)))
            return [key if key in self._answers else None for key in keys]

    def add(self, key: int | None, tokens: Sequence[int]) -> None:
        """Append an open answer's new tokens (nothing if it was evicted or cleared)."""
        with self._lock:
            pending = self._answers.get(key, ...)
            if pending is None:
                self._tree.extend(key, tokens)
            elif pending is not ...:
                pending.extend(tokens)

    def close(self, key: int | None) -> None:
        """The answer is done: into the tree."""
        with self._lock:
            pending = self._answers.get(key)
            if pending is not None:
                self._answers[key] = None
                self._tree.extend(key, pending)

    def _evict(self, key: int) -> None:
        if self._answers.pop(key) is None:
            self._tree.remove(key)

    def speculate(self, context: Sequence[int], max_tokens: int, config: SuffixConfig, min_match: int = 1) -> Draft:
        with self._lock:
            return self._tree.speculate(context, max_tokens, config, min_match)

    def subtrees(self, context: Sequence[int], max_tokens: int, config: SuffixConfig, min_match: int = 1,
                 max_depth: int | None = None):
        """drafters.trees.match_subtrees over the earlier answers: each match's (TokenTree, its nodes'
        probabilities)."""
        from .trees import match_subtrees  # trees builds on this module

        with self._lock:
            return match_subtrees(self._tree, context, max_tokens, config, min_match, max_depth)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Requests opened inside leave no answer behind (a warm-up, or a second run of one prompt)."""
        with self._lock:
            before, self.recording = self.recording, False
        try:
            yield
        finally:
            self.recording = before


class _Row:
    """One request: its tree (prompt and answer so far), its answer's key in the cache, how many ids it has seen."""

    def __init__(self, prompt: list[int], key: int | None, depth: int):
        self.tree = SuffixTree(depth)
        self.tree.extend(0, prompt)
        self.prompt_len = self.seen = len(prompt)
        self.key = key
        self.done = False
        self.kinds: list[tuple] = []  # the kinds of its last draft's tokens (cost-aware drafting)

    def sync(self, ids: Sequence[int], cache: SuffixCache, eos: frozenset[int]) -> None:
        """Take in the committed ids not yet seen (up to an EOS: nothing after it is the answer)."""
        new = cut_at_eos(list(ids[self.seen :]), eos)
        if self.done or not new:
            return
        self.done = new[-1] in eos
        self.tree.extend(0, new)
        cache.add(self.key, new)
        self.seen += len(new)


class SuffixDrafter(Drafter):
    """Suffix decoding: each row's draft is the better-scoring (ties: this request's) of two speculations, one on the
    row's own tree and one on the cache's tree of earlier answers. The draft's length adapts to the match (at most
    max_spec_factor x its length, and k) and to the counts (min_token_prob); k is the most it drafts.

    Proposal.source: "earlier" from the cache; from the row's tree, "answer" where the drafted substring last occurred
    inside the answer so far, else "prompt". `min_match` drops matches shorter than that (the hybrid asks for 3).
    With `pass_costs` ({n: an (n+1)-token pass over a 1-token one}, measured on the target), each draft is cut to the
    length its estimated acceptance pays for (DraftValue, kept in the cache). Deterministic: q is one-hot on the
    drafted token, as for prompt lookup.
    """

    name = "suffix"
    drafts_trees = True

    def __init__(self, cache: SuffixCache | None = None, config: SuffixConfig = SuffixConfig(), min_match: int = 1,
                 pass_costs: dict[int, float] | None = None, cost_aware: bool | None = None):
        config.validate()
        self.config = config
        self.cache = cache if cache is not None else SuffixCache(config.max_tree_depth, config.max_cached_requests)
        self.min_match = min_match
        self.pass_costs = pass_costs
        # cut chains by pass costs (None: where pass costs are given); trees are cut by them under --tree auto
        self.cost_aware = bool(pass_costs) if cost_aware is None else cost_aware
        self._rows: list[_Row] = []
        self._eos: frozenset[int] = frozenset()

    def paused(self) -> AbstractContextManager[None]:
        return self.cache.paused()

    def forget(self) -> None:
        self.cache.clear()

    def settings(self) -> dict[str, dict]:
        return {"suffix": self.config.as_dict()}

    def begin(self, prompts, target_hidden=None) -> None:
        for row in self._rows:
            self.cache.close(row.key)
        keys = self.cache.open(len(prompts))
        self._rows = [_Row(list(p), key, self.config.max_tree_depth) for p, key in zip(prompts, keys)]

    def propose(self, request: DraftRequest) -> list[Proposal]:
        self._eos = request.eos_token_ids
        out = []
        for r, (row, ids, k) in enumerate(zip(self._rows, request.ids, request.ks)):
            row.sync(ids, self.cache, self._eos)
            nodes = request.nodes(r)
            out.append(self._tree(row, ids, k, nodes, request.tree_costs, request.tree_extra_scale)
                       if nodes and k > 0
                       else self._draft(row, ids, k))
        return out

    def _tree(self, row: _Row, ids: Sequence[int], k: int, nodes: int, costs: dict[int, float] | None,
              scale: float = 1.0) -> Proposal:
        """A tree draft: the chain draft (_draft's, cost-aware cut included) as its first branch, merged with the
        subtrees of every match in the row's and the cache's trees (drafters.trees.suffix_forest, each at most k deep
        and `nodes` nodes, cut after an EOS), whose other nodes are kept by estimated probability, cut by pass costs
        when asked (branch_out)."""
        from .trees import branch_out, cut_after, graft, match_subtrees, suffix_forest  # trees builds on this module

        chain, values = self._draft(row, ids, min(k, nodes), with_values=True)
        if self.cost_aware and self.pass_costs and not chain.tokens:
            return chain  # drafting does not pay here
        context = list(ids[-self.config.max_tree_depth :])
        own = match_subtrees(row.tree, context, nodes, self.config, self.min_match, k)
        tree, probs = suffix_forest(own + self.cache.subtrees(context, nodes, self.config, self.min_match, k))
        tree, keep = cut_after(tree, self._eos)
        tree, values = graft(chain.tokens, values, tree, [probs[j] for j in keep])
        if not len(tree):
            return chain
        tree, kept = branch_out(tree, values, costs, nodes, len(chain.tokens) or None, scale)
        return Proposal(list(tree.tokens), parents=list(tree.parents), source=chain.source or (
            None if own else "earlier"), values=[values[j] for j in kept])

    @staticmethod
    def _where(row: _Row, draft: Draft) -> str:
        """A draft from the row's own tree: "answer" where its substring last began inside the answer, else
        "prompt"."""
        start = draft.last - (draft.match_len + len(draft.tokens)) + 1  # where the drafted substring last began
        return "answer" if start >= row.prompt_len else "prompt"

    def _draft(self, row: _Row, ids: Sequence[int], k: int, with_values: bool = False):
        """A chain draft (with with_values: and its tokens' estimated probabilities)."""
        row.kinds = []
        if k <= 0:
            return (Proposal([]), []) if with_values else Proposal([])
        context = ids[-self.config.max_tree_depth :]
        own = row.tree.speculate(context, k, self.config, self.min_match)
        earlier = self.cache.speculate(context, k, self.config, self.min_match)
        if own.score >= earlier.score:
            if not own.tokens:
                return (Proposal([]), []) if with_values else Proposal([])
            draft, source = own, self._where(row, own)
        else:
            draft, source = earlier, "earlier"
        tokens = cut_at_eos(draft.tokens, self._eos)
        if self.cost_aware and self.pass_costs and tokens:
            ratios = [p / q for p, q in zip(draft.probs, [1.0, *draft.probs])][: len(tokens)]
            kinds = DraftValue.kinds(source, draft.match_len, ratios)
            keep = self.cache.value.length(kinds, ratios, self.pass_costs)
            tokens, row.kinds = tokens[:keep], kinds[:keep]
        proposal = Proposal(tokens, source=source)
        return (proposal, draft.probs[: len(tokens)]) if with_values else proposal

    def update(self, verdicts) -> None:
        for row, verdict in zip(self._rows, verdicts):
            if row.kinds:  # a tree's chain is its first nodes: accepted as far as the path follows them
                path = verdict.path
                on_chain = verdict.num_accepted if path is None else next(
                    (i for i, j in enumerate(path) if i != j), len(path))
                self.cache.value.record(row.kinds, on_chain)
                row.kinds = []
            row.sync(verdict.ids, self.cache, self._eos)

    def select(self, rows) -> None:
        keep = set(rows)
        for r, row in enumerate(self._rows):
            if r not in keep:
                self.cache.close(row.key)
        self._rows = [self._rows[r] for r in rows]

