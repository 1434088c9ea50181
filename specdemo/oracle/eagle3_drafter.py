"""Eagle3Drafter: drafting with an EAGLE-3 head (specdemo.eagle3.Eagle3Head) one sequence at a time.

The head reads the target's hidden states (the final one, then the aux layers': engine.target_features), chains its
own pre-norm output from one draft step to the next, and proposes over its draft vocabulary, mapped to target ids by
d2t, so q is zero outside it and rejection sampling stays exact. batch_drafters.BatchEagle3 is the batched form.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .drafters import Drafter, DraftRequest, Proposal, Verdict
from ..engine.verify import generator_on, logits_to_probs

if TYPE_CHECKING:
    from .eagle3 import Eagle3Head


class Eagle3Drafter(Drafter):
    """Drafts with an Eagle3Head; its KV cache holds entries from true target features only, between proposals.

    With min_confidence > 0 it stops drafting before a token whose draft probability (the top one under greedy, the
    sampled one's distribution peak under sampling) falls below it, as transformers' assistant_confidence_threshold
    does: on a CPU a wider verify pass costs more, and unsure drafts are rarely accepted. The first token is always
    proposed. The stop depends only on the draft's own state, so rejection sampling stays exact.

    num_speculative_tokens is the head's recorded k (None: the usual default).
    """

    name = "eagle3"
    needs_target_hidden = True

    def __init__(self, head: Eagle3Head, num_speculative_tokens: int | None = None, min_confidence: float = 0.0,
                 held_out_chain: tuple[float, float] | None = None):
        self.head = head
        self.target_layers = head.target_layers  # the engine passes these layers' hidden states too
        self.num_speculative_tokens = num_speculative_tokens
        self.min_confidence = min_confidence
        # from training's last held-out evaluation: the chance its first / first two drafted tokens are the target's
        self.held_out_chain = held_out_chain
        self.confidences: list[float] = []  # the peak draft probability of each token of the last proposal
        self.k = self.v = None
        self.num_true = 0  # cache entries computed from true target features (positions 0 .. num_true - 1)
        self.pending: torch.Tensor | None = None  # true features (m, W) for positions num_true .. num_true + m - 1
        self.last_true: torch.Tensor | None = None  # the last true feature fed, to redo a proposal without update

    @property
    def cache_length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def begin(self, prompt_ids: list[int], target_hidden: torch.Tensor | None = None) -> None:
        if target_hidden is None:
            raise ValueError("Eagle3Drafter needs the target's hidden states (needs_target_hidden)")
        self.k = self.v = None
        self.num_true = 0
        self.pending = target_hidden
        self.last_true = None

    def _crop(self, length: int) -> None:
        if self.k is not None and self.k.shape[2] > length:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]

    def _step(self, hidden: torch.Tensor, tokens: list[int], start: int) -> torch.Tensor:
        """Feed hidden states (T, H) and their following tokens at positions start.. ; return the last output (the
        pre-norm state the next step reads back and the logits read through the head's norm)."""
        weight = self.head.norm.weight  # the head's device and dtype
        tok = torch.tensor([tokens], device=weight.device)
        pos = torch.arange(start, start + len(tokens), device=weight.device)
        out, k, v = self.head(hidden[None].to(weight.device, weight.dtype), tok, pos, self.k, self.v)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return out[0, -1]

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Proposal:
        ids, sampling = request.ids, request.sampling
        if request.k <= 0:
            return Proposal([])
        self._crop(self.num_true)
        if self.pending is None or len(self.pending) == 0:  # proposed twice without an update: redo the last entry
            self.num_true -= 1
            self._crop(self.num_true)
            self.pending = self.last_true
        m = len(self.pending)
        if self.num_true + m != len(ids) - 1:
            raise ValueError(f"draft state covers {self.num_true + m} positions but the request has {len(ids) - 1}")
        weight = self.head.norm.weight
        feature = self._step(self.head.prepare(self.pending.to(weight.device, weight.dtype)), ids[self.num_true + 1 :],
                             self.num_true)
        self.num_true += m
        self.last_true, self.pending = self.pending[-1:], None
        tokens, probs, token_probs = [], [], []
        self.confidences = []
        subset = self.head.subset
        gen = None if sampling.greedy else generator_on(request.generator, weight.device)  # once per proposal
        for j in range(request.k):
            logits = self.head.logits(feature)  # (S,)
            q_sub = torch.softmax(logits.float(), -1) if sampling.greedy else logits_to_probs(logits, sampling)
            confidence = float(q_sub.max())
            if j > 0 and confidence < self.min_confidence:
                break
            self.confidences.append(confidence)
            if sampling.greedy:
                token = int(subset[int(torch.argmax(logits))])
                token_probs.append(confidence)  # q(x) of the argmax: the softmax's peak
            else:
                index = int(torch.multinomial(q_sub, 1, generator=gen))
                token = int(subset[index])
                token_probs.append(float(q_sub[index]))
                q = torch.zeros(self.head.c.vocab_size, dtype=q_sub.dtype, device=q_sub.device)
                probs.append(q.index_copy_(0, subset, q_sub))
            tokens.append(token)
            if token in request.eos_token_ids or j == request.k - 1:
                break
            feature = self._step(feature[None], [token], len(ids) - 1 + j)
        return Proposal(tokens, torch.stack(probs) if probs else None, token_probs)

    def update(self, verdict: Verdict) -> None:
        if verdict.target_hidden is None:
            raise ValueError("Eagle3Drafter needs the target's hidden states in the verdict")
        self._crop(self.num_true)  # drop entries computed from drafted features
        if self.pending is not None:  # no proposal since the last verdict (another drafter proposed): keep both
            self.pending = torch.cat([self.pending, verdict.target_hidden.to(self.pending.dtype)])
        else:
            self.pending = verdict.target_hidden
