"""Are two sets of sampled responses from the same distribution? The check that speculative
decoding is lossless: responses sampled with speculation on must be indistinguishable from
responses sampled with it off (same model, prompts and sampling settings).

``compare_samples`` runs, on two samples of responses to the same prompts:

- a chi-square test of homogeneity of the response lengths;
- for each of the first ``positions`` positions, a chi-square test of the token frequencies there
  (tokens rarer than ``min_expected`` expected counts pooled into one cell);
- where rewards are given, Welch's t-test of the mean reward;

and rejects sameness when the smallest p-value, Bonferroni-corrected over all tests, is below
``alpha``. The tests use scipy. Power depends on the sample size and on how far the distributions
are apart: the tests show it on planted biases (a lower temperature; drafts accepted without
verification).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LosslessReport:
    p_values: dict[str, float]  # test name -> raw p-value
    alpha: float
    tests: int = field(default=0)

    @property
    def p_min_corrected(self) -> float:
        return min(1.0, min(self.p_values.values(), default=1.0) * max(len(self.p_values), 1))

    @property
    def same(self) -> bool:
        """No test rejects sameness at ``alpha`` (Bonferroni over the tests)."""
        return self.p_min_corrected >= self.alpha

    def worst(self) -> str:
        return min(self.p_values, key=self.p_values.__getitem__) if self.p_values else ""


def _chi2(a: Counter[int], b: Counter[int], min_expected: float) -> float | None:
    """p-value of a 2 x K chi-square test of homogeneity; rare categories are pooled."""
    from scipy.stats import chi2_contingency

    na, nb = sum(a.values()), sum(b.values())
    if na == 0 or nb == 0:
        return None
    share = min(na, nb) / (na + nb)
    keys = sorted(set(a) | set(b))
    common = [k for k in keys if (a[k] + b[k]) * share >= min_expected]
    rare = [k for k in keys if k not in common]
    rows = [[a[k] for k in common], [b[k] for k in common]]
    if rare:
        rows[0].append(sum(a[k] for k in rare))
        rows[1].append(sum(b[k] for k in rare))
    if len(rows[0]) < 2:
        return None  # one category: nothing to compare
    return float(chi2_contingency(rows)[1])


def compare_samples(
    a: Sequence[Sequence[int]],
    b: Sequence[Sequence[int]],
    rewards_a: Sequence[float] = (),
    rewards_b: Sequence[float] = (),
    positions: int = 8,
    alpha: float = 0.01,
    min_expected: float = 5.0,
) -> LosslessReport:
    """Test that responses ``a`` and ``b`` (token id sequences) come from the same distribution."""
    p: dict[str, float] = {}
    lengths = _chi2(Counter(len(r) for r in a), Counter(len(r) for r in b), min_expected)
    if lengths is not None:
        p["length"] = lengths
    for i in range(positions):
        pv = _chi2(
            Counter(r[i] for r in a if len(r) > i), Counter(r[i] for r in b if len(r) > i), min_expected
        )
        if pv is not None:
            p[f"token@{i}"] = pv
    if len(rewards_a) > 1 and len(rewards_b) > 1:
        from scipy.stats import ttest_ind

        if len(set(rewards_a) | set(rewards_b)) > 1:
            p["reward"] = float(ttest_ind(rewards_a, rewards_b, equal_var=False).pvalue)
    return LosslessReport(p_values=p, alpha=alpha, tests=len(p))
