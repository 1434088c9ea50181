"""A draft causal LM over the batch, with its own KV cache (engine.graphs.new_kv: static or eager) rolled back per
row."""

from __future__ import annotations

import torch

from ..engine import graphs
from ..engine.kv import check_cache
from ..engine.static import CAPACITY_STEP, needed_capacity
from ..engine.verify import generator_on, logits_to_probs
from .base import Chains, Drafter, DraftRequest, Proposal


class ModelDrafter(Drafter):
    """A smaller causal LM sharing the target's tokenizer, its cache rolled back exactly to each row's accepted prefix.

    Each proposal is one catch-up pass (each row feeds what its cache lacks: 1 or 2 tokens after a verdict, more
    after a hybrid's lookup steps) and then one single-token pass per drafted position, rows that stopped drafting
    feeding a hole; the last drafted token is never fed (the next verdict decides whether it stays).
    """

    name = "model"

    def __init__(self, model: torch.nn.Module, target_device: torch.device | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.target_device = target_device or self.device
        self.kv = None  # the cache of the current batch (begin)

    def begin(self, prompts, target_hidden=None) -> None:
        check_cache(self.model, len(prompts))
        if self.kv is not None:
            graphs.release(self.kv)
        # the model's runner's static cache (it grows if the answer outruns it) or the eager engine's
        self.kv = graphs.new_kv(self.model, len(prompts), needed_capacity(prompts, CAPACITY_STEP, 0))

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> list[Proposal]:
        ids, sampling = request.ids, request.sampling
        if max(request.ks, default=0) <= 0:
            return [Proposal([]) for _ in ids]
        chains, rows = Chains(request), range(len(ids))
        q_steps: list[torch.Tensor] = []  # per drafting pass, (B,): q of each row's token, read back once at the end
        drafting: list[list[bool]] = []  # per drafting pass: which rows drafted in it
        gens = None if sampling.greedy else [generator_on(g, self.device) for g in request.generators]
        logits = self.kv.step([row[n:] for row, n in zip(ids, self.kv.counts)])  # (B, V)
        while True:
            active = chains.active
            if sampling.greedy:
                q, index = torch.softmax(logits.float(), -1), logits.argmax(-1)  # (B, V), (B,)
                choice = index.tolist()
            else:
                q = logits_to_probs(logits, sampling)  # (B, V)
                choice = [int(torch.multinomial(q[r], 1, generator=gens[r])) if active[r] else 0 for r in rows]
                index = torch.tensor(choice, device=q.device)
            q_steps.append(q.gather(1, index[:, None])[:, 0])
            drafting.append(list(active))
            for r in rows:
                if active[r]:
                    chains.add(r, choice[r], None if sampling.greedy else q[r].to(self.target_device))
            if not any(chains.active):
                break
            logits = self.kv.step([[t[-1]] if a else [] for t, a in zip(chains.tokens, chains.active)])
        for values, was_active in zip(torch.stack(q_steps).tolist(), drafting):
            for r in rows:
                if was_active[r]:
                    chains.q_tokens[r].append(values[r])
        return chains.proposals()

    def update(self, verdicts) -> None:
        # the cache holds committed ids plus drafted tokens; keep the part the target agreed with (not its own token)
        agreed = [min(n, len(v.ids) - 1) for n, v in zip(self.kv.counts, verdicts)]
        self.kv.keep(agreed)

    def select(self, rows) -> None:
        self.kv.select(rows)
