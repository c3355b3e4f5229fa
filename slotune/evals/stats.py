"""Statistics for quality gates: standard errors, paired differences, the pass/fail rule.

Pure Python (no torch, no lm_eval), so it is tested exactly and cheaply.

Conventions: a *drop* is how much worse the candidate is than the baseline, in the metric's
own units, positive = worse (baseline - candidate for accuracy, candidate - baseline for
perplexity or KL). A gate's *margin* is the largest drop it accepts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def mean_stderr(xs: list[float]) -> float | None:
    """Standard error of the mean (sample std / sqrt(n)); None with fewer than 2 values."""
    n = len(xs)
    if n < 2:
        return None
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)


def paired_drop(base: dict[int, float], cand: dict[int, float]) -> tuple[float, float | None, int]:
    """Mean of (base - cand) over the items both scored, its standard error, and the item count.

    Pairing removes the between-item variance both configs share: two configs that answer
    the same 50 questions almost alike have a tiny paired SE even though each accuracy alone
    has an SE of ~0.07.
    """
    common = sorted(set(base) & set(cand))
    d = [base[i] - cand[i] for i in common]
    return mean(d), mean_stderr(d), len(common)


def perplexity(pairs: list[tuple[float, float]]) -> float:
    """exp(-sum loglik / sum units) over (loglik, units) pairs: lm-eval's weighted perplexity."""
    return math.exp(-sum(ll for ll, _ in pairs) / sum(u for _, u in pairs))


def paired_perplexity_drop(
    base: dict[int, tuple[float, float]], cand: dict[int, tuple[float, float]]
) -> tuple[float, float, float | None, int]:
    """Perplexity of each config over the common documents, and the SE of (cand - base).

    log(ppl_c / ppl_b) = sum_i (ll_b,i - ll_c,i) / U, with U the total units (words/bytes);
    treating documents as independent, SE[log ratio] = sqrt(n) * sd(d_i) / U, and by the
    delta method SE[ppl_c - ppl_b] ~= ppl_c * SE[log ratio].
    Returns (ppl_base, ppl_cand, stderr, n).
    """
    common = sorted(set(base) & set(cand))
    n = len(common)
    ppl_b = perplexity([base[i] for i in common])
    ppl_c = perplexity([cand[i] for i in common])
    d = [base[i][0] - cand[i][0] for i in common]
    total_units = sum(base[i][1] for i in common)
    se_mean = mean_stderr(d)
    se = None if se_mean is None else ppl_c * se_mean * n / total_units  # sqrt(n)*sd = n*se_mean
    return ppl_b, ppl_c, se, n


def one_sided_z(confidence: float) -> float:
    return NormalDist().inv_cdf(confidence)


@dataclass(frozen=True, slots=True)
class Verdict:
    passed: bool
    bound: float | None  # the drop's one-sided lower confidence bound (non_inferiority), else None
    reason: str


def judge(
    drop: float, stderr: float | None, margin: float, mode: str, confidence: float, what: str = "drop"
) -> Verdict:
    """The pass/fail rule.

    threshold: fail iff drop > margin.
    non_inferiority: fail iff the drop exceeds the margin with the given one-sided confidence,
        i.e. iff drop - z * stderr > margin. Noise alone then cannot fail a good config; a
        config fails only when the data show it is worse than the margin allows. Without a
        standard error (one item, or a deterministic statistic) it falls back to threshold.
    """
    if not math.isfinite(drop):
        return Verdict(False, None, f"failed: {what} is {drop}")
    if mode == "non_inferiority" and stderr is not None and stderr > 0:
        bound = drop - one_sided_z(confidence) * stderr
        ok = bound <= margin
        why = (
            f"{what} {drop:.4g} +- {stderr:.2g} (one-sided {confidence:.0%} lower bound {bound:.4g}) "
            f"{'<=' if ok else '>'} margin {margin:.4g}"
        )
        return Verdict(ok, bound, ("ok: " if ok else "failed: ") + why)
    ok = drop <= margin
    return Verdict(ok, None, f"{'ok' if ok else 'failed'}: {what} {drop:.4g} {'<=' if ok else '>'} margin {margin:.4g}")
