"""An EAGLE-3 head's static KV cache and its graph runner: the head's keys and values in buffers allocated once, at
fixed addresses, each row holding its positions 0..len-1 with no holes (engine.static.StaticRows: lengths on the
device and the host, rollback = a length change), and its greedy chain of k draft steps captured as one CUDA graph
per padded batch size and k (an engine.graphs.Runner of its own), as are the catch-up after a verdict and a draft
tree's level passes.
Chosen with the target's `--graphs` (attach); on a CPU, `on` runs the same code uncaptured. Knows the head module,
not the drafter's bookkeeping (drafters.eagle3)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..engine import graphs
from ..engine.graphs import Captured, Runner, padded_batch
from ..engine.static import CAPACITY_STEP, CAPTURED, StaticRows, rounded_capacity
from ..models.eagle3_head import Eagle3Head
from ..models.placement import staged, to_device
from .base import chain_lengths, eos_on
from .eagle3_tree import FRONTIER

CATCH_UP_WIDTH = 17  # the widest catch-up pass captured (a verdict's accepted tokens and the pending one, k <= 16)
LEVEL_WIDTH = FRONTIER  # the widest tree level captured (eagle3_tree feeds at most FRONTIER nodes a row per depth)


def top_token(head: Eagle3Head, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Head outputs (B, H) -> the greedy draft token (B,) as a target id, and its draft probability (B,) (the peak
    of q: what min_confidence reads)."""
    q = torch.softmax(head.logits(out).float(), -1)  # (B, S)
    peak, index = q.max(-1)
    return head.to_target(index), peak


