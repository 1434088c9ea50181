"""A speculative step whose drafts stay on the device (Drafter.propose_on_device): greedy chains or trees, or sampled
chains, verified there (the target's argmax compared, or rejection sampling), and the drafts and the verdicts read
back in one copy, the step's one host synchronisation (what a graph-captured target needs to run at the chip's
pace). The loop (engine.loop) chooses it; knows the caches' forward and keep, not the loop's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..drafters.base import FIELDS, DeviceChains, DeviceTrees, Proposal
from ..models.placement import to_device
from .events import Inspection
from .tree import TokenTree, device_tree_batch, greedy_tree_verdict
from .verify import ROW_RULES, greedy_verdicts, inspect_verify, logits_to_probs, read_chains


@dataclass
class Verified:
    """One row's verdict from a verify pass: the accepted nodes (a chain's: its first num_accepted) and the next
    token."""

    path: list[int]
    next_token: int
    inspection: Inspection | None

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def _feed(run, ids: list[list[int]], drafts: torch.Tensor) -> torch.Tensor:
    """Each row's pending token, then its drafts (B, n) as they lie on the device: (B, n + 1)."""
    pending = to_device([[row[-1]] for row in ids], run.device)
    return torch.cat([pending, drafts.to(run.device, non_blocking=True)], 1)


def verify_chains_on_device(run, ids: list[list[int]], chains: DeviceChains, ks: list[int]) -> tuple:
    """Chains still on the device: every row feeds its pending token and all k drafted positions (a row's past its
    length are padding: each entry attends only to those before it, and none is accepted), the verdicts are reached
    there (greedy: the target's argmax compared; sampling: the rule's verify.ROW_RULES against the chains' draft
    distributions, row r drawing min(ks[r], the chains' width) uniforms from its own generator), the cache keeps the
    accepted entries, and the verdicts and the chains come back in one read (verify.read_chains). Returns (width,
    features, each row's proposal as read (a held row's as the host drafted it: DeviceChains.held), verified)."""
    tokens = _feed(run, ids, chains.tokens)  # (B, k + 1)
    width, before = tokens.shape[1], list(run.kv.counts)
    real = torch.ones_like(tokens, dtype=torch.bool)
    logits, features = run.kv.forward(tokens, real, width, run.layers, fed=[width] * len(ids))  # (B, W, V)
    lengths, probs = chains.lengths.to(run.device, non_blocking=True), None
    if run.sampling.greedy:
        verdicts = greedy_verdicts(tokens[:, 1:], lengths, logits)
    else:
        probs = logits_to_probs(logits, run.sampling)  # (B, W, V)
        q_rows = None if chains.probs is None else chains.probs.to(run.device, non_blocking=True)
        verdicts = ROW_RULES[run.sampling.verification](tokens[:, 1:], lengths, q_rows, probs, run.rows.gens,
                                                        [min(k, width - 1) for k in ks])
    accepted, nxt, drafted, q = read_chains(*verdicts, tokens[:, 1:], lengths,
                                            chains.q.to(run.device, non_blocking=True))
    run.kv.keep([n + 1 + a for n, a in zip(before, accepted)])
    seen = [inspect_verify(logits[r, : len(d) + 1], None if probs is None else probs[r, : len(d) + 1],
                           tokens[r, 1 : 1 + len(d)]) if run.inspect else None for r, d in enumerate(drafted)]
    held = chains.held or [None] * len(ids)
    proposals = [h or Proposal(d, token_probs=p, source=chains.source) for h, d, p in zip(held, drafted, q)]
    return width, features, proposals, [Verified(list(range(a)), t, s) for a, t, s in zip(accepted, nxt, seen)]


def verify_trees_on_device(run, ids: list[list[int]], trees: DeviceTrees) -> tuple:
    """Greedy trees still on the device: every row feeds its pending token and all N entries (its padding sees only
    itself and is never accepted), each node at its depth under its ancestry mask (engine.tree.device_tree_batch,
    built there), the accepted path chosen there (greedy_tree_verdict), and the trees and the verdicts come back in
    one read; then the cache keeps each row's accepted path, copied down with nothing more read. Returns (width,
    features, the proposals as read, each row's tree (None where it is a chain), verified)."""
    tokens = _feed(run, ids, trees.tokens)  # (B, N + 1)
    width, rows = tokens.shape[1], len(ids)
    batch = trees.batch if trees.batch is not None else device_tree_batch(
        *(getattr(trees, f).to(run.device) for f in ("tokens", "parents", "keep")))
    real = torch.ones_like(tokens, dtype=torch.bool)
    logits, features = run.kv.forward(tokens, real, width, run.layers, tree=batch, fed=[width] * rows)  # (B, W, V)
    last, nxt = greedy_tree_verdict(batch, logits)
    nodes = (trees.fields if trees.fields is not None
             else torch.stack([getattr(trees, f).double() for f in FIELDS], -1)).to(run.device).flatten(1)  # (B, 5N)
    read = torch.cat([nodes, last[:, None].double(), nxt[:, None].double()], 1).tolist()  # the step's one read
    proposals, as_read, verified = [], [], []
    for r, row in enumerate(read):
        kept = [row[i : i + len(FIELDS)] for i in range(0, len(row) - 2, len(FIELDS)) if row[i + 4]]
        tree = TokenTree([int(x[0]) for x in kept], [int(x[1]) for x in kept])
        proposals.append(Proposal(list(tree.tokens), token_probs=[x[2] for x in kept], parents=list(tree.parents),
                                  values=[x[3] for x in kept]))
        end = int(row[-2])
        path = tree.path(end - 1) if end else []
        seen = inspect_verify(logits[r, : len(tree) + 1], None, tokens[r, 1 : 1 + len(tree)],
                              list(tree.parents)) if run.inspect else None
        verified.append(Verified(path, int(row[-1]), seen))
        as_read.append(None if tree.is_chain() else tree)
    run.kv.keep_entries([[0] + [j + 1 for j in v.path] for v in verified])
    return width, features, proposals, as_read, verified
