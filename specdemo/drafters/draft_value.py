"""What a suffix drafter's drafted tokens have been worth, learned per cache, for the cost-aware cut
(SuffixConfig.cost_aware): a draft keeps the prefix whose expected accepted tokens best pay for its verify pass.
Knows token kinds and pass costs only.
"""

from __future__ import annotations

from collections.abc import Sequence


class DraftValue:
    """What drafted tokens have been worth: per kind of token, how often the target accepted it, to cut a draft where
    its expected accepted tokens stop paying for a wider verify pass (SuffixConfig.cost_aware).

    A kind is (source, match length, position in the draft, the token's frequency ratio), each bucketed; until a kind
    has been tried, its estimate is the tree's own ratio, which the counts overstate (deep nodes seen once give 1.0),
    and PRIOR tries of evidence move it toward what the target actually accepted. A kind the cut keeps cutting would
    never be tried again, whatever the workload became: every EXPLORE-th time the cut stops before a kind, the draft
    keeps that token too, so its estimate follows the target (deterministic, as the drafter is).
    """

    PRIOR = 4.0
    EXPLORE = 32

    def __init__(self):
        self.counts: dict[tuple, list[int]] = {}  # kind -> [accepted, tried]
        self.cut: dict[tuple, int] = {}  # kind -> times the cut stopped before it since it was last explored

    @staticmethod
    def kinds(source: str, match_len: int, ratios: Sequence[float]) -> list[tuple]:
        """The kind of each drafted token (ratios: each token's count over its parent's)."""
        m = 0 if match_len <= 1 else 1 if match_len <= 2 else 2 if match_len <= 4 else 3 if match_len <= 8 else 4
        return [(source, m, min(i, 2), 0 if r >= 0.99 else 1 if r >= 0.8 else 2 if r >= 0.5 else 3)
                for i, r in enumerate(ratios)]

    def length(self, kinds: Sequence[tuple], ratios: Sequence[float], pass_costs: dict[int, float]) -> int:
        """How many of the draft's tokens to keep: the length that maximises expected tokens per unit of pass cost,
        (1 + sum of each prefix's estimated acceptance) / pass_costs[length] (a 1-token pass costs 1; 0 keeps none)."""
        best, keep, p, expected = 1.0, 0, 1.0, 1.0
        widest = max(pass_costs)
        for i, (kind, r) in enumerate(zip(kinds, ratios)):
            accepted, tried = self.counts.get(kind, (0, 0))
            p *= (accepted + self.PRIOR * r) / (tried + self.PRIOR)
            expected += p
            value = expected / pass_costs[min(i + 1, widest)]
            if value > best:
                best, keep = value, i + 1
        if keep < len(kinds):
            after = kinds[keep]
            self.cut[after] = self.cut.get(after, 0) + 1
            if self.cut[after] >= self.EXPLORE:
                self.cut[after] = 0
                return keep + 1
        return keep

    def record(self, kinds: Sequence[tuple], num_accepted: int) -> None:
        """The target kept num_accepted of a draft of these kinds: the first rejected one was tried too."""
        for i, kind in enumerate(kinds[: num_accepted + 1]):
            entry = self.counts.setdefault(kind, [0, 0])
            entry[0] += i < num_accepted
            entry[1] += 1
