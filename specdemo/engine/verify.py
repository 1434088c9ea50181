"""Acceptance rules as pure tensor functions, and what the step inspector reads from a verify pass.

Names follow Leviathan et al. 2023 (Alg. 1): `p` is the target's distribution, `q` the draft's.
Shapes: k drafted tokens, V vocabulary; target rows are k + 1 (the last one gives the bonus token); B rows in a batch.
"""

from __future__ import annotations

import torch

from ..config import SamplingConfig
from .events import TOP_N


def logits_to_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then softmax: (..., V) -> (..., V). Used identically for p and q."""
    logits = logits.float() / max(sampling.temperature, 1e-5)
    vocab = logits.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # drop a token when the mass before it already reaches top_p; the most likely token always stays
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def generator_on(generator: torch.Generator | None, device: torch.device | str) -> torch.Generator | None:
    """`generator` itself when it lives on `device`, else a generator there seeded from it, so a draft on another
    device than the target (or the engine's generator) still samples reproducibly from the run's seed."""
    device = torch.device(device)
    if generator is None or generator.device == device:
        return generator
    own = torch.Generator(device=device)
    own.manual_seed(int(torch.randint(2**62, (1,), generator=generator, device=generator.device)))
    return own


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from a (V,) distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


def choose(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    """The next token from (V,) logits: argmax when greedy, else a sample from the processed distribution."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    return sample(logits_to_probs(logits, sampling), generator)


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Keep draft tokens while they equal the target's argmax. (k,), (k+1, V) -> (num_accepted, next_token)."""
    target_choice = target_logits.argmax(dim=-1)  # (k+1,)
    k = draft_tokens.shape[0]
    matches = (draft_tokens == target_choice[:k]).int()
    num_accepted = int(matches.cumprod(dim=0).sum()) if k else 0
    return num_accepted, int(target_choice[num_accepted])


def greedy_accept_batch(drafted: torch.Tensor, lengths: torch.Tensor,
                        logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """greedy_accept for every row at once: drafted (B, W-1) with lengths (B,) real drafts, logits (B, W, V)
    -> (num_accepted per row, next token per row)."""
    choice = logits.argmax(-1)  # (B, W)
    w = drafted.shape[1]
    real = torch.arange(w, device=drafted.device)[None, :] < lengths[:, None]
    matches = ((drafted == choice[:, :w]) & real).int()
    accepted = matches.cumprod(dim=1).sum(dim=1)  # (B,)
    nxt = choice.gather(1, accepted[:, None])[:, 0]
    return accepted.tolist(), nxt.tolist()


def rejection_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Leviathan et al. Alg. 1: accept x_i with min(1, p/q); on rejection sample norm(max(0, p - q)); else bonus ~ p.

    draft_tokens (k,); draft_probs (k, V) or None for a deterministic drafter (q is one-hot at the drafted token);
    target_probs (k+1, V). Returns (num_accepted, next_token).
    """
    k = draft_tokens.shape[0]
    rows = torch.arange(k, device=target_probs.device)
    p = target_probs[rows, draft_tokens]  # (k,)
    q = draft_probs[rows, draft_tokens] if draft_probs is not None else torch.ones_like(p)
    r = torch.rand(k, generator=generator, device=target_probs.device)
    rejected = (r * q > p).nonzero()  # r < p/q accepts; written without division so q == 0 cannot blow up
    if rejected.numel() == 0:
        return k, sample(target_probs[k], generator)  # all accepted: the bonus token comes from p
    i = int(rejected[0])
    if draft_probs is not None:
        residual = (target_probs[i] - draft_probs[i]).clamp(min=0)
    else:
        residual = target_probs[i].clone()
        residual[draft_tokens[i]] = 0.0  # max(0, p - onehot) zeroes only the drafted token
    if float(residual.sum()) <= 0:  # p == q up to rounding: any sample from p is exact
        residual = target_probs[i]
    return i, sample(residual / residual.sum(), generator)


def inspect_verify(logits: torch.Tensor, target_probs: torch.Tensor | None, drafted: torch.Tensor) -> dict:
    """StepEvent's target_* fields from one row of a verify pass: logits (k+1, V); target_probs (k+1, V) when
    sampling, None when greedy (then p is the softmax at temperature 1); drafted (k,). One topk, no extra pass."""
    k, n = drafted.shape[0], min(TOP_N, logits.shape[-1])
    rows = torch.arange(k, device=logits.device)
    if target_probs is None:
        logits = logits.float()
        top = torch.topk(logits, n, dim=-1)  # (k+1, n)
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (k+1, 1)
        top_probs, token_probs = (top.values - lse).exp(), (logits[rows, drafted] - lse[:k, 0]).exp()
        gap = top.values[:, 0] - top.values[:, 1] if n > 1 else torch.zeros_like(lse[:, 0])
    else:
        top = torch.topk(target_probs, n, dim=-1)
        top_probs, token_probs, gap = top.values, target_probs[rows, drafted], None
    floats = torch.cat([top_probs.flatten(), token_probs] + ([gap] if gap is not None else [])).tolist()
    m = top_probs.numel()
    return {"target_top_ids": top.indices.tolist(),
            "target_top_probs": [floats[i : i + n] for i in range(0, m, n)],
            "target_token_probs": floats[m : m + k], "target_top2_gap": floats[m + k :]}
