"""What the engine hands out: one StepEvent per row per step, grouped in a BatchEvent per target pass; the rules
that commit tokens (EOS, stop strings, length); prompt encoding and request checks.

Text comes from text.IncrementalDetokenizer only to honour stop strings and to hand each event its text delta.
No models, no metrics beyond per-step timings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..config import GenerationConfig
from .text import IncrementalDetokenizer, find_stop

TOP_N = 5  # the target's most likely tokens recorded at each verified position, for the app's step inspector


class GenerationError(ValueError):
    """Bad input to the engine (empty prompt, absurd k, ...); the message says what to change."""


@dataclass
class Inspection:
    """What the step inspector reads from one row's verify pass, at each verified position i = 0..len(drafted) (the
    last one is where the bonus comes from), from the pass's own logits: the target's TOP_N tokens and their
    probabilities p (the processed distribution that rejection sampling uses; softmax at temperature 1 when greedy),
    p(x_i) of each drafted token, and when greedy the top-2 logit gap (empty when sampling)."""

    top_ids: list[list[int]]
    top_probs: list[list[float]]
    token_probs: list[float]
    top2_gap: list[float]


@dataclass
class StepEvent:
    """One row's part of one engine step. `elapsed` is the run's own compute time so far, excluding time paused at
    `yield`; draft_seconds and verify_seconds are the step's (shared by every row of a batch)."""

    kind: str  # "prefill" (first token), "ar" (one target pass, one token) or "spec" (draft + verify)
    tokens: list[int]  # tokens committed by this step (after EOS / stop / length truncation)
    text: str  # text delta for those tokens (empty when the run was asked for no text)
    elapsed: float
    num_generated: int  # this row's committed new tokens after this step
    drafted: list[int] = field(default_factory=list)  # spec: the proposal, in order (a tree's nodes)
    num_accepted: int = 0  # spec: drafted[:num_accepted] were kept (a tree: the nodes of accepted_path)
    correction: int | None = None  # spec: the target's token replacing drafted[num_accepted] (a tree: a child of
    # the path's last node, or of the pending token)
    bonus: int | None = None  # spec: the target's extra token after a full acceptance (a tree: a path to a leaf)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    k: int = 0  # k asked of the drafter for this row this step
    finish_reason: str | None = None  # "eos", "stop" or "length" on the row's last event
    target_cache_length: int = 0  # the row's positions in the target's KV cache after the step (rollback checks)
    inspection: Inspection | None = None  # spec, when the run inspects: what the verify pass said (Inspection)
    draft_token_probs: list[float] | None = None  # spec: q(x_i) of each drafted token; None: deterministic (q = 1)
    draft_source: str | None = None  # spec: where the proposal came from (Proposal.source)
    verification: str | None = None  # spec: the rule that decided the step: "greedy", "token" or "block"
    parents: list[int] | None = None  # spec: a draft tree's parent of each drafted node (-1: the pending token);
    # None: a chain
    accepted_path: list[int] | None = None  # spec, a tree: the accepted nodes (indices into drafted), root to leaf

    @property
    def target_top_ids(self) -> list[list[int]]:
        return self.inspection.top_ids if self.inspection else []

    @property
    def target_top_probs(self) -> list[list[float]]:
        return self.inspection.top_probs if self.inspection else []

    @property
    def target_top2_gap(self) -> list[float]:
        return self.inspection.top2_gap if self.inspection else []

    @property
    def target_token_probs(self) -> list[float]:
        return self.inspection.token_probs if self.inspection else []

    @property
    def accepted(self) -> list[int]:
        """The drafted tokens that were kept, in order (a tree's along its accepted path)."""
        if self.accepted_path is None:
            return self.drafted[: self.num_accepted]
        return [self.drafted[j] for j in self.accepted_path]

    @property
    def rejected(self) -> list[int]:
        """Drafted tokens that were thrown away (a chain's first one is replaced by `correction`; a tree's are its
        nodes off the accepted path, in order)."""
        if self.accepted_path is None:
            return self.drafted[self.num_accepted :]
        on = set(self.accepted_path)
        return [t for j, t in enumerate(self.drafted) if j not in on]

    @property
    def rejected_branch(self) -> list[int]:
        """The rejected drafts that read as text where the target's correction goes: a chain's rejected tail; for a
        tree the branch below its last accepted node, first children down (what the chain of its first choices there
        proposed). The text panel shows these; a tree's other rejected nodes are in its inspector."""
        if self.accepted_path is None or self.parents is None:
            return self.rejected
        node, out = self.accepted_path[-1] if self.accepted_path else -1, []
        while (child := self.first_child(node)) is not None:
            out.append(self.drafted[child])
            node = child
        return out

    def first_child(self, node: int) -> int | None:
        """A tree step's first drafted child of `node` (-1: the pending token), or None."""
        return next((j for j, a in enumerate(self.parents or ()) if a == node), None)


