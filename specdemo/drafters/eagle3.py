"""Drafting with an EAGLE-3 head (models.eagle3_head.Eagle3Head: ours or a published one) over the batch.

The head reads the target's hidden states (the final one, then the aux layers': engine.kv.target_features), chains
its own pre-norm output from one draft step to the next, and proposes over its draft vocabulary, mapped to target
ids by d2t, so q is zero outside it and rejection sampling stays exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import Runtime
from ..engine import graphs
from ..engine.kv import PAD, Slots, gather_slots, left_padded, right_padded
from ..engine.verify import generator_on, logits_to_probs, sample_active_rows, sample_rows
from ..models import kernels
from ..models.eagle3 import locate_eagle3, recorded_k
from ..models.eagle3_head import load_head
from ..models.placement import on_host, to_device
from .base import Chains, DeviceChains, DeviceTrees, Drafter, DraftRequest, Proposal
from .eagle3_device_tree import device_trees, draft_device_trees, grows_on_device, warm_trees
from .eagle3_static import StaticHeadKV, attach, new_head_kv
from .eagle3_tree import draft_sampled_trees, draft_trees

if TYPE_CHECKING:
    from ..models.eagle3_head import Eagle3Head


class EagerHeadKV:
    """The head's own keys and values (B, KV, L, D), grown by one concatenation per pass, with per-row slots
    (engine.kv.Slots: left padding and cut drafts are holes, compacted by one gather once they pile up). What the
    drafter uses while its head has no runner (eagle3_static: the static cache)."""

    pad_right = False  # the catch-up's rows end in the last column

    def __init__(self, head: Eagle3Head, rows: int, device: torch.device):
        self.head, self.device = head, device
        self.slots = Slots(rows, device)
        self.k = self.v = None  # (B, KV, L, D)

    @property
    def counts(self) -> list[int]:
        return self.slots.counts

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def run(self, hidden: torch.Tensor, tokens: torch.Tensor, real: torch.Tensor,
            positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (B, T, H), tokens (B, T) and real (B, T) bool (the host's) -> the pre-norm outputs (B, T, H), each
        row at its own positions, appended to the cache; a tree's pass gives positions (B, T) and mask (B, 1, T,
        L + T)."""
        real = real.to(self.device)
        positions = self.slots.positions(real) if positions is None else positions
        # mask None: no holes, nothing padded, the head's own causal attention (one row: always)
        if mask is None and not (bool(real.all()) and bool(self.slots.valid.all())):
            past, t = self.slots.length, tokens.shape[1]
            causal = torch.ones(t, past + t, dtype=torch.bool, device=self.device).tril(diagonal=past)
            mask = causal[None] & self.slots.mask(real)[:, None, :]  # (B, T, L + T)
            mask = (mask | ~mask.any(-1, keepdim=True))[:, None]  # a query with nothing to see reads garbage, not NaN
        out, k, v = self.head(hidden, tokens, positions, self.k, self.v, mask)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        self.slots.append(real)
        return out

    def keep(self, counts: list[int]) -> None:
        """Keep each row's first counts[r] entries (the rest become holes; columns no row holds are cut)."""
        self._crop(self.slots.keep(counts))

    def _crop(self, length: int) -> None:
        if self.k is not None and self.k.shape[2] > length:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]

    def select(self, rows) -> None:
        if self.k is not None:
            index = to_device(rows, self.device)
            self.k, self.v = self.k[index], self.v[index]
        self._crop(self.slots.select(rows))

    def compact(self) -> None:
        index = self.slots.compaction()
        if index is not None and self.k is not None:
            self.k, self.v = gather_slots(self.k, index), gather_slots(self.v, index)

    def visible(self) -> torch.Tensor:
        """(B, L) bool: the slots each row holds now."""
        return self.slots.valid.clone()

    def tree_columns(self, width: int) -> tuple[int, list[int]]:
        """Before a pass of `width` entries: the width of its mask and where each row's entries start."""
        return self.slots.length + width, [self.slots.length] * len(self.counts)

    def release(self) -> None:
        """Nothing to hand back."""


