"""A drafter that drafts nothing and records, row by row, the target features the engine hands to drafters (fp16, on
the CPU) with the target's greedy token at each position: what build_features would compute, kept while answering.
Knows the drafter seam and the model's output head; nothing of samples or files.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..drafters.base import Drafter, DraftRequest, Proposal, Verdict


class Recorder(Drafter):
    """Proposes no token; keeps each prompt's features (n, W) and greedy labels (n,) for every position the target
    has been fed. The features' first `hidden_size` columns are the final hidden state (engine.kv.target_features),
    whose product with the output head gives the label (also where the engine sampled another token)."""

    name = "recorder"
    needs_target_hidden = True

    def __init__(self, head: torch.nn.Module, hidden_size: int, layers: Sequence[int] = ()):
        self.head = head
        self.hidden_size = hidden_size
        self.target_layers = tuple(layers)

    def begin(self, prompts: Sequence[list[int]], target_hidden: Sequence[torch.Tensor] | None = None) -> None:
        if target_hidden is None:
            raise ValueError("Recorder needs the target's hidden states (needs_target_hidden)")
        self.rows = list(range(len(prompts)))  # batch position -> prompt index
        self.features: list[list[torch.Tensor]] = [[] for _ in prompts]
        self.top1: list[list[torch.Tensor]] = [[] for _ in prompts]
        self._record(self.rows, list(target_hidden))

    def propose(self, request: DraftRequest) -> list[Proposal]:
        return [Proposal([]) for _ in request.ids]

    def update(self, verdicts: Sequence[Verdict]) -> None:
        self._record(self.rows, [v.target_hidden for v in verdicts])

    def select(self, rows: Sequence[int]) -> None:
        self.rows = [self.rows[r] for r in rows]

    def _record(self, prompts: list[int], hidden: list[torch.Tensor]) -> None:
        """Append each prompt's features (m, W) and their labels: one product with the head for all rows."""
        labels = self.head(torch.cat([h[:, : self.hidden_size] for h in hidden])).argmax(-1).int().cpu()
        for i, h, top in zip(prompts, hidden, labels.split([len(h) for h in hidden])):
            self.features[i].append(h.half().cpu())
            self.top1[i].append(top)

    def recorded(self, prompt: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt `prompt`'s first n positions: (features (n, W) fp16, top1 (n,) int32)."""
        feats, top = torch.cat(self.features[prompt]), torch.cat(self.top1[prompt])
        if len(feats) < n:
            raise ValueError(f"prompt {prompt} has {len(feats)} recorded positions, not {n}")
        return feats[:n].clone(), top[:n].clone()