@dataclass
class BatchEvent:
    """One engine step over the rows still decoding: `steps[i]` is row `rows[i]`'s StepEvent (rows are prompt
    indices). `elapsed` is the run's own compute time so far, excluding time paused at `yield`."""

    kind: str  # "prefill", "ar" or "spec"
    rows: list[int]
    steps: list[StepEvent]
    elapsed: float
    num_generated: int  # committed new tokens over all rows after this step
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    k: int = 0  # the largest k asked of the drafter this step (0: no speculation)
    width: int = 1  # tokens per row in the target pass (1 + the longest proposal)

    @property
    def tokens(self) -> list[list[int]]:
        return [s.tokens for s in self.steps]

    @property
    def text(self) -> list[str]:
        return [s.text for s in self.steps]

    @property
    def drafted(self) -> list[list[int]]:
        return [s.drafted for s in self.steps]

    @property
    def num_accepted(self) -> list[int]:
        return [s.num_accepted for s in self.steps]

    @property
    def finished(self) -> dict[int, str]:
        """prompt index -> "eos", "stop" or "length" for the rows this step finished."""
        return {i: s.finish_reason for i, s in zip(self.rows, self.steps) if s.finish_reason}

    @property
    def cache_counts(self) -> list[int]:
        return [s.target_cache_length for s in self.steps]


class Committer:
    """Appends one row's tokens one at a time, stopping at EOS, a stop string or max_new_tokens, with the text delta
    of what it kept (the detokenizer only when `text` is asked for or stop strings need it: at a batch of 64 on a
    GPU, two decodes per row per step would cost a sixth of a step, which generate() does not pay)."""

    def __init__(self, tokenizer, prompt_ids: list[int], config: GenerationConfig, eos: frozenset[int],
                 text: bool = True):
        self.ids = list(prompt_ids)
        self.num_prompt = len(prompt_ids)
        self.config = config
        self.eos = eos
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids) if text or config.stop_strings else None
        self.finish_reason: str | None = None

    @property
    def num_generated(self) -> int:
        return len(self.ids) - self.num_prompt

    def commit(self, tokens: list[int]) -> tuple[list[int], str]:
        kept, text = [], ""
        for t in tokens:
            self.ids.append(t)
            kept.append(t)
            delta = self.detok.add(t) if self.detok is not None else ""
            text += delta
            if t in self.eos and not self.config.ignore_eos:
                self.finish_reason = "eos"
            elif delta and find_stop(self.detok.text, self.config.stop_strings, len(delta)) >= 0:
                self.finish_reason = "stop"
            elif self.num_generated >= self.config.max_new_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        if self.finish_reason and self.detok is not None:
            text += self.detok.flush()
        return kept, text


def eos_ids(model, tokenizer) -> frozenset[int]:
    """EOS ids from the generation config and the tokenizer."""
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(ids)


def encode_prompt(tokenizer, prompt: str, use_chat_template: bool = True) -> list[int]:
    """Prompt ids, wrapped in the chat template when the tokenizer has one."""
    if not prompt or not prompt.strip():
        raise GenerationError("the prompt is empty; type something for the model to continue")
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        ids = ids["input_ids"] if isinstance(ids, dict) else ids
        return list(ids)
    return list(tokenizer(prompt)["input_ids"])


def check_request(prompts: Sequence[list[int]], config: GenerationConfig) -> None:
    """Refuse an empty batch, an empty prompt or invalid settings with a GenerationError saying what to change."""
    if not prompts:
        raise GenerationError("the batch is empty; give at least one prompt")
    if any(not p for p in prompts):
        raise GenerationError("the prompt is empty; type something for the model to continue")
    try:
        config.validate()
    except ValueError as exc:
        raise GenerationError(str(exc)) from exc


def generated_ids(events: Sequence[StepEvent]) -> list[int]:
    """All tokens committed by a one-row run."""
    return [t for e in events for t in e.tokens]


def row_outputs(events: Sequence[BatchEvent], num_rows: int) -> list[list[int]]:
    """Each prompt's committed tokens, by prompt index."""
    out: list[list[int]] = [[] for _ in range(num_rows)]
    for e in events:
        for i, t in zip(e.rows, e.tokens):
            out[i] += t
    return out
