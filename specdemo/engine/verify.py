"""Acceptance rules as pure tensor functions, and what the step inspector reads from a verify pass.

Names follow Leviathan et al. 2023 (Alg. 1) and Sun et al. 2025 (Alg. 2): `p` is the target's distribution, `q` the
draft's. Shapes: k drafted tokens, V vocabulary; target rows are k + 1 (the last one gives the bonus token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import SamplingConfig
from ..models.placement import to_device
from .events import TOP_N, Inspection


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


def one_hot_rows(tokens: torch.Tensor, vocab: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(..., n) token ids as (..., n, vocab) one-hot q rows (a deterministic draft's law), on their device."""
    return torch.zeros(*tokens.shape, vocab, dtype=dtype, device=tokens.device).scatter_(-1, tokens[..., None], 1.0)


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Keep draft tokens while they equal the target's argmax. (k,), (k+1, V) -> (num_accepted, next_token)."""
    target_choice = target_logits.argmax(dim=-1)  # (k+1,)
    k = draft_tokens.shape[0]
    matches = (draft_tokens == target_choice[:k]).int()
    num_accepted = int(matches.cumprod(dim=0).sum()) if k else 0
    return num_accepted, int(target_choice[num_accepted])


def greedy_verdicts(drafted: torch.Tensor, lengths: torch.Tensor,
                     logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device: (num_accepted (B,), next token (B,)) for drafted (B, W-1) with lengths (B,) real drafts."""
    choice = logits.argmax(-1)  # (B, W)
    w = drafted.shape[1]
    real = torch.arange(w, device=drafted.device)[None, :] < lengths[:, None]
    matches = ((drafted == choice[:, :w]) & real).int()
    accepted = matches.cumprod(dim=1).sum(dim=1)  # (B,)
    return accepted, choice.gather(1, accepted[:, None])[:, 0]


def greedy_accept_batch(drafted: torch.Tensor, lengths: torch.Tensor,
                        logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """greedy_accept for every row at once: drafted (B, W-1) with lengths (B,) real drafts, logits (B, W, V)
    -> (num_accepted per row, next token per row)."""
    accepted, nxt = torch.stack(greedy_verdicts(drafted, lengths, logits)).tolist()  # one read back, not two
    return accepted, nxt


def read_chains(accepted: torch.Tensor, nxt: torch.Tensor, drafted: torch.Tensor, lengths: torch.Tensor,
                q: torch.Tensor) -> tuple[list[int], list[int], list[list[int]], list[list[float]]]:
    """The verdicts (B,) of chains still on the device (drafters.base.DeviceChains) read back in one copy with the
    chains themselves: (num_accepted, next token, each row's drafted tokens, their q)."""
    table = torch.cat([torch.stack([accepted, nxt, lengths], 1), drafted], 1).double()  # ids are exact in float64
    k = drafted.shape[1]
    read = torch.cat([table, q.double()], 1).tolist()  # the step's one read back from the device
    n = [int(row[2]) for row in read]
    return ([int(row[0]) for row in read], [int(row[1]) for row in read],
            [[int(t) for t in row[3 : 3 + m]] for row, m in zip(read, n)],
            [row[3 + k : 3 + k + m] for row, m in zip(read, n)])


def sample_rows(probs: torch.Tensor, generators) -> torch.Tensor:
    """One token id per row of (B, V) distributions, row r drawn from generators[r], left on the device: the
    exponential race argmax(p / E), E ~ Exp(1), which is what torch.multinomial(p, 1) draws for one sample (the same
    token from the same generator state) without its host-side check of p."""
    races = torch.stack([torch.empty_like(row).exponential_(generator=g) for row, g in zip(probs, generators)])
    return (probs / races).argmax(-1)


def sample_active_rows(probs: torch.Tensor, generators, active: Sequence[bool], fill: torch.Tensor) -> torch.Tensor:
    """sample_rows for the rows marked active, fill's entry (B,) elsewhere, left on the device: a row not drawing
    moves no generator (each active row's token is torch.multinomial's draw from its generator's state)."""
    return torch.stack([sample_rows(probs[r : r + 1], [g])[0] if a else fill[r]
                        for r, (a, g) in enumerate(zip(active, generators))])


def row_uniforms(counts: list[int], width: int, generators, device: torch.device) -> torch.Tensor:
    """(B, width) draws in [0, 1): row r's first counts[r] from generators[r], the rest 1.0 (past a row's drafts)."""
    rows = [torch.rand(n, generator=g, device=device) for n, g in zip(counts, generators)]
    return torch.stack([torch.cat([r, torch.ones(width - len(r), device=device)]) for r in rows])


def rejection_accept_rows(drafted: torch.Tensor, lengths: torch.Tensor, draft_probs: torch.Tensor | None,
                          target_probs: torch.Tensor, generators, draws: list[int]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al. Alg. 1 for every row at once, on the device with nothing read back: accept x_i with
    min(1, p/q); at the first rejection sample norm(max(0, p - q)); after a full acceptance, the bonus ~ p.

    drafted (B, n) with lengths (B,) real drafts (a row's past its length are padding, never accepted); draft_probs
    (B, n, V), or None for a deterministic drafter (q one-hot at the drafted token); target_probs (B, n + 1, V); row r
    draws draws[r] >= its length uniforms, then its next token, from generators[r]. Returns (num_accepted (B,), next
    token (B,))."""
    rows, n = drafted.shape
    p = target_probs
    u = row_uniforms(draws, n, generators, p.device)  # (B, n)
    px = p[:, :n].gather(2, drafted[..., None])[..., 0]  # (B, n)
    qx = torch.ones_like(px) if draft_probs is None else draft_probs.gather(2, drafted[..., None])[..., 0]
    real = torch.arange(n, device=p.device)[None, :] < lengths[:, None]
    accepted = ((u * qx <= px) & real).long().cumprod(1).sum(1)  # u < p/q accepts; no division, so q == 0 is safe
    at = accepted[:, None, None].expand(rows, 1, p.shape[-1])
    p_at = p.gather(1, at)[:, 0]  # (B, V): the row after the last accepted draft
    if n == 0:
        return accepted, sample_rows(p_at, generators)
    at = at.clamp(max=n - 1)
    if draft_probs is None:  # max(0, p - onehot) zeroes only the drafted token
        residual = p_at.scatter(1, drafted.gather(1, at[:, :, 0]), 0.0)
    else:
        residual = (p_at - draft_probs.gather(1, at)[:, 0]).clamp(min=0)
    # after a full acceptance the bonus comes from p; p == q up to rounding leaves no residual: any sample from p
    from_p = (accepted == lengths) | (residual.sum(-1) <= 0)
    residual = torch.where(from_p[:, None], p_at.to(residual.dtype), residual)
    return accepted, sample_rows(residual / residual.sum(-1, keepdim=True), generators)


def draft_rows_batch(drafted: torch.Tensor, qs: Sequence[torch.Tensor | None],
                     like: torch.Tensor) -> torch.Tensor | None:
    """Each row's q as one (B, n, V) tensor for rejection_accept_rows, drafted (B, n): a drafter's own rows (zero past
    them), one-hot at the drafted tokens for a deterministic row (which max(0, p - q) and min(1, p / q) treat as q =
    None does); None when no row has its own. `like` gives the device and dtype."""
    if all(q is None for q in qs):
        return None
    rows, n = drafted.shape
    out = one_hot_rows(drafted, like.shape[-1], like.dtype)
    for r, q in enumerate(qs):
        if q is not None:
            m = min(len(q), n)
            out[r, :m] = q[:m].to(like.device, like.dtype)
            out[r, m:] = 0
    return out


def rejection_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """rejection_accept_rows for one row, read back: draft_tokens (k,); draft_probs (k, V) or None for a
    deterministic drafter; target_probs (k+1, V). Returns (num_accepted, next_token)."""
    return _one_row(rejection_accept_rows, draft_tokens, draft_probs, target_probs, generator)


def _one_row(rule, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
             generator: torch.Generator | None) -> tuple[int, int]:
    """A batched rule (ROW_RULES' arguments) on one row's block, read back: (num_accepted, next_token)."""
    k = draft_tokens.shape[0]
    lengths = torch.full((1,), k, device=target_probs.device)
    q = None if draft_probs is None else draft_probs[None]
    accepted, nxt = rule(draft_tokens[None].to(target_probs.device), lengths, q, target_probs[None], [generator], [k])
    accepted, nxt = torch.stack([accepted, nxt]).tolist()
    return accepted[0], nxt[0]


def _draft_rows(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, vocab: int,
                dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """q as (..., k, V) rows: the drafter's own, or one-hot at the drafted tokens (..., k) for a deterministic
    drafter."""
    return draft_probs if draft_probs is not None else one_hot_rows(draft_tokens, vocab, dtype)


def block_thresholds_rows(drafted: torch.Tensor, lengths: torch.Tensor, q: torch.Tensor,
                          target_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sun et al. Alg. 2's weights and thresholds for every row's block at once, on the device: drafted (B, n) with
    lengths (B,) real drafts, q (B, n, V) the draft rows (one-hot at a deterministic row's tokens), target_probs
    (B, n + 1, V) -> (weights p_0..p_n (B, n + 1), thresholds h_1..h_n (B, n); a row's h at its own length is p
    there, Alg. 2's h_k = p_k; past its length they mean nothing). Pure: no draws."""
    rows, n = drafted.shape
    w = [torch.ones(rows, dtype=torch.float64, device=target_probs.device)]  # Alg. 2: p_0 = 1
    if n == 0:
        return w[0][:, None], w[0][:, None][:, :0]
    px = target_probs[:, :n].gather(2, drafted[..., None])[..., 0].double()
    qx = q.gather(2, drafted[..., None])[..., 0].double()
    ratio = (px / qx).nan_to_num(0.0)  # 0/0 -> 0
    for i in range(n):  # Alg. 2, the weights: p_i = min(p_{i-1} * p(x_i | x^{i-1}) / q(x_i | x^{i-1}), 1)
        w.append(torch.where(w[-1] > 0, (w[-1] * ratio[:, i]).clamp(max=1.0), 0.0))
    w = torch.stack(w, 1)  # (B, n + 1)
    # Alg. 2, the thresholds for i < k, looking one row ahead: h_i = r_i / (r_i + 1 - p_i),
    # r_i = sum_x max(p_i p(x | x^i) - q(x | x^i), 0)
    mass = target_probs[:, 1:n].to(torch.float64, copy=True).mul_(w[:, 1:n, None]).sub_(q[:, 1:n]).clamp_(min=0)
    mass = mass.sum(-1)  # (B, n-1), in place on one copy
    denom = mass + 1.0 - w[:, 1:n]
    h = torch.where(denom > 0, mass / denom.clamp(min=1e-300), torch.ones_like(mass))  # p == q: h = 1 (as vLLM)
    last = torch.arange(n, device=h.device)[None, :] == (lengths.to(h.device) - 1)[:, None]
    return w, torch.where(last, w[:, 1:], torch.cat([h, w[:, n:]], 1))  # and h_k = p_k for a row's last draft


def block_thresholds(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """block_thresholds_rows for one drafted block: (k,), (k, V) or None, (k+1, V) -> (weights p_0..p_k (k+1,),
    thresholds h_1..h_k (k,))."""
    k = draft_tokens.shape[0]
    q = _draft_rows(draft_tokens, draft_probs, target_probs.shape[-1])
    w, h = block_thresholds_rows(draft_tokens[None], torch.full((1,), k, device=target_probs.device), q[None],
                                 target_probs[None])
    return w[0], h[0]


def block_accept_rows(drafted: torch.Tensor, lengths: torch.Tensor, draft_probs: torch.Tensor | None,
                      target_probs: torch.Tensor, generators, draws: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sun et al. 2025 ("Block Verification Accelerates Speculative Decoding", Alg. 2) for every row at once, on the
    device with nothing read back: each block is accepted up to tau, the last i with eta_i <= h_i, and the next token
    is drawn from norm(max(p_tau p - q, 0)), or from p after a full block. Arguments and return as
    rejection_accept_rows (row r draws draws[r] >= its length etas, then its next token, from generators[r]); the
    output follows p exactly."""
    rows, n = drafted.shape
    p, vocab = target_probs, target_probs.shape[-1]
    eta = row_uniforms(draws, n, generators, p.device)  # (B, n), Alg. 2: eta_i ~ U(0, 1); 1.0 past a row's draws
    q = _draft_rows(drafted, draft_probs, vocab, p.dtype)  # (B, n, V)
    w, h = block_thresholds_rows(drafted, lengths, q, p)
    if n == 0:
        return lengths.new_zeros(rows), sample_rows(p[:, 0], generators)
    # Alg. 2: tau = the last i with eta_i <= h_i, else 0 (eta in [0, 1): `<` has the same odds and h = 0 never passes)
    real = torch.arange(n, device=p.device)[None, :] < lengths[:, None]
    tau = (((eta.double() < h) & real).long() * torch.arange(1, n + 1, device=p.device)).amax(1)  # (B,)
    p_tau = p.gather(1, tau[:, None, None].expand(rows, 1, vocab))[:, 0]  # (B, V)
    q_tau = q.gather(1, tau.clamp(max=n - 1)[:, None, None].expand(rows, 1, vocab))[:, 0]  # q(. | x^tau)
    # Alg. 2, tau < k: y ~ norm(max(p_tau p(. | x^tau) - q(. | x^tau), 0)); p_tau p <= q everywhere only by rounding:
    # then any sample from p is exact
    residual = p_tau.to(torch.float64, copy=True).mul_(w.gather(1, tau[:, None])).sub_(q_tau).clamp_(min=0)
    residual = torch.where((residual.sum(-1) <= 0)[:, None], p_tau.double(), residual)
    # Alg. 2, tau = k: the whole block is kept; the bonus token comes from p after it
    full = (tau == lengths)[:, None]
    return tau, sample_rows(torch.where(full, p_tau, (residual / residual.sum(-1, keepdim=True)).float()), generators)


def block_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """block_accept_rows for one drafted block, read back. Same arguments and return as rejection_accept."""
    return _one_row(block_accept_rows, draft_tokens, draft_probs, target_probs, generator)


def expected_accepted(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                      target_probs: torch.Tensor) -> dict[str, float]:
    """Each rule's expected number of accepted drafts given this drafted block (bonus not counted), exactly:
    token-wise sum_i prod_{j<=i} min(1, p_j / q_j); block sum_i i P(tau = i), P(tau = i) = h_i prod_{j>i} (1 - h_j).
    Averaged over blocks the drafter samples, each is that rule's expected accepted length."""
    k = draft_tokens.shape[0]
    if k == 0:
        return {"token": 0.0, "block": 0.0}
    q = _draft_rows(draft_tokens, draft_probs, target_probs.shape[-1])
    rows = torch.arange(k, device=target_probs.device)
    ratio = (target_probs[rows, draft_tokens].double() / q[rows, draft_tokens].double()).nan_to_num(0.0)
    token = float(ratio.clamp(max=1.0).cumprod(0).sum())
    _, h = block_thresholds(draft_tokens, draft_probs, target_probs)
    later = torch.cat([(1 - h).flip(0).cumprod(0).flip(0)[1:], h.new_ones(1)])  # prod_{j>i} (1 - h_j)
    block = float((torch.arange(1, k + 1, device=h.device, dtype=h.dtype) * h * later).sum())
    return {"token": token, "block": block}


# SamplingConfig.verification -> its rule for every row at once, on the device (rejection_accept_rows' arguments)
ROW_RULES = {"token": rejection_accept_rows, "block": block_accept_rows}


def sampled_accept_batch(drafted: torch.Tensor, lengths: list[int], qs: list[torch.Tensor | None],
                         target_probs: torch.Tensor, generators, rule: str = "token") -> tuple[list[int], list[int]]:
    """The sampled verdicts of every row of a verify pass at once under `rule` (ROW_RULES), read back in one copy:
    drafted (B, W-1) with lengths[r] real drafts, qs each row's draft distributions (None: a deterministic drafter),
    target_probs (B, W, V). Each row draws from its own generator what the one-row rule (rejection_accept,
    block_accept) would draw for it alone."""
    lengths_t = to_device(lengths, target_probs.device)
    verdicts = ROW_RULES[rule](drafted, lengths_t, draft_rows_batch(drafted, qs, target_probs), target_probs,
                               generators, lengths)
    accepted, nxt = torch.stack(verdicts).tolist()
    return accepted, nxt


def inspect_verify(logits: torch.Tensor, target_probs: torch.Tensor | None, drafted: torch.Tensor,
                   parents: list[int] | None = None) -> Inspection:
    """A StepEvent's Inspection from one row of a verify pass: logits (k+1, V); target_probs (k+1, V) when
    sampling, None when greedy (then p is the softmax at temperature 1); drafted (k,). One topk, no extra pass.
    A tree's (parents: each node's parent node, -1 the pending token): the top tokens after each entry, and p of each
    node's token after its parent."""
    k, n = drafted.shape[0], min(TOP_N, logits.shape[-1])
    at = torch.arange(k) if parents is None else torch.tensor(parents, dtype=torch.long) + 1
    rows = at.to(logits.device)  # the entry each drafted token was chosen after
    if target_probs is None:
        logits = logits.float()
        top = torch.topk(logits, n, dim=-1)  # (k+1, n)
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (k+1, 1)
        top_probs, token_probs = (top.values - lse).exp(), (logits[rows, drafted] - lse[rows, 0]).exp()
        gap = top.values[:, 0] - top.values[:, 1] if n > 1 else torch.zeros_like(lse[:, 0])
    else:
        top = torch.topk(target_probs, n, dim=-1)
        top_probs, token_probs, gap = top.values, target_probs[rows, drafted], None
    floats = torch.cat([top_probs.flatten(), token_probs] + ([gap] if gap is not None else [])).tolist()
    m = top_probs.numel()
    return Inspection(top.indices.tolist(), [floats[i : i + n] for i in range(0, m, n)], floats[m : m + k],
                      floats[m + k :])
