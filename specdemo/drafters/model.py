"""A draft causal LM over the batch, with its own KV cache (engine.graphs.new_kv: static or eager) rolled back per
row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..engine import graphs
from ..engine.kv import check_cache
from ..engine.static import CAPACITY_STEP, CAPTURED, StaticKV, Storage, needed_capacity
from ..engine.verify import generator_on, logits_to_probs, sample_active_rows, sample_rows
from ..models.placement import staged
from .base import Chains, DeviceChains, Drafter, DraftRequest, Proposal, chain_lengths, eos_on


@dataclass
class ChainInputs:
    """What a draft LM's greedy chain over one static storage reads, at fixed addresses (kept in Storage.inputs, with
    the graphs): the logits its first token comes from (rows, V) and each row's k (rows,); `held`: the ks it holds."""

    logits: torch.Tensor
    ks: torch.Tensor
    held: tuple[int, ...] = ()

    @classmethod
    def of(cls, storage: Storage, logits: torch.Tensor) -> ChainInputs:
        """The storage's chain inputs, made at its first chain (logits: any (B, V) of the draft's)."""
        if (inputs := storage.inputs.get(cls)) is None:
            inputs = storage.inputs[cls] = cls(logits.new_zeros(storage.rows, logits.shape[-1]),
                                               torch.zeros(storage.rows, dtype=torch.long, device=storage.device))
        return inputs

    def load(self, logits: torch.Tensor, ks: Sequence[int]) -> None:
        """The first logits (b, V) and each row's k (copied only when they change)."""
        self.logits[: len(logits)].copy_(logits)
        if tuple(ks) != self.held:
            self.ks[: len(ks)].copy_(staged(list(ks), self.ks.device), non_blocking=True)
            self.held = tuple(ks)

    def chain(self, run, storage: Storage, b: int, k: int,
              eos: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k greedy tokens of the first b rows: the first the argmax of the logits buffer, each other the argmax of a
        one-token pass (run: the runner's, engine.graphs.Runner.run) fed the one before it, pass i's entry written
        at the row's length plus i. Returns the tokens (b, k), each one's q (b, k, float64) and each row's length (b,):
        up to its k and an end of sequence (eos: drafters.base.eos_on's ids), as Chains.add stops a row.
        Straight-line tensor code over fixed buffers (what one graph captures); lengths are not moved."""
        logits, tokens, q = self.logits[:b], [], []
        for i in range(k):
            if i:
                storage.input_view(b, 1).copy_(tokens[-1][:, None])
                logits = run(storage, b, 1, 1, None, i - 1)[0][:, -1]
            index = logits.argmax(-1)  # (b,), and its q as ModelDrafter._passes computes it
            tokens.append(index)
            q.append(torch.softmax(logits.float(), -1).gather(1, index[:, None])[:, 0])
        tokens = torch.stack(tokens, 1)
        return tokens, torch.stack(q, 1).double(), chain_lengths(tokens, None, self.ks[:b], eos)


CAPTURED.append((ChainInputs, "chain"))


class ModelDrafter(Drafter):
    """A smaller causal LM sharing the target's tokenizer, its cache rolled back exactly to each row's accepted prefix.

    Each proposal is one catch-up pass (each row feeds what its cache lacks: 1 or 2 tokens after a verdict, more
    after a hybrid's lookup steps) and then one single-token pass per drafted position; the last drafted token is
    never fed (the next verdict decides whether it stays). Greedy chains keep each pass's argmax on the device and
    feed it to the next pass (over a static cache all in one call, ChainInputs.chain: one graph where the runner
    captures), every row drafting max(k) tokens, and read tokens and q back once; what a row drafted
    past its stop (its k, an end of sequence) is dropped on the host, and its cache entries are cut at the next
    verdict. Sampled chains draw each token on the host (propose: a row that stopped feeds a hole) or, left on the
    device (propose_on_device), from each row's generator there, every row drafting max(k) as greedy chains do.
    """

    name = "model"

    def __init__(self, model: torch.nn.Module, target_device: torch.device | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.target_device = target_device or self.device
        self.kv = None  # the cache of the current batch (begin)
        # after a greedy proposal: each row's cache length through its proposed chain (the last token never counts:
        # it is not fed), the most a verdict keeps; the entries past it are what the row drafted past its stop
        self.chain_counts: list[int] | None = None

    def _new_cache(self, prompts) -> None:
        """The cache of a batch of these prompts, in place of the last one: the model's runner's static cache (it
        grows if the answer outruns it) or the eager engine's. The same call gives the same storage again."""
        check_cache(self.model, len(prompts))
        if self.kv is not None:
            graphs.release(self.kv)
        self.kv = graphs.new_kv(self.model, len(prompts), needed_capacity(prompts, CAPACITY_STEP, 0))
        self.chain_counts = None

    def begin(self, prompts, target_hidden=None) -> None:
        self._new_cache(prompts)

    def warm(self, prompts, request=None) -> None:
        """Capture the catch-up widths after a verdict (1 and 2) and, greedy, the chains of the request's k and fewer
        for this batch and each smaller rung, over the storage that begin(prompts) takes next; nothing without
        capture."""
        runner = graphs.runner_of(self.model)
        if runner is not None and runner.capture:
            self._new_cache(prompts)
            runner.warm(self.kv, len(prompts), (1, 2))
            if request is not None and request.sampling.greedy:  # its chains of k and fewer, at each rung
                logits = torch.zeros(1, self.model.lm_head.out_features, device=self.device, dtype=self.model.dtype)
                ChainInputs.of(self.kv.storage, logits)
                for b in graphs.rungs(len(prompts)):
                    for k in range(max(request.ks, default=0), 0, -1):
                        self._chain_call(b, k, request.eos_token_ids)

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> list[Proposal]:
        ids = request.ids
        if max(request.ks, default=0) <= 0:
            return [Proposal([]) for _ in ids]
        chains, logits = Chains(request), self._catch_up(ids)
        if request.sampling.greedy:
            self._greedy(chains, logits, request)
        else:
            self._sampled(chains, logits, request)
        return chains.proposals()

    @torch.inference_mode()
    def propose_on_device(self, request: DraftRequest) -> DeviceChains | None:
        """Chains left on the device (_passes, lengths as Chains.add stops a row) for the engine to verify and read
        back with its verdict: greedy, or sampled with each row's own generator (the target's device only: another
        device's generator would be seeded by a read); None with nothing to draft. Every row's fed tokens are its own
        chain, so a verdict's keep() cuts them right (no chain_counts)."""
        if max(request.ks, default=0) <= 0 or (not request.sampling.greedy and self.device != self.target_device):
            return None
        logits = self._catch_up(request.ids)
        if request.sampling.greedy and isinstance(self.kv, StaticKV):
            return DeviceChains(*self._static_chain(logits, request))
        tokens, q, probs = self._passes(logits, max(request.ks), request)
        return DeviceChains.cut(tokens, q, request, probs=probs)

    def _static_chain(self, logits: torch.Tensor,
                      request: DraftRequest) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Greedy chains over the static cache from the catch-up's logits (B, V), max(ks) tokens a row, in one call
        (ChainInputs.chain: one graph replay where the runner captures): tokens (B, k), their q (B, k) and each row's
        length (B,). Every row's cache grows by k - 1 entries, on the device."""
        k = max(request.ks)
        self.kv.reserve(k - 1)  # first: the storage may grow
        ChainInputs.of(self.kv.storage, logits).load(logits, request.ks)
        out = self._chain_call(len(logits), k, request.eos_token_ids)
        self.kv.grew(k - 1)
        return out

    def _chain_call(self, b: int, k: int, eos: frozenset[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ChainInputs.chain of b rows from the inputs as loaded: a graph per padded batch, k and end-of-sequence
        ids where the runner captures, else eagerly."""
        runner, storage = self.kv.runner, self.kv.storage
        n = graphs.padded_batch(b) if runner.capture else b
        inputs, eos_ids = storage.inputs[ChainInputs], eos_on(eos, storage.device)
        return runner.call(storage, (n, k, "chain", eos), b, lambda: inputs.chain(runner.run, storage, n, k, eos_ids),
                           f"a draft LM's {n}-row chain of {k}")

    def _catch_up(self, ids) -> torch.Tensor:
        """Feed each row what its cache lacks (after cutting what the last greedy proposal fed past its chain): the
        logits (B, V) at each row's pending token, what its first drafted token comes from."""
        self._cut()
        return self.kv.step([row[n:] for row, n in zip(ids, self.kv.counts)])

    def _passes(self, logits: torch.Tensor, k: int, request: DraftRequest
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """k tokens for every row, each pass fed the last one's on the device, with no host read between them (a
        graph replay per pass where the runner captures): greedy the argmax, sampled a draw from each row's own
        generator (verify.sample_rows). Returns tokens (B, k), their q (B, k) float64, and when sampled the
        distributions drawn from (B, k, V), else None."""
        sampling = request.sampling
        gens = None if sampling.greedy else [generator_on(g, self.device) for g in request.generators]
        tokens, q_tokens, rows = [], [], []  # per pass, (B,), (B,), (B, V)
        for i in range(k):
            if i:
                x = tokens[-1][:, None]  # (B, 1): every row feeds one token
                logits = self.kv.forward(x, torch.ones_like(x, dtype=torch.bool), 1, fed=[1] * len(x))[0][:, -1]
            if sampling.greedy:
                probs = torch.softmax(logits.float(), -1)
                index = logits.argmax(-1)  # (B,)
            else:
                probs = logits_to_probs(logits, sampling)
                index = sample_rows(probs, gens)
                rows.append(probs)
            tokens.append(index)
            q_tokens.append(probs.gather(1, index[:, None])[:, 0])
        return torch.stack(tokens, 1), torch.stack(q_tokens, 1).double(), torch.stack(rows, 1) if rows else None

    def _greedy(self, chains: Chains, logits: torch.Tensor, request: DraftRequest) -> None:
        """_passes, then one read of tokens and q, and each row keeps its chain up to its own k or end of sequence
        (Chains.add)."""
        start = list(self.kv.counts)
        if isinstance(self.kv, StaticKV):
            tokens, q, _ = self._static_chain(logits, request)
        else:
            tokens, q, _ = self._passes(logits, max(request.ks), request)
        chain_tokens, q = torch.stack([tokens.double(), q]).tolist()  # (B, k) each
        for r, (row_tokens, row_q) in enumerate(zip(chain_tokens, q)):
            for token, q_token in zip(row_tokens, row_q):
                if not chains.active[r]:
                    break
                chains.q_tokens[r].append(q_token)
                chains.add(r, int(token))
        self.chain_counts = [n + max(len(t) - 1, 0) for n, t in zip(start, chains.tokens)]

    def _sampled(self, chains: Chains, logits: torch.Tensor, request: DraftRequest) -> None:
        """One token per active row and pass, drawn from its own generator; q of each read back once at the end."""
        rows = range(len(request.ids))
        gens = [generator_on(g, self.device) for g in request.generators]
        q_steps: list[torch.Tensor] = []  # per drafting pass, (B,): q of each row's token
        drafting: list[list[bool]] = []  # per drafting pass: which rows drafted in it
        while True:
            active = chains.active
            q = logits_to_probs(logits, request.sampling)  # (B, V)
            picks = sample_active_rows(q, gens, active, torch.zeros(len(rows), dtype=torch.long, device=q.device))
            choice = picks.tolist()  # the pass's one read
            q_steps.append(q.gather(1, picks[:, None])[:, 0])
            drafting.append(list(active))
            for r in rows:
                if active[r]:
                    chains.add(r, choice[r], q[r].to(self.target_device))
            if not any(chains.active):
                break
            logits = self.kv.step([[t[-1]] if a else [] for t, a in zip(chains.tokens, chains.active)])
        for values, was_active in zip(torch.stack(q_steps).tolist(), drafting):
            for r in rows:
                if was_active[r]:
                    chains.q_tokens[r].append(values[r])

    def _cut(self) -> None:
        """Drop the entries a greedy proposal fed past each row's proposed chain (propose or select before a
        verdict)."""
        if self.chain_counts is not None:
            self.kv.keep(self.chain_counts)
            self.chain_counts = None

    def update(self, verdicts) -> None:
        # the cache holds committed ids plus drafted tokens; keep the part the target agreed with (not its own token),
        # never past what the proposal drafted: a row the hybrid's lookup served proposed nothing here, and the
        # tokens a greedy chain fed past a row's stop are not what was committed
        counts, self.chain_counts = self.chain_counts or self.kv.counts, None
        self.kv.keep([min(n, len(v.ids) - 1) for n, v in zip(counts, verdicts)])

    def select(self, rows) -> None:
        self._cut()
        self.kv.select(rows)
