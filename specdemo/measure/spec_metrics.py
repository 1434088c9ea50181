"""Speculative-decoding metrics under vLLM's names and meanings (vLLM 0.32.0: `RequestSpecDecodeMetrics.to_dict`, the
per-request `metrics.speculative_decoding` of `--per-request-spec-decode-metrics detailed`, and `SpecDecodingStats`
behind the `vllm:spec_decode_*` Prometheus counters). Pure functions of (drafted, accepted) counts per verify step.

vLLM counts a verify step only when it carried at least one draft token, and counts accepted drafts before stop
conditions cut the output; `mean_acceptance_length` is 1 + accepted / steps, the bonus (or correction) token included.
Where ours differ (RunStats.mean_accepted, per_position_acceptance): docs/vllm.md#metrics-under-vllms-names.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import zip_longest

Step = tuple[int, int]  # (drafted tokens, accepted of them) in one verify pass


def speculative_decoding(steps: Iterable[Step], num_spec_tokens: int | None = None, detailed: bool = True) -> dict:
    """vLLM's per-request dict for one sequence's verify steps (or, pooled, many sequences'), plus the Prometheus
    per-position counters. `num_spec_tokens` is the configured k (vLLM's histogram length - 1); None: the largest
    proposal. `detailed` adds the ordered per-step arrays, as vLLM's `detailed` level does."""
    steps = [(d, a) for d, a in steps if d > 0]  # a pass with no drafts is no spec step to vLLM (none scheduled)
    if any(not 0 <= a <= d for d, a in steps):
        raise ValueError(f"accepted must lie in 0..drafted for every step, got {steps}")
    k = max([num_spec_tokens or 0] + [d for d, _ in steps])
    histogram = [0] * (k + 1)
    by_length: dict[str, list[int]] = {}
    for d, a in steps:
        histogram[a] += 1
        by_length.setdefault(str(d), [0] * (d + 1))[a] += 1
    num_spec_steps = len(steps)
    accepted = sum(a for _, a in steps)
    drafted = sum(d for d, _ in steps)
    out = {
        "mean_acceptance_length": 1.0 + accepted / num_spec_steps if num_spec_steps else 1.0,  # bonus included
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": histogram,  # [j]: steps that accepted exactly j drafts (bonus excluded)
        # ours, not in vLLM 0.32.0's dict: the histogram per proposal length, for dynamic k and the hybrid's 1 or k
        "acceptance_histogram_by_draft_length": dict(sorted(by_length.items(), key=lambda kv: int(kv[0]))),
        "num_spec_steps": num_spec_steps,
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted,
        "num_spec_tokens": k,
        # SpecDecodingStats' per-position counts; the first is vllm:spec_decode_num_accepted_tokens_per_pos_total
        "num_accepted_tokens_per_pos": [sum(1 for _, a in steps if a > i) for i in range(k)],
        "num_draft_tokens_per_pos": [sum(1 for d, _ in steps if d > i) for i in range(k)],
    }
    if detailed:
        out["per_step_accepted"] = [a for _, a in steps]
        out["per_step_drafted"] = [d for d, _ in steps]
    return out


def steps_of(events: Iterable) -> list[Step]:
    """(drafted, accepted) of each speculative step of one run's engine.StepEvent events (reads kind, drafted,
    num_accepted)."""
    return [(len(e.drafted), e.num_accepted) for e in events if e.kind == "spec"]


def rows_of(events: Iterable) -> dict[int, list[Step]]:
    """Per prompt index, (drafted, accepted) of each speculative step of a batched run's engine.BatchEvent events (reads
    kind, rows, drafted, num_accepted)."""
    out: dict[int, list[Step]] = {}
    for e in events:
        if e.kind == "spec":
            for row, drafted, accepted in zip(e.rows, e.drafted, e.num_accepted):
                out.setdefault(row, []).append((len(drafted), accepted))
    return out


def pool(dicts: Sequence[dict]) -> dict:
    """Many requests' dicts (ours or vLLM's own) summed as vLLM's counters sum them: histograms and per-position
    counts element by element, rate and mean length recomputed; no per-step arrays."""
    dicts = [d for d in dicts if d]
    steps = sum(d["num_spec_steps"] for d in dicts)
    accepted = sum(d["num_accepted_draft_tokens"] for d in dicts)
    drafted = sum(d["num_draft_tokens"] for d in dicts)
    out = {
        "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": _add([d["acceptance_histogram"] for d in dicts]),
        "num_spec_steps": steps, "num_accepted_draft_tokens": accepted, "num_draft_tokens": drafted,
        "num_spec_tokens": max((d["num_spec_tokens"] for d in dicts), default=0),
        "requests": len(dicts),
    }
    for key in ("num_accepted_tokens_per_pos", "num_draft_tokens_per_pos"):
        if dicts and all(key in d for d in dicts):
            out[key] = _add([d[key] for d in dicts])
    if dicts and all("acceptance_histogram_by_draft_length" in d for d in dicts):
        lengths = sorted({n for d in dicts for n in d["acceptance_histogram_by_draft_length"]}, key=int)
        out["acceptance_histogram_by_draft_length"] = {
            n: _add([d["acceptance_histogram_by_draft_length"].get(n, []) for d in dicts]) for n in lengths}
    return out


def _add(lists: Sequence[Sequence[int]]) -> list[int]:
    return [sum(x) for x in zip_longest(*lists, fillvalue=0)]
