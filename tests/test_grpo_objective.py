"""Every option of the GRPO objective against an oracle written here from the papers'
formulas, token by token in Python floats (values and gradients by hand, not by autograd through
the code under test): GSPO's sequence ratio (arXiv 2507.18071), dual-clip PPO (arXiv 1912.09729), the
log-ratio clamp, Dr. GRPO's aggregations (arXiv 2503.20783), the rollout corrections (token/sequence
TIS, token/sequence/geometric masks, IcePop), the k1/k2/k3 KL estimates, RLOO and batch-std
advantages. The GRPO step's loss function (`minibatch_loss`, the one every trainer calls) is split
over two micro-batches of different widths, so that the normaliser is checked to make them add up.
Edge cases in every batch: an empty response, one-token responses, extreme ratios."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from fastgrpo.config import ConfigError, GRPOConfig, load_config
from fastgrpo.grpo.advantages import group_advantages
from fastgrpo.grpo.batch import build_batch, training_batch
from fastgrpo.grpo.step import STATS, minibatch_loss
from fastgrpo.types import Completion

# -- the oracle -------------------------------------------------------------------------------------


def _weights(old: list[float], engine: list[float], o: GRPOConfig) -> tuple[list[float], int, int]:
    """The rollout correction's weight of each token of one sequence from rho = pi_old / pi_engine, and
    how many of its tokens were masked and truncated: products of ratios, no logarithms."""
    rho = [math.exp(a - b) for a, b in zip(old, engine)]
    n, mode, cap = len(rho), o.rollout_correction, o.tis_cap
    low, high = o.mask_band()
    whole = math.prod(rho)
    if mode == "none":
        return [1.0] * n, 0, 0
    if mode == "token_tis":
        return [min(r, cap) for r in rho], 0, sum(r > cap for r in rho)
    if mode == "sequence_tis":
        return [min(whole, cap)] * n, 0, n if whole > cap else 0
    if mode == "token_mask":
        w = [1.0 if low <= r <= high else 0.0 for r in rho]
    elif mode == "sequence_mask":
        w = [1.0 if low <= whole <= high else 0.0] * n
    elif mode == "geometric_mask":
        geo = whole ** (1 / n) if n else 1.0
        w = [1.0 if low <= geo <= high else 0.0] * n
    elif mode == "icepop":
        w = [r if low <= r <= high else 0.0 for r in rho]
    return w, sum(x == 0.0 for x in w), 0


def _kl(x: float, estimator: str) -> tuple[float, float]:
    """Schulman's estimates of KL(pi || ref) at x = log pi - log ref, and their derivative in log pi."""
    if estimator == "k1":
        return x, 1.0
    if estimator == "k2":
        return x * x / 2, x
    return math.exp(-x) + x - 1, 1 - math.exp(-x)