class Eagle3Drafter(Drafter):
    """Drafts with an Eagle3Head: its own keys and values with per-row positions, the midlayer over (embedding,
    hidden), the pre-norm output fed back. The cache is the head's runner's static one where the head has a runner
    (eagle3_static, chosen by --graphs: greedy chains then run every draft step with no host synchronisation, as
    CUDA graphs on a GPU), else EagerHeadKV.

    Between proposals the cache holds entries computed from true target features only; the entries of drafted
    features sit after `true_counts` and are cut at the next verdict. A row that another drafter served (the hybrid's
    lookup) keeps the target features of those passes pending and feeds them at its next proposal.

    With min_confidence > 0 a row stops drafting before a token whose draft probability (the top one under greedy,
    the sampled one's distribution peak under sampling) falls below it, as transformers'
    assistant_confidence_threshold does: on a CPU a wider verify pass costs more, and unsure drafts are rarely
    accepted. The first token is always proposed. The stop depends only on the draft's own state, so rejection
    sampling stays exact. num_speculative_tokens is the head's recorded k (None: the usual default); held_out_chain,
    from training's last held-out evaluation, the chance its first / first two drafted tokens are the target's.
    """

    name = "eagle3"
    needs_target_hidden = True
    drafts_trees = True  # EAGLE-2's dynamic tree (eagle3_tree): top candidates when greedy, drawn ones when sampling

    def __init__(self, head: Eagle3Head, num_speculative_tokens: int | None = None, min_confidence: float = 0.0,
                 held_out_chain: tuple[float, float] | None = None):
        self.head = head
        self.target_layers = head.target_layers  # the engine passes these layers' hidden states too
        self.num_speculative_tokens = num_speculative_tokens
        self.min_confidence = min_confidence
        self.held_out_chain = held_out_chain
        self.device = head.norm.weight.device
        self.dtype = head.norm.weight.dtype
        self.confidences: list[list[float]] = []  # per row: the peak draft probability of each proposed token
        self.kv: EagerHeadKV | StaticHeadKV | None = None  # the cache of the current batch (begin)

    def begin(self, prompts, target_hidden=None) -> None:
        if target_hidden is None:
            raise ValueError("Eagle3Drafter needs the target's hidden states (needs_target_hidden)")
        self._new_cache(prompts)
        self.pending: list[torch.Tensor | None] = list(target_hidden)  # true features not yet fed, (m, W)
        self.true_counts: list[int] | None = None  # counts after the last catch-up pass: the true entries

    def _new_cache(self, prompts) -> None:
        """The cache of a batch of these prompts, in place of the last one (the same call takes the same storage)."""
        if self.kv is not None:
            self.kv.release()
        self.kv = new_head_kv(self.head, prompts) or EagerHeadKV(self.head, len(prompts), self.device)

    def warm(self, prompts, request: DraftRequest | None = None) -> None:
        """Capture the greedy chains of the request's k and fewer, the catch-up widths (HeadRunner.warm) for this
        batch's padded size and the smaller rungs, over the storage begin(prompts) takes next, and the greedy tree
        growth the request asks for (eagle3_device_tree.warm_trees); nothing without capture."""
        runner = graphs.runner_of(self.head)
        if runner is not None and runner.capture:
            self._new_cache(prompts)
            greedy = request is not None and request.sampling.greedy
            runner.warm(self.kv, len(prompts), k=max(request.ks, default=0) if greedy else 0,
                        chain=(self.min_confidence, request.eos_token_ids) if greedy else (0.0, frozenset()))
            if request is not None and any(request.nodes(r) for r in range(len(prompts))):
                warm_trees(self, request)

    @property
    def cache_length(self) -> int:
        return self.kv.length

    def _pass(self, hidden: torch.Tensor, tokens: torch.Tensor, real: torch.Tensor,
              positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (B, T, H), tokens (B, T) (the token after each hidden state's position), real (B, T) bool on the
        host -> what the next draft step reads, (B, T, H): the midlayer's pre-norm output, each row at its own
        positions. A draft tree's pass gives its entries' positions (B, T) and mask (B, 1, T, columns) (eagle3_tree,
        kv.tree_columns)."""
        return self.kv.run(hidden, tokens, real, positions, mask)

    def _drop_drafted(self) -> None:
        if self.true_counts is not None:
            self.kv.keep(self.true_counts)
            self.true_counts = None

    def _catch_up(self, ids, ks) -> torch.Tensor:
        """Feed each row its pending true features, paired with the token that follows each position; returns the
        last output of each row (B, H), what its first draft step reads."""
        rows = len(ids)
        feats, feeds = [], []
        for r in range(rows):
            pend = self.pending[r]
            m = 0 if pend is None else len(pend)
            n = self.kv.counts[r]
            if n + m != len(ids[r]) - 1:
                raise ValueError(f"draft state of row {r} covers {n + m} positions but the request has "
                                 f"{len(ids[r]) - 1}")
            if ks[r] > 0 and m == 0:
                raise ValueError(f"row {r} has no new target features to draft from")
            feats.append(pend)
            feeds.append(ids[r][n + 1:])
        right = self.kv.pad_right
        tok, real = (right_padded if right else left_padded)(feeds, torch.device("cpu"))  # real stays on the host
        t = tok.shape[1]
        width = next(f.shape[-1] for f in feats if f is not None)  # the engine's features: final and aux layers
        if rows == 1:
            x = feats[0][None].to(self.dtype)
        else:  # every row's features in one copy, each at its columns (a few kernels, not one per row)
            x = torch.zeros(rows, t, width, dtype=self.dtype, device=self.device)
            lens = [0 if f is None else len(f) for f in feats]
            if sum(lens):
                at = [(r, j + (0 if right else t - n)) for r, n in enumerate(lens) for j in range(n)]
                index = to_device(at, self.device).T  # (2, entries): row, column
                x[index[0], index[1]] = torch.cat([f for f in feats if f is not None and len(f)]).to(x)
        out = self._pass(self.head.prepare(x.to(self.device)), to_device(tok, self.device), real)
        self.pending = [None] * rows
        self.true_counts = list(self.kv.counts)
        if not right or len({len(f) for f in feeds}) == 1:  # every row's last entry in the last column
            return out[:, -1]  # (B, H)
        last = to_device([max(len(f) - 1, 0) for f in feeds], self.device)
        return out[torch.arange(rows, device=self.device), last]

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> list[Proposal]:
        ids, ks, sampling = request.ids, request.ks, request.sampling
        rows = len(ids)
        self.confidences = [[] for _ in range(rows)]
        if max(ks, default=0) <= 0:
            return [Proposal([]) for _ in range(rows)]
        self._drop_drafted()
        feature = self._catch_up(ids, ks)
        if any(request.nodes(r) for r in range(rows)):  # a dynamic tree
            if grows_on_device(self, request):
                return draft_device_trees(self, request, feature)
            return (draft_trees if sampling.greedy else draft_sampled_trees)(self, request, feature)
        if sampling.greedy and isinstance(self.kv, StaticHeadKV):
            return self._fixed_chains(self._device_chains(feature, request))
        chains, subset = Chains(request), self.head.subset
        gens = None if sampling.greedy else [generator_on(g, self.device) for g in request.generators]
        while True:
            active = chains.active
            logits = self.head.logits(feature)  # (B, S)
            q_sub = torch.softmax(logits.float(), -1) if sampling.greedy else logits_to_probs(logits, sampling)
            peak, top = q_sub.max(-1)
            peak = peak.tolist()
            for r in range(rows):  # unsure: stop before this token, before drawing it
                if active[r] and chains.tokens[r] and peak[r] < self.min_confidence:
                    active[r] = False
            if not any(active):
                break
            if sampling.greedy:
                index = top
            else:  # each active row from its own generator (torch.multinomial's draw), nothing read yet
                index = sample_active_rows(q_sub, gens, active, top)
            chosen = q_sub.gather(1, index[:, None])[:, 0]
            ids, chosen = torch.stack([subset[index].double(), chosen.double()]).tolist()  # one read a pass
            laws = None if sampling.greedy else self.head.spread(q_sub)  # (B, V): q over the target's vocabulary
            for r in range(rows):
                if not active[r]:
                    continue
                self.confidences[r].append(peak[r])
                chains.q_tokens[r].append(chosen[r])
                chains.add(r, int(ids[r]), None if laws is None else laws[r])
            if not any(chains.active):
                break
            step_tok = to_device([[t[-1] if a else PAD] for t, a in zip(chains.tokens, chains.active)], self.device)
            feature = self._pass(feature[:, None], step_tok, on_host([[a] for a in chains.active]))[:, -1]
        return chains.proposals()

    def propose_on_device(self, request: DraftRequest) -> DeviceChains | DeviceTrees | None:
        """Greedy chains over the static cache, or trees where they grow on the device (eagle3_device_tree; under
        --tree auto cut by cost there, within the node budget the engine's pass is sized for), left there
        (_device_chains, device_trees) for the engine to verify and read back with its verdict; None where propose()
        drafts (sampled or host-grown trees, the eager cache, nothing to draft). Sampled chains too
        (_sampled_device_chains). `confidences` stays empty: nothing is read."""
        rows = len(request.ids)
        trees = any(request.nodes(r) for r in range(rows))
        if (not isinstance(self.kv, StaticHeadKV) or max(request.ks, default=0) <= 0
                or (trees and (not request.sampling.greedy or not grows_on_device(self, request)))):
            return None
        self.confidences = [[] for _ in range(rows)]
        self._drop_drafted()
        feature = self._catch_up(request.ids, request.ks)
        if trees:
            return device_trees(self, request, feature)
        return (self._device_chains if request.sampling.greedy else self._sampled_device_chains)(feature, request)

    def _device_chains(self, feature: torch.Tensor, request: DraftRequest) -> DeviceChains:
        """max(k) draft steps for every row, one fixed shape with no host synchronisation between them
        (StaticHeadKV.chain), and on the device each row's length: up to its own k, up to and including an end of
        sequence, and before its first token under min_confidence (the first is always proposed), as the eager loop
        stops (Chains.add)."""
        return DeviceChains(*self.kv.chain(feature, request.ks, self.min_confidence,
                                           request.eos_token_ids))  # (B, k) twice, (B,)

    def _sampled_device_chains(self, feature: torch.Tensor, request: DraftRequest) -> DeviceChains:
        """max(k) sampled draft steps for every row with no host read between them: each row draws from its own
        generator (verify.sample_rows) over the head's draft vocabulary, its q spread over the target's (zero
        outside the subset, so rejection sampling stays exact), and the next step fed every row's token; lengths on
        the device as the eager loop stops a row (DeviceChains.cut: k, an end of sequence, and before a step whose
        distribution peaks under min_confidence, the first always drafted)."""
        rows, subset = feature.shape[0], self.head.subset
        gens = [generator_on(g, self.device) for g in request.generators]
        every = torch.ones(rows, 1, dtype=torch.bool)  # real, on the host: every row feeds its token
        tokens, q_tokens, peaks, dists = [], [], [], []  # per step: (B,), (B,), (B,), (B, V)
        for i in range(max(request.ks)):
            if i:
                feature = self._pass(feature[:, None], tokens[-1][:, None], every)[:, -1]
            q_sub = logits_to_probs(self.head.logits(feature), request.sampling)  # (B, S)
            index = sample_rows(q_sub, gens)
            tokens.append(subset[index])
            q_tokens.append(q_sub.gather(1, index[:, None])[:, 0])
            peaks.append(q_sub.max(-1).values)
            dists.append(self.head.spread(q_sub))
        sure = torch.stack(peaks, 1).double() >= self.min_confidence  # compared as the eager loop compares
        sure[:, 0] = True
        return DeviceChains.cut(torch.stack(tokens, 1), torch.stack(q_tokens, 1).double(), request, sure,
                                torch.stack(dists, 1))

    def _fixed_chains(self, chains: DeviceChains) -> list[Proposal]:
        """Device chains read back in one copy of tokens, q and lengths, as proposals."""
        k = chains.tokens.shape[1]
        read = torch.cat([chains.tokens.double(), chains.q, chains.lengths[:, None].double()], 1).tolist()
        out = []
        for r, row in enumerate(read):
            n = int(row[-1])
            self.confidences[r] = row[k : k + n]
            out.append(Proposal([int(t) for t in row[:n]], None, row[k : k + n]))
        return out

    def update(self, verdicts) -> None:
        self._drop_drafted()
        for r, v in enumerate(verdicts):
            if v.target_hidden is None:
                raise ValueError("Eagle3Drafter needs the target's hidden states in the verdict")
            hidden = v.target_hidden.to(self.dtype)
            self.pending[r] = hidden if self.pending[r] is None else torch.cat([self.pending[r], hidden])
        self.kv.compact()

    def select(self, rows) -> None:
        self._drop_drafted()
        self.kv.select(rows)
        self.pending = [self.pending[r] for r in rows]
        self.kv.compact()


def load_eagle3(spec: str | Path, target_loaded, runtime: Runtime = Runtime()) -> Eagle3Drafter:
    """An Eagle3Drafter from a checkpoint folder or hub id, bound to the target in a loading.LoadedModel; its draft
    steps run as runtime.graphs says (eagle3_static.attach: as the target's passes do, the same --graphs)."""
    folder = locate_eagle3(str(spec), runtime) or Path(spec)
    head, meta = load_head(folder, target_loaded.model)
    fast = getattr(target_loaded, "fast_linear", True)
    if fast and kernels.enabled_for(head.norm.weight.device, head.norm.weight.dtype):
        kernels.patch_linears(head, native=getattr(target_loaded, "native", None))
    attach(head, runtime.graphs)
    chain = (meta.get("metrics") or {}).get("chain") or []
    return Eagle3Drafter(head, recorded_k(folder), float(meta.get("min_confidence", 0.0)),
                         tuple(chain[:2]) if len(chain) >= 2 else None)