class HeadStorage:
    """The static buffers of up to `rows` rows and `capacity` positions of one head: keys and values (rows, KV,
    capacity, D), each row's length (the device tensor the passes read), and the input buffers that captured passes
    read (a greedy chain's: a feature per row). Graphs captured over it replay against these addresses."""

    def __init__(self, head: Eagle3Head, rows: int, capacity: int):
        c, weight = head.c, head.norm.weight
        self.head, self.rows, self.capacity, self.device = head, rows, capacity, weight.device
        shape = (rows, c.num_key_value_heads, capacity, c.head_dim)
        self.keys = torch.zeros(shape, dtype=weight.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=weight.dtype, device=self.device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=self.device)  # (rows,)
        self.slots = torch.arange(capacity, device=self.device)  # (capacity,)
        self.feature = torch.zeros(rows, c.hidden_size, dtype=weight.dtype, device=self.device)  # a chain's input
        self.ks = torch.zeros(rows, dtype=torch.long, device=self.device)  # each row's k, for a chain's lengths
        self.ks_held: tuple[int, ...] = ()  # what self.ks holds (copied again only when it changes)
        # the catch-up's inputs (a verdict's features, prepared, and the tokens that follow them), right-padded
        self.hidden = torch.zeros(rows, CATCH_UP_WIDTH, c.hidden_size, dtype=weight.dtype, device=self.device)
        self.tokens = torch.zeros(rows, CATCH_UP_WIDTH, dtype=torch.long, device=self.device)
        # a tree level's inputs (eagle3_tree._expand's): each entry's parent output, token, position and mask; each
        # entry sees at least its own slot, so a padded row attends to something (all-masked rows would give NaN)
        self.level_hidden = torch.zeros(rows, LEVEL_WIDTH, c.hidden_size, dtype=weight.dtype, device=self.device)
        self.level_tokens = torch.zeros(rows, LEVEL_WIDTH, dtype=torch.long, device=self.device)
        self.level_positions = torch.zeros(rows, LEVEL_WIDTH, dtype=torch.long, device=self.device)
        self.level_mask = torch.zeros(rows, 1, LEVEL_WIDTH, capacity, dtype=torch.bool, device=self.device)
        self.level_mask[:, 0, range(LEVEL_WIDTH), range(LEVEL_WIDTH)] = True
        self.trees: dict = {}  # (b, E) -> a tree growth's static inputs (HeadRunner.tree)
        self.busy = False  # held by one drafter at a time
        self.released = 0  # when it was last released (Runner.acquire takes the latest first)
        self.graphs: dict = {}  # (b,) -> engine.graphs.Captured: the step at that padded batch size

    def buffers(self) -> list[torch.Tensor]:
        """The keys and values (rows, KV, capacity, D): rows at dim -4, as engine.static.Storage.buffers gives them."""
        return [self.keys, self.values]

    def copy_rows(self, other: HeadStorage, rows: int) -> None:
        """Hold the first `rows` rows of another storage (a smaller one's), position for position."""
        n = min(self.capacity, other.capacity)
        self.keys[:rows, :, :n] = other.keys[:rows, :, :n]
        self.values[:rows, :, :n] = other.values[:rows, :, :n]

    def run(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor | None = None,
            mask: torch.Tensor | None = None, offset: int = 0) -> torch.Tensor:
        """A head pass of the first b rows: hidden (b, T, H), tokens (b, T), right-padded; row r's j-th entry is
        written at slot lengths[r] + offset + j, at that position and seeing the slots up to it unless `positions`
        (b, T) and `mask` (b, 1, T, capacity) say otherwise (a draft tree's). The pre-norm outputs (b, T, H); lengths
        stay."""
        b, t = tokens.shape
        write = self.lengths[:b, None] + offset + self.slots[None, :t]  # (b, T)
        positions = write if positions is None else positions
        if mask is None:
            mask = (self.slots[None, None, :] <= write[:, :, None])[:, None]  # (b, 1, T, capacity)
        return self.head(hidden, tokens, positions, self.keys[:b], self.values[:b], mask, write)[0]

    def catch_up(self, b: int, t: int) -> torch.Tensor:
        """The catch-up pass of the first b rows from the input buffers (hidden (b, t, H), tokens (b, t)), each row's
        entries at its length on: the pre-norm outputs (b, t, H). Lengths are not moved."""
        return self.run(self.hidden[:b, :t], self.tokens[:b, :t])

    def level(self, b: int, t: int) -> torch.Tensor:
        """A draft tree's level pass of the first b rows from the level buffers (t entries a row, each at its given
        position and mask): the pre-norm outputs (b, t, H). Lengths are not moved."""
        return self.run(self.level_hidden[:b, :t], self.level_tokens[:b, :t], self.level_positions[:b, :t],
                        self.level_mask[:b, :, :t])

    def chain(self, b: int, k: int, min_confidence: float = 0.0,
              eos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k greedy draft tokens of the first b rows from the catch-up's output in the feature buffer (b, H): the
        first from it, each other from one draft step fed the token before it, step i's entry written at the row's
        length plus i. Returns the tokens (b, k) as target ids, each one's q (b, k, float64) and each row's length
        (b,): up to its k (the ks buffer), up to and including an end of sequence (eos: the ids as
        drafters.base.eos_on holds them), before its first token under min_confidence (the first always), as the
        eager loop stops (drafters.base.chain_lengths). Straight-line tensor code over fixed buffers (what one graph
        captures); lengths are not moved."""
        feature = self.feature[:b]
        token, peak = top_token(self.head, feature)
        tokens, peaks = [token], [peak]
        for i in range(k - 1):
            feature = self.run(feature[:, None], token[:, None], offset=i)[:, 0]
            token, peak = top_token(self.head, feature)
            tokens.append(token)
            peaks.append(peak)
        tokens, q = torch.stack(tokens, 1), torch.stack(peaks, 1).double()  # compared as the eager loop compares
        sure = q >= min_confidence
        sure[:, 0] = True
        return tokens, q, chain_lengths(tokens, sure, self.ks[:b], eos)

    def set_ks(self, ks: Sequence[int]) -> None:
        """Each row's k into the ks buffer (a copy to the device only when they change)."""
        if tuple(ks) != self.ks_held:
            self.ks[: len(ks)].copy_(staged(list(ks), self.ks.device), non_blocking=True)
            self.ks_held = tuple(ks)


CAPTURED.extend([(HeadStorage, "run"), (HeadStorage, "chain")])


@dataclass
class HeadRunner(Runner):
    """How a head's passes run: over HeadStorages it pools, captured per padded batch size (on CUDA) and width: its
    greedy chain (one graph per k), the catch-up after a verdict (up to CATCH_UP_WIDTH) and a draft tree's level
    passes (up to LEVEL_WIDTH); every other pass (sampled chains, wider ones) eagerly over the same buffers."""

    refusal = staticmethod(graphs.why_not_here)  # any head on any device can take the static cache

    def new_storage(self, rows: int, capacity: int) -> HeadStorage:
        return HeadStorage(self.model, rows, capacity)

    def chain(self, storage: HeadStorage, feature: torch.Tensor, ks: Sequence[int], min_confidence: float,
              eos: frozenset[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """HeadStorage.chain of len(feature) rows from feature (b, H), max(ks) tokens: one graph replay where it
        captures (the batch padded to the ladder, a graph per k, confidence stop and end of sequence ids), else the
        same code eagerly. Outputs are the caller's own."""
        b, k = len(feature), max(ks)
        storage.feature[:b].copy_(feature)
        storage.set_ks(ks)
        key = (padded_batch(b), k, "chain", min_confidence, eos)
        done = self._captured(storage, key) if self.capture else None
        return storage.chain(b, k, min_confidence, eos_on(eos, storage.device)) if done is None else done.replay(b)

    def catch_up(self, storage: HeadStorage, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """HeadStorage.catch_up of these inputs (hidden (b, t, H), tokens (b, t), right-padded): a graph replay per
        padded batch and width where it captures (t up to CATCH_UP_WIDTH), else the same pass eagerly."""
        b, t = tokens.shape
        if not self.capture or t > CATCH_UP_WIDTH:
            return storage.run(hidden, tokens)
        storage.hidden[:b, :t].copy_(hidden)
        storage.tokens[:b, :t].copy_(tokens)
        done = self._captured(storage, (padded_batch(b), t))
        return storage.catch_up(b, t) if done is None else done.replay(b)[0]

    def tree_level(self, storage: HeadStorage, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
        """HeadStorage.run of a tree level (hidden (b, t, H), tokens and positions (b, t), mask (b, 1, t, capacity)):
        through the level buffers up to LEVEL_WIDTH entries (a graph replay per padded batch and width where it
        captures, else the same code eagerly: what the CPU tests check), wider ones eagerly."""
        b, t = tokens.shape
        if t > LEVEL_WIDTH:
            return storage.run(hidden, tokens, positions, mask)
        for buf, x in zip((storage.level_hidden, storage.level_tokens, storage.level_positions),
                          (hidden, tokens, positions)):
            buf[:b, :t].copy_(x, non_blocking=True)
        storage.level_mask[:b, :, :t].copy_(mask, non_blocking=True)
        done = self._captured(storage, (padded_batch(b), t, "level")) if self.capture else None
        return storage.level(b, t) if done is None else done.replay(b)[0]

    def tree(self, storage: HeadStorage, key: tuple, inputs, grow) -> tuple:
        """grow(storage, inputs) (eagle3_device_tree.grow: device code only, outputs (b, C) each) as one CUDA graph
        per padded batch size and `key` (k, how many end-of-sequence ids, the confidence stop) where this runner
        captures, its inputs copied into static ones (padding rows grow nothing); else eagerly. A growth that will not
        capture runs eagerly from then on, with one log line, and the head's other graphs stay."""
        b = inputs.ks.shape[0]
        if not self.capture:
            return grow(storage, inputs)
        bp = padded_batch(b)
        static = storage.trees.get((bp, len(inputs.eos)))
        if static is None:
            static = storage.trees[(bp, len(inputs.eos))] = inputs.blank(bp)
        static.load(inputs)
        return self.call(storage, (bp, *key), b, lambda: grow(storage, static),
                         f"the head's {bp}-row tree, {key[0]} deep")

    def warm(self, kv: StaticHeadKV, rows: int, widths: Sequence[int] = (1,), layers=None, k: int = 0,
             chain: tuple = (0.0, frozenset())) -> float:
        """Capture the greedy chains of k tokens and fewer (the last steps of an answer draft fewer; `chain`: their
        confidence stop and end of sequence ids), the catch-up widths and the tree levels' for `rows` rows and each
        smaller rung of the ladder (graphs.rungs: the batch sizes it runs at as rows finish) before a decode is timed;
        returns the seconds spent. Reads no target layers and takes the head's own widths (`widths`, `layers`: the
        target runner's)."""
        before = self.capture_seconds
        if self.capture:
            for b in graphs.rungs(rows):
                for n in range(k, 0, -1):
                    self._captured(kv.storage, (b, n, "chain", *chain))
                for t in range(CATCH_UP_WIDTH, 0, -1):  # a verdict's catch-up: its accepted tokens and one
                    self._captured(kv.storage, (b, t))
                for t in range(LEVEL_WIDTH, 0, -1):
                    self._captured(kv.storage, (b, t, "level"))
        return self.capture_seconds - before

    def _capture(self, storage: HeadStorage, b: int, t: int, kind: str = "catch-up", *chain) -> Captured:
        """Capture, at batch size b, the catch-up pass of width t, a tree level of width t (kind "level") or a greedy
        chain of t tokens (kind "chain", `chain` its confidence stop and end of sequence ids); their runs write only
        at each row's length and on, past what any row holds."""
        if kind == "chain":
            min_confidence, eos = chain[0], eos_on(chain[1], storage.device)
            return self.record(storage.device, lambda: storage.chain(b, t, min_confidence, eos),
                               f"the head's {b}-row chain of {t}")
        if kind == "level":
            return self.record(storage.device, lambda: (storage.level(b, t),), f"the head's {b} x {t} tree level")
        return self.record(storage.device, lambda: (storage.catch_up(b, t),), f"the head's {b} x {t} catch-up")


def attach(head: Eagle3Head, mode: str = "auto") -> HeadRunner | None:
    """How the head's draft steps run under `--graphs mode` (engine.graphs.attach, with a HeadRunner), one log line."""
    return graphs.attach(head, mode, HeadRunner)


class StaticHeadKV(StaticRows):
    """The head's cache over a HeadStorage (what Eagle3Drafter uses while its head has a runner). Passes are
    right-padded: a row's real entries come first and its length grows by them; a padded entry writes past it, where
    nothing reads. Rollback and row selection are StaticRows'; compaction has nothing to do."""

    pad_right = True  # the catch-up's rows: real entries first

    @property
    def length(self) -> int:
        """The longest row's entries."""
        return max(self.counts, default=0)

    def run(self, hidden: torch.Tensor, tokens: torch.Tensor, real: torch.Tensor,
            positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """A pass (HeadStorage.run over hidden (B, T, H), tokens (B, T)); each row's length grows by its real entries
        (real (B, T) bool, the host's: nothing is read back). A chain's pass (no tree `positions` and `mask`) is the
        runner's catch-up, a tree's its level pass, both captured on CUDA. Returns the pre-norm outputs (B, T, H)."""
        fed = real.sum(1).tolist()
        self.reserve(tokens.shape[1])
        if positions is None and mask is None:
            out = self.runner.catch_up(self.storage, hidden, tokens)
        else:
            out = self.runner.tree_level(self.storage, hidden, tokens, positions, mask)
        self._advance(fed)
        return out

    def chain(self, feature: torch.Tensor, ks: Sequence[int], min_confidence: float = 0.0,
              eos: frozenset[int] = frozenset()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """max(ks) greedy draft tokens per row from the catch-up's outputs feature (B, H): the first from it, each
        other from one draft step, all in one call (HeadStorage.chain: one graph on CUDA), with no host
        synchronisation. Returns the tokens (B, k) as target ids, each one's q (B, k) and each row's length (B,)
        (its k, an end of sequence, the confidence stop); every step's entry stays in the cache past the row's true
        entries (the drafter cuts it at the next verdict)."""
        k = max(ks)
        self.reserve(k - 1)
        out = self.runner.chain(self.storage, feature, ks, min_confidence, eos)
        self.grew(k - 1)
        return out

    def drafted(self, width: int) -> None:
        """Every row's length grows by `width`: the entries a tree's growth wrote on the device past each row's length
        (eagle3_device_tree; cut at the next verdict)."""
        self.grew(width)

    def visible(self) -> torch.Tensor:
        """(B, capacity) bool: the slots each row holds now (a draft tree's pass sees these and its ancestors)."""
        return self.storage.slots[None, :] < to_device(self.counts, self.device)[:, None]

    def tree_columns(self, width: int) -> tuple[int, list[int]]:
        """Before a pass of `width` entries: the width of its mask (the capacity) and where each row's entries start
        (its length)."""
        self.reserve(width)
        return self.storage.capacity, list(self.counts)


def new_head_kv(head: Eagle3Head, prompts: Sequence[list[int]]) -> StaticHeadKV | None:
    """The head's static cache for a batch of these prompts (room for each plus CAPACITY_STEP answer tokens; it grows
    if outrun) when the head has a runner (attach), else None: the drafter's eager cache serves."""
    runner = graphs.runner_of(head)
    if runner is None:
        return None
    capacity = rounded_capacity(max(map(len, prompts), default=0) + CAPACITY_STEP + 1)
    return StaticHeadKV(runner, runner.acquire(len(prompts), capacity), len(prompts))