def oracle(logp, old, engine, ref, adv, o: GRPOConfig):
    """The minibatch's loss, d loss / d logp of every token, and the counts (clipped, dual-clipped,
    clamped, masked, truncated) of the objective `o`; lists of per-sequence lists."""
    N = len(logp)
    tokens = sum(len(s) for s in logp)
    denominator = {"token_mean": tokens, "seq_mean": N, "seq_mean_token_sum": N,
                   "seq_mean_token_sum_norm": N * o.loss_norm_tokens}[o.loss_aggregation]
    C, lo, hi = o.log_ratio_clamp, 1 - o.eps_low, 1 + o.eps_high
    loss, grads = 0.0, []
    counts = dict(clip=0, dual_clip=0, clamped=0, masked=0, truncated=0)
    for i in range(N):
        n, A = len(logp[i]), adv[i]
        w, masked, truncated = _weights(old[i], engine[i], o)
        counts["masked"] += masked
        counts["truncated"] += truncated
        if n == 0:  # an empty response: no term (it still counts in N)
            grads.append([])
            continue
        scale = 1 / (denominator * (n if o.loss_aggregation == "seq_mean" else 1))  # each token's share
        if o.ratio_level == "sequence":  # GSPO: s = (pi(y|x) / pi_old(y|x))^(1/|y|), one for the sequence
            # GSPO-token (the paper's token form): every token carries s, and its term's gradient is
            # s A grad log pi(y_t) (with seq_mean: GSPO's (1/|y|) sum_t s A grad log pi(y_t))
            xs = [sum(a - b for a, b in zip(logp[i], old[i])) / n] * n
        else:
            xs = [a - b for a, b in zip(logp[i], old[i])]
        g = []
        for t in range(n):
            x, d = xs[t], 1.0  # d: d x / d logp_t as the token's own term sees it
            if C and abs(x) > C:
                x, d = math.copysign(C, x), 0.0
                counts["clamped"] += 1
            r = math.exp(x)
            objective, dobjective = (r * A, A * r * d)  # unclipped
            if A * min(max(r, lo), hi) < r * A:  # the clipped term is the smaller: clip
                objective, dobjective = A * min(max(r, lo), hi), 0.0
                counts["clip"] += 1
            if o.dual_clip and A < 0 and objective < o.dual_clip * A:  # dual clip: at least c A
                objective, dobjective = o.dual_clip * A, 0.0
                counts["dual_clip"] += 1
            value, grad = -objective * w[t], -dobjective * w[t]
            if ref is not None:
                y, dy = logp[i][t] - ref[i][t], 1.0
                if C and abs(y) > C:
                    y, dy = math.copysign(C, y), 0.0
                k, dk = _kl(y, o.kl_estimator)
                value, grad = value + o.kl_coef * k, grad + o.kl_coef * dk * dy
            loss += value * scale
            g.append(grad * scale)
        grads.append(g)
    return loss, grads, counts


# -- the code under test, on the same numbers --------------------------------------------------------

LENGTHS = [0, 1, 3, 7, 2, 5, 1, 9]  # an empty response, one-token ones, ragged
G = 4


def _case(seed: int, extreme: bool = False):
    """Per-sequence log-probabilities: current, before the step (old), the engine's, the reference's;
    advantages of both signs. Some ratios are far outside every clip range, and with `extreme` one is
    exp(100) (a finite fp32 loss only with the log-ratio clamp)."""
    rnd = random.Random(seed)
    logp = [[-rnd.uniform(0.05, 3.0) for _ in range(n)] for n in LENGTHS]
    old = [[a + rnd.gauss(0, 0.35) for a in s] for s in logp]
    old[3][2] = logp[3][2] - 1.6  # ratio ~5: beyond dual_clip=3 for the negative advantage of sequence 3
    old[5][0] = logp[5][0] + 1.2  # ratio ~0.3
    if extreme:
        old[6][0] = logp[6][0] - 100.0
    engine = [[a + rnd.gauss(0, 0.5) for a in s] for s in old]
    ref = [[a + rnd.gauss(0, 0.3) for a in s] for s in logp]
    adv = [1.3, -0.7, 0.4, -1.1, 0.9, -0.2, -1.5, 0.6]
    return logp, old, engine, ref, adv


