"""bench simulate: acceptance: draft tokens accepted per sequence per speculative step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fastgrpo.speculation.policy import tree_width
from fastgrpo.speculation.spec import SpecConfig


@dataclass
class AcceptanceProfile:
    """P(a tree of shape c accepts >= d tokens) = prod over depths j <= d of cov_j(w), where
    cov_j(w) = 1 - (1 - alpha_j) w^-beta is the chance the target's token at depth j is among the
    w draft candidates kept under the path's node (alpha_j: the top-1 chance, beta: what width adds),
    and w = clamp((n - 1) / depth, 1, top-k) is the tree's fill (`tree_width`: the same crude width and
    law the engine's AcceptanceModel uses as its prior). Shapes measured often enough are drawn from
    their measured histogram instead (`empirical`)."""

    alpha: list[float]  # top-1 acceptance at depth 1, 2, ... (the last repeats beyond)
    beta: float
    empirical: dict[SpecConfig, list[int]] = field(default_factory=dict)  # accepted counts per measured shape
    min_samples: int = 200
    source: str = ""

    def survival(self, c: SpecConfig) -> list[float]:
        """P(accepted >= d) for d = 1..depth."""
        if c in self.empirical and len(self.empirical[c]) >= self.min_samples:
            a = np.asarray(self.empirical[c])
            return [float((a >= d).mean()) for d in range(1, c.depth + 1)]
        w = tree_width(c)
        depth = min(c.depth, c.num_verify - 1)
        out, reach = [], 1.0
        for j in range(1, c.depth + 1):
            alpha = self.alpha[min(j, len(self.alpha)) - 1]
            reach *= 0.0 if j > depth else 1 - (1 - alpha) * w ** (-self.beta)
            out.append(reach)
        return out

    def mean(self, c: SpecConfig) -> float:
        return 1.0 + sum(self.survival(c))

    def draw(self, c: SpecConfig, B: int, rng: np.random.Generator) -> np.ndarray:
        if c in self.empirical and len(self.empirical[c]) >= self.min_samples:
            return rng.choice(np.asarray(self.empirical[c]), size=B)
        s = np.asarray(self.survival(c))
        return (rng.random(B)[:, None] < s[None, :]).sum(1)  # survival is non-increasing in depth

    def to_json(self) -> dict:
        return {"alpha": self.alpha, "beta": self.beta, "source": self.source,
                "measured_mean_emitted": {c.name: 1 + float(np.mean(v)) for c, v in self.empirical.items()},
                "measured_samples": {c.name: len(v) for c, v in self.empirical.items()}}


@dataclass(frozen=True)
class DraftConfidence:
    """What a per-sequence budget sees: each row's tree as `levels` levels of w = the profile's fill
    nodes (w chains from the root), each node carrying a 1/w share of its level's reach, where the
    draft's estimate that row r's step accepts >= j tokens is

        s_hat_r(j) = rho * [L_r >= j] + (1 - rho) * s(j)

    L_r: the row's accepted length with the whole tree, drawn from the profile as for every other
    policy; s(j): the profile's survival. rho (0: the draft cannot tell rows apart, 1: it knows each
    outcome) is an ASSUMPTION stated with every result; the estimate is calibrated over rows
    (E s_hat = s). The accepted path runs along one of the w chains, uniformly: a row accepts
    min(L_r, the levels along that chain whose node was verified)."""

    rho: float = 0.5

    def tree(self, profile: AcceptanceProfile, c: SpecConfig, B: int,
             rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(scores [B, levels * w] cumulative log-probabilities, depth [B, levels * w], L [B], w)."""
        w = max(1, min((c.num_verify - 1) // c.depth, c.topk))
        s = np.asarray(profile.survival(c))
        L = profile.draw(c, B, rng)
        reach = self.rho * (L[:, None] >= np.arange(1, c.depth + 1)[None]) + (1 - self.rho) * s[None]
        with np.errstate(divide="ignore"):
            scores = np.log(np.repeat(reach / w, w, axis=1))
        depth = np.repeat(np.arange(1, c.depth + 1), w)[None].repeat(B, 0)
        return scores, depth, L, w

    @staticmethod
    def accepted(nodes: np.ndarray, L: np.ndarray, w: int, rng: np.random.Generator) -> np.ndarray:
        """Accepted lengths given the verified nodes [B, levels * w] (level-major, chain k at offset k)."""
        B = len(L)
        chain = rng.integers(0, w, size=B)
        on_path = nodes.reshape(B, -1, w)[np.arange(B), :, chain]  # [B, levels]
        kept = np.cumprod(on_path, axis=1).sum(1)  # levels verified along the row's chain
        return np.minimum(L, kept)


def fit_acceptance(measured: dict[SpecConfig, list[int]], source: str) -> AcceptanceProfile:
    """alpha_j = alpha_1 gamma^(j-1) and beta fitted (grid search) to the mean accepted length of
    every measured shape, weighted by its samples; the measured histograms are kept."""
    data = [(c, float(np.mean(v)), len(v)) for c, v in measured.items() if v]
    best, best_err = ([0.6], 0.5), float("inf")
    for a1 in np.linspace(0.05, 0.97, 47):
        for gamma in np.linspace(0.6, 1.2, 13):
            alpha = [min(a1 * gamma ** j, 0.99) for j in range(8)]
            for beta in np.linspace(0.0, 1.5, 16):
                p = AcceptanceProfile(alpha, beta)
                err = sum(n * (p.mean(c) - 1 - m) ** 2 for c, m, n in data)
                if err < best_err:
                    best, best_err = (alpha, float(beta)), err
    return AcceptanceProfile(best[0], best[1], {c: list(v) for c, v in measured.items()}, source=source)


def eagle_profile(beta: float) -> AcceptanceProfile:
    """An EAGLE-3 draft on Llama-3.1-8B-Instruct sampling at temperature 1: a chain of 7 draft tokens
    emits tau = 3.34 tokens per step on GSM8K (3.49 HumanEval, 2.77 MT-bench), as measured with
    proper rejection sampling for the public checkpoint yuhuili/EAGLE3-LLaMA3.1-Instruct-8B in the
    model card of nebius/EAGLE3-Llama-3.3-70B-Instruct (the EAGLE-3 paper, arXiv 2503.01840, reports
    longer ones at temperature 0, which a GRPO rollout does not use). A constant per-depth alpha
    reproducing tau = 3.34 for the chain; what width adds (`beta`) is not in that figure and is taken
    from our own draft's fit (an assumption: a real draft's top-k may gain more or less)."""
    lo, hi = 0.01, 0.99
    for _ in range(60):  # 1 + a + ... + a^7 = 3.34
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a**j for j in range(8)) < 3.34 else (lo, a)
    return AcceptanceProfile([a], beta, source="EAGLE-3, Llama-3.1-8B, T=1, GSM8K tau 3.34 (chain of 7)")