def _padded(rows: list[list[float]], prompts: list[list[int]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, (p, r) in enumerate(zip(prompts, rows)):
        out[i, len(p): len(p) + len(r)] = torch.tensor(r, dtype=torch.float64)
    return out


def run_step_loss(logp, old, engine, ref, adv, o: GRPOConfig, micro: list[list[int]]):
    """`minibatch_loss` over rows 0..N-1 in the micro-batches `micro`: the summed loss, d loss / d logp
    per sequence, and the statistics (STATS)."""
    prompts = [[1] + [5 + i] * (1 + i % 3) for i in range(len(logp))]
    batch = build_batch(prompts, [[7] * len(s) for s in logp], engine, torch.tensor(adv))
    width = batch.input_ids.shape[1]
    batch.engine_logprobs = _padded(engine, prompts, width)  # fp64 throughout: the oracle's precision
    batch.advantages = torch.tensor(adv, dtype=torch.float64)
    current = _padded(logp, prompts, width).requires_grad_(True)
    old_t, ref_t = _padded(old, prompts, width), None if ref is None else _padded(ref, prompts, width)
    stats = torch.zeros(len(STATS), dtype=torch.float64)
    rows = list(range(len(logp)))
    loss_of = minibatch_loss(o, batch, rows, old_t, ref_t, stats)
    total = 0.0
    for part in micro:
        m = batch.select(part)
        w = m.input_ids.shape[1]
        loss = loss_of(part, m, current[part, :w], torch.zeros(len(part), w, dtype=torch.float64))
        loss.backward()
        total += loss.item()
    grads = [current.grad[i, len(p): len(p) + len(s)].tolist() for i, (p, s) in enumerate(zip(prompts, logp))]
    return total, grads, dict(zip(STATS, stats.tolist()))


OPTIONS = {
    "defaults (token TIS, clamp 20)": {},
    "GSPO, its objective (seq_mean)": dict(ratio_level="sequence", loss_aggregation="seq_mean",
                                           rollout_correction="none"),
    "GSPO-token with token TIS, token_mean": dict(ratio_level="sequence"),
    "dual clip 3": dict(dual_clip=3.0),
    "dual clip 1.05 (below 1 + eps_high)": dict(dual_clip=1.05),
    "log-ratio clamp 0.3": dict(log_ratio_clamp=0.3),
    "no clamp": dict(log_ratio_clamp=0.0),
    "seq_mean_token_sum": dict(loss_aggregation="seq_mean_token_sum"),
    "seq_mean_token_sum_norm (Dr. GRPO)": dict(loss_aggregation="seq_mean_token_sum_norm", loss_norm_tokens=12),
    "no correction": dict(rollout_correction="none"),
    "sequence TIS": dict(rollout_correction="sequence_tis", tis_cap=1.5),
    "token mask": dict(rollout_correction="token_mask"),
    "token mask, own band": dict(rollout_correction="token_mask", mask_low=0.7, mask_high=1.5),
    "sequence mask": dict(rollout_correction="sequence_mask"),
    "geometric mask": dict(rollout_correction="geometric_mask", mask_low=0.8, mask_high=1.3),
    "icepop": dict(rollout_correction="icepop"),
    "k1": dict(kl_coef=0.3, kl_estimator="k1"),
    "k2": dict(kl_coef=0.3, kl_estimator="k2"),
    "k3": dict(kl_coef=0.3, kl_estimator="k3"),
    "everything at once": dict(ratio_level="sequence", dual_clip=3.0, log_ratio_clamp=0.5,
                               rollout_correction="sequence_mask", kl_coef=0.1, kl_estimator="k2",
                               loss_aggregation="seq_mean_token_sum_norm", loss_norm_tokens=10),
}
# which statistic each option must have exercised (a branch the data never reached would prove nothing)
EXERCISED = {"dual clip 3": "dual_clip", "dual clip 1.05 (below 1 + eps_high)": "dual_clip",
             "log-ratio clamp 0.3": "clamped", "defaults (token TIS, clamp 20)": "truncated",
             "sequence TIS": "truncated", "token mask": "masked", "token mask, own band": "masked",
             "sequence mask": "masked", "geometric mask": "masked", "icepop": "masked",
             "GSPO, its objective (seq_mean)": "clip"}


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("seed", [0, 1])
def test_the_step_loss_is_the_papers_formula(name, seed):
    o = GRPOConfig(**OPTIONS[name])
    logp, old, engine, ref, adv = _case(seed)
    ref = ref if o.kl_coef > 0 else None
    want_loss, want_grads, want_counts = oracle(logp, old, engine, ref, adv, o)
    loss, grads, stats = run_step_loss(logp, old, engine, ref, adv, o, micro=[[0, 1, 2], [3, 4, 5, 6, 7]])
    assert loss == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    for got, want in zip(grads, want_grads):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    for key, count in want_counts.items():
        assert stats[key] == count, key
    assert stats["tokens"] == sum(LENGTHS)
    if name in EXERCISED:
        assert want_counts[EXERCISED[name]] > 0


def test_gspo_is_the_sequence_level_objective():
    """GSPO's own statement (its eq. 5-7), one number per sequence: J = 1/N sum_i min(s_i A_i, clip(s_i) A_i),
    s_i = exp(mean_t (logp - old)); its gradient by autograd of that sequence-level formula."""
    o = GRPOConfig(ratio_level="sequence", loss_aggregation="seq_mean", rollout_correction="none",
                   eps_low=0.05, eps_high=0.05)
    logp, old, engine, _, adv = _case(3)
    loss, grads, _ = run_step_loss(logp, old, engine, None, adv, o, micro=[[0, 1, 2, 3, 4, 5, 6, 7]])
    total = 0.0
    for i, (lp, od) in enumerate(zip(logp, old)):
        if not lp:  # no tokens: no term
            assert grads[i] == []
            continue
        x = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
        s = torch.exp((x - torch.tensor(od, dtype=torch.float64)).mean())
        J = torch.minimum(s * adv[i], s.clamp(1 - 0.05, 1 + 0.05) * adv[i])
        (-J / len(logp)).backward()
        total += -J.item() / len(logp)
        assert grads[i] == pytest.approx(x.grad.tolist(), rel=1e-9, abs=1e-12)
    assert loss == pytest.approx(total, rel=1e-9)


def test_an_extreme_ratio_is_finite_only_under_the_clamp_and_bounded_by_the_dual_clip():
    """A ratio of exp(100): without the clamp the fp32 loss overflows (the step's NaN skip then drops the
    update); with veRL's clamp at 20 it is finite, the oracle's; with the dual clip it is at most c |A|."""
    logp, old, engine, _, adv = _case(0, extreme=True)
    f32 = lambda rows: [[float(torch.tensor(v, dtype=torch.float32)) for v in s] for s in rows]  # noqa: E731

    def fp32_loss(o):
        prompts = [[1, 2]] * len(logp)
        batch = build_batch(prompts, [[7] * len(s) for s in logp], engine, torch.tensor(adv))
        width = batch.input_ids.shape[1]
        cur = _padded(f32(logp), prompts, width).float()
        loss_of = minibatch_loss(o, batch, list(range(len(logp))), _padded(f32(old), prompts, width).float(), None,
                                 torch.zeros(len(STATS), dtype=torch.float64))
        return loss_of(list(range(len(logp))), batch, cur, torch.zeros_like(cur)).item()

    assert not math.isfinite(fp32_loss(GRPOConfig(log_ratio_clamp=0.0)))
    clamped = GRPOConfig()  # log_ratio_clamp 20 by default
    got = fp32_loss(clamped)
    assert math.isfinite(got) and got == pytest.approx(oracle(logp, old, engine, None, adv, clamped)[0], rel=1e-5)
    both = GRPOConfig(dual_clip=3.0, rollout_correction="none")
    want, _, counts = oracle(logp, old, engine, None, adv, both)
    assert counts["dual_clip"] >= 2 and fp32_loss(both) == pytest.approx(want, rel=1e-5)
    assert abs(want) < 3.0 * max(abs(a) for a in adv)  # every token's loss within c |A|


def test_equal_groups_and_no_tokens_train_nothing():
    """All-equal rewards give zero advantages: no policy loss, no gradient (whatever the ratios);
    a minibatch of empty responses only has a zero loss."""
    logp, old, engine, _, _ = _case(1)
    for opts in OPTIONS.values():
        o = GRPOConfig(**{**opts, "kl_coef": 0.0})
        loss, grads, _ = run_step_loss(logp, old, engine, None, [0.0] * 8, o, micro=[[0, 1, 2, 3], [4, 5, 6, 7]])
        assert loss == 0.0 and all(g == 0.0 for s in grads for g in s)
    empty = [[]] * 4
    for opts in OPTIONS.values():
        loss, _, stats = run_step_loss(empty, empty, empty, None, [1.0, -1.0, 0.5, -0.5], GRPOConfig(**opts),
                                       micro=[[0, 1], [2, 3]])
        assert loss == 0.0 and stats["tokens"] == 0


# -- advantages ---------------------------------------------------------------------------------------


def test_rloo_is_the_leave_one_out_baseline_and_batch_std_the_whole_steps():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    rows = r.tolist()
    loo = [[x - (sum(g) - x) / (len(g) - 1) for x in g] for g in rows]  # r_i - mean of the others
    got = group_advantages(r, scale_by_std=False, baseline="rloo")
    assert got.flatten().tolist() == pytest.approx([x for g in loo for x in g], abs=1e-6)
    assert got[0].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    flat = [x for g in rows for x in g]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (len(flat) - 1))  # Bessel, as TRL's rewards.std()
    got = group_advantages(r, baseline="grpo", std_scope="batch")
    want = [(x - sum(g) / len(g)) / (std + 1e-6) for g in rows for x in g]
    assert got.flatten().tolist() == pytest.approx(want, rel=1e-5)
    group_std = [math.sqrt(sum((x - sum(g) / 4) ** 2 for x in g) / 3) for g in rows]
    got = group_advantages(r, baseline="rloo", std_scope="group")
    want = [lo / (s + 1e-6) for g, s, lg in zip(rows, group_std, loo) for lo in lg]
    assert got.flatten().tolist() == pytest.approx(want, rel=1e-5)
    assert group_advantages(r[2:], baseline="rloo").abs().max() == 0  # an equal group: nothing, in every mode
    assert group_advantages(r[2:], std_scope="batch").abs().max() == 0


def test_the_batch_keeps_the_first_informative_groups_a_refilled_step_needs():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    prompts = [[1, 10 + i] for i in range(5)]
    completions = [Completion([7], [-0.5], "stop") for _ in range(10)]
    batch, kept = training_batch(prompts, completions, rewards, GRPOConfig(std_scope="batch"), max_groups=2)
    assert kept == 2 and batch.input_ids[:, 1].tolist() == [10, 10, 12, 12]  # groups 0 and 2, not 3 and 4
    # the std is the whole step's: every group's rewards, the equal and the unused ones too
    std = statistics.stdev(x for g in rewards.tolist() for x in g)
    a = 0.5 / (std + 1e-6)
    assert batch.advantages.tolist() == pytest.approx([a, -a, -a, a], rel=1e-5)


# -- configuration --------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, key", [
    ("grpo.ratio_level=sentence", "grpo.ratio_level"), ("grpo.dual_clip=0.5", "grpo.dual_clip"),
    ("grpo.dual_clip=1", "grpo.dual_clip"), ("grpo.log_ratio_clamp=-1", "grpo.log_ratio_clamp"),
    ("grpo.loss_aggregation=seq_sum", "grpo.loss_aggregation"),
    ("grpo.rollout_correction=mis", "grpo.rollout_correction"),
    ("grpo.kl_estimator=k4", "grpo.kl_estimator"), ("grpo.advantage=ppo", "grpo.advantage"),
    ("grpo.std_scope=global", "grpo.std_scope"), ("grpo.tis_cap=0", "grpo.tis_cap"),
    ("grpo.mask_high=0.9", "grpo.mask_low"), ("grpo.loss_norm_tokens=-2", "grpo.loss_norm_tokens"),
    ("rollout.refill_rounds=-1", "rollout.refill_rounds")])
def test_a_bad_objective_key_is_named(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, ["grpo.rollout_correction=token_mask", override] if "mask_" in override else [override])


def test_keys_that_need_each_other():
    with pytest.raises(ConfigError, match=r"rollout\.refill_rounds.*drop_equal_reward_groups"):
        load_config(None, ["rollout.refill_rounds=2", "grpo.drop_equal_reward_groups=false"])
    assert load_config(None, ["grpo.rollout_correction=none", "grpo.tis_cap=0"]).grpo.tis_cap == 0
    assert GRPOConfig(rollout_correction="icepop").mask_band() == (0.5, 5.0)
    assert GRPOConfig(rollout_correction="geometric_mask", mask_high=1.01).mask_band() == (0.999, 1.01)
    cfg = load_config(None, ["grpo.loss_aggregation=seq_mean_token_sum_norm", "rollout.max_new_tokens=64"])
    assert cfg.grpo.loss_norm_tokens == 64  # resolved at load: a trainer built from cfg.grpo alone has it
    assert load_config(None, ["grpo.loss_norm_tokens=9"]).grpo.loss_norm_tokens == 9
    assert GRPOConfig(loss_norm_tokens=7).for_rollout(64).loss_norm_tokens == 7
