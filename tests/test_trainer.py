"""The torch policy trainer: a GRPO update moves the policy the right way, a NaN update is skipped."""

import pytest
import torch

from fastgrpo.trainers.torch_trainer import TorchPolicyTrainer
from fastgrpo.config import GRPOConfig, OptimConfig
from fastgrpo.types import SamplingParams
from fastgrpo.grpo.batch import build_batch
from fastgrpo.models.policy import new_policy, policy_config


def make(seed=0, **grpo):
    policy = new_policy(policy_config("test", 50, 64, 1, 2, 0), seed=seed)
    reference = new_policy(policy_config("test", 50, 64, 1, 2, 0), seed=seed) if grpo.get("kl_coef") else None
    trainer = TorchPolicyTrainer(policy, GRPOConfig(**grpo), OptimConfig(lr=1e-2), SamplingParams(temperature=1.0),
                                 reference)
    return policy, trainer


def batch_for(trainer, advantages):
    prompts = [[1, 5, 6], [1, 5, 6]]
    responses = [[7, 8, 9], [10, 11]]
    b = build_batch(prompts, responses, [[0.0] * 3, [0.0] * 2], torch.tensor(advantages), pad_id=0)
    b.engine_logprobs = trainer.logprobs(b) * b.response_mask  # sampled by an engine with the same weights
    return b


def test_update_raises_logprob_of_positive_advantage():
    _, trainer = make(epochs=2, minibatches=2)
    batch = batch_for(trainer, [1.0, -1.0])
    before = trainer.logprobs(batch)
    metrics = trainer.train_step(batch)
    after = trainer.logprobs(batch)
    m = batch.response_mask
    assert metrics["updates"] == 4 and metrics["skipped_updates"] == 0
    assert (after[0][m[0]].sum() > before[0][m[0]].sum()).item()
    assert (after[1][m[1]].sum() < before[1][m[1]].sum()).item()
    # the second epoch's ratios have moved past the clip range on some tokens (lr 1e-2)
    assert metrics["grad_norm"] > 0 and 0 < metrics["clip_fraction"] < 1


@pytest.mark.parametrize("epochs,minibatches", [(1, 1), (1, 2), (2, 2)])
def test_the_engine_trainer_mismatch_is_measured_at_equal_weights(epochs, minibatches):
    """An engine that sampled with the trainer's own weights mismatches it by nothing, however many
    updates the step makes (lr 1e-2 moves the policy by far more than the tolerance between them);
    a known shift of the engine's log-probabilities reads back as that shift."""
    _, trainer = make(epochs=epochs, minibatches=minibatches)
    batch = batch_for(trainer, [1.0, -1.0])
    moved = trainer.logprobs(batch)
    metrics = trainer.train_step(batch)
    assert metrics["updates"] == epochs * minibatches
    assert abs(metrics["kl_engine_trainer"]) < 1e-7
    moved = (trainer.logprobs(batch) - moved)[batch.response_mask].abs().max()
    assert moved > 1e-3  # the policy did move within the step
    _, trainer = make(epochs=epochs, minibatches=minibatches)
    batch = batch_for(trainer, [1.0, -1.0])
    batch.engine_logprobs = (batch.engine_logprobs + 0.25) * batch.response_mask
    assert trainer.train_step(batch)["kl_engine_trainer"] == pytest.approx(0.25, abs=1e-6)


def test_only_the_trainable_parameters_move_and_the_update_still_helps():
    policy = new_policy(policy_config("test", 50, 64, 1, 2, 0), seed=0)
    trainer = TorchPolicyTrainer(policy, GRPOConfig(), OptimConfig(lr=1e-2, trainable=r"norm"),
                                 SamplingParams(temperature=1.0))
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    batch = batch_for(trainer, [1.0, -1.0])
    lp_before = trainer.logprobs(batch)
    trainer.train_step(batch)
    moved = {n for n, p in policy.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("norm" in n for n in moved), moved
    assert len(moved) == sum("norm" in n for n in before)  # every norm weight, and nothing else
    m = batch.response_mask[0]
    assert trainer.logprobs(batch)[0][m].sum() > lp_before[0][m].sum()
    grad = trainer.loss_gradient(batch)  # frozen parameters contribute zeros
    assert grad.numel() == sum(p.numel() for p in policy.parameters()) and grad.abs().sum() > 0
    with pytest.raises(ValueError, match="matches no parameter"):
        TorchPolicyTrainer(policy, GRPOConfig(), OptimConfig(trainable="no_such_weight"), SamplingParams())


def test_nan_loss_skips_update_and_keeps_weights():
    policy, trainer = make()
    batch = batch_for(trainer, [float("nan"), 1.0])
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    metrics = trainer.train_step(batch)
    assert metrics["skipped_updates"] == 1 and metrics["updates"] == 0
    for k, v in policy.state_dict().items():
        assert torch.equal(v, before[k]), k
    # and the optimiser was not poisoned: a clean batch still trains
    metrics = trainer.train_step(batch_for(trainer, [1.0, -1.0]))
    assert metrics["updates"] == 1


def test_save_load_roundtrip(tmp_path):
    policy, trainer = make(seed=1)
    trainer.train_step(batch_for(trainer, [1.0, -1.0]))
    trainer.save(tmp_path)
    policy2, trainer2 = make(seed=2)
    trainer2.load(tmp_path)
    for (k, v), (_, w) in zip(policy.state_dict().items(), policy2.state_dict().items()):
        assert torch.equal(v, w), k
    b = batch_for(trainer, [1.0, -1.0])
    m1, m2 = trainer.train_step(b), trainer2.train_step(b)
    assert m1["loss"] == m2["loss"]
    for (k, v), (_, w) in zip(policy.state_dict().items(), policy2.state_dict().items()):
        assert torch.equal(v, w), k  # optimiser state restored too


def _correction(old, engine, mode, tis_cap, band):
    """The rollout correction's weight of each token of a sequence, from rho = pi_old / pi_engine and
    the sequence's product of them (docs/objective.md)."""
    rho = torch.exp(old - engine)
    whole, n = rho.prod(), len(rho)
    inside = lambda v: ((band[0] <= v) & (v <= band[1])).to(rho.dtype)  # noqa: E731
    return {"none": torch.ones_like(rho), "token_tis": rho.clamp(max=tis_cap),
            "sequence_tis": whole.clamp(max=tis_cap).expand(n), "token_mask": inside(rho),
            "sequence_mask": inside(whole).expand(n), "geometric_mask": inside(whole ** (1 / n)).expand(n),
            "icepop": rho * inside(rho)}[mode]


def oracle_grpo(policy, prompts, responses, engine_lp, rewards, G, *, lr, epochs, minibatches, eps_low, eps_high,
                tis_cap, aggregation, grad_clip, kl_coef=0.0, ratio_level="token", dual_clip=0.0, log_ratio_clamp=0.0,
                correction="token_tis", band=(0.5, 2.0), kl_estimator="k3", norm_tokens=0, gradients=None):
    """GRPO written out plainly, one sequence at a time, from the formulas: the reference the trainer is
    checked against, with the KL to the starting policy when `kl_coef` (k1 log(pi/ref), k2 its square
    over 2, k3 ref/pi - log(ref/pi) - 1). GSPO (`ratio_level="sequence"`) as its paper states it, one
    ratio (pi(y|x)/pi_old(y|x))^(1/|y|) per sequence (so with a correction constant over the sequence);
    dual clip max(objective, c A) for A < 0; the log-ratios clamped at `log_ratio_clamp`; aggregations
    token_mean, seq_mean, seq_mean_token_sum and seq_mean_token_sum_norm (over N x `norm_tokens`).
    Returns the loss and gradient norm of every optimiser step (`gradients`: a list that gets each step's
    gradient, flattened, before clipping)."""
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, G)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).flatten().tolist()
    clamp = (lambda x: x.clamp(-log_ratio_clamp, log_ratio_clamp)) if log_ratio_clamp else (lambda x: x)

    def logp_of(model, i):
        ids = torch.tensor([prompts[i] + responses[i]])
        logits = model(input_ids=ids).logits[0, len(prompts[i]) - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(responses[i])[:, None])[:, 0]

    def kl(logp, ref):
        x = clamp(logp - ref)
        return {"k1": x, "k2": x.square() / 2, "k3": torch.exp(-x) + x - 1}[kl_estimator]

    with torch.no_grad():
        old = [logp_of(policy, i) for i in range(len(prompts))]
    ref = old  # the KL's reference is the starting policy, which sampled the batch
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    n, per_mb, losses, norms = len(prompts), -(-len(prompts) // minibatches), [], []
    for _ in range(epochs):
        for start in range(0, n, per_mb):
            rows = range(start, min(start + per_mb, n))
            opt.zero_grad()
            total, count = 0.0, 0
            for i in rows:
                logp = logp_of(policy, i)
                x = (logp - old[i]).mean() if ratio_level == "sequence" else logp - old[i]
                ratio = torch.exp(clamp(x))
                objective = torch.minimum(ratio * adv[i], ratio.clamp(1 - eps_low, 1 + eps_high) * adv[i])
                if dual_clip and adv[i] < 0:
                    objective = torch.maximum(objective, torch.tensor(dual_clip * adv[i]))
                w = _correction(old[i], torch.tensor(engine_lp[i]), correction, tis_cap, band)
                per_token = -objective * w + kl_coef * kl(logp, ref[i])
                total = total + (per_token.mean() if aggregation == "seq_mean" else per_token.sum())
                count += {"token_mean": len(responses[i]), "seq_mean": 1, "seq_mean_token_sum": 1,
                          "seq_mean_token_sum_norm": norm_tokens}[aggregation]
            loss = total / count
            loss.backward()
            if gradients is not None:
                gradients.append(torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                                            for p in policy.parameters()]))
            norms.append(float(torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip)))
            opt.step()
            losses.append(loss.item())
    return losses, norms


# the objective's options as the trainers are checked under them: every option in some run,
# each run's branches active on the contract's batch (its metric says so); GSPO with corrections that
# are constant over a sequence, where its paper's sequence-level objective and the token form agree
OPTION_RUNS = {
    "gspo": (dict(ratio_level="sequence", loss_aggregation="seq_mean", rollout_correction="sequence_tis",
                  tis_cap=1.3, dual_clip=1.01), ("dual_clip_fraction", "correction_truncated_fraction")),
    "clamp": (dict(log_ratio_clamp=0.1, loss_aggregation="seq_mean_token_sum", rollout_correction="token_mask",
                   mask_low=0.7, mask_high=1.4, kl_coef=0.1, kl_estimator="k1"),
              ("ratio_clamped_fraction", "correction_masked_fraction", "kl_ref")),
    "dr_grpo": (dict(loss_aggregation="seq_mean_token_sum_norm", loss_norm_tokens=48, rollout_correction="icepop",
                     mask_low=0.7, mask_high=1.4, kl_coef=0.1, kl_estimator="k2"),
                ("correction_masked_fraction", "kl_ref")),
    "sequence_mask": (dict(rollout_correction="sequence_mask", mask_low=0.7, mask_high=1.4, dual_clip=1.05),
                      ("correction_masked_fraction", "dual_clip_fraction")),
    "geometric": (dict(ratio_level="sequence", rollout_correction="geometric_mask", mask_low=0.9, mask_high=1.1),
                  ("correction_masked_fraction",)),
    "no_correction": (dict(rollout_correction="none", kl_coef=0.1, kl_estimator="k3"), ("kl_ref",)),
}


def oracle_options(options: dict) -> dict:
    """`oracle_grpo`'s keywords for a GRPOConfig's options."""
    from fastgrpo.config import GRPOConfig

    c = GRPOConfig(**options)
    return dict(ratio_level=c.ratio_level, dual_clip=c.dual_clip, log_ratio_clamp=c.log_ratio_clamp,
                correction=c.rollout_correction, band=c.mask_band(), kl_estimator=c.kl_estimator,
                norm_tokens=c.loss_norm_tokens, aggregation=c.loss_aggregation, kl_coef=c.kl_coef, tis_cap=c.tis_cap)


@pytest.mark.parametrize("aggregation,kl_coef", [("token_mean", 0.0), ("seq_mean", 0.0), ("token_mean", 0.5)])
def test_train_step_matches_a_plain_grpo_oracle(aggregation, kl_coef):
    """Advantages, token alignment, masking, normalisation, clipping, TIS, the KL to the starting
    policy and the optimiser loop of the trainer, against the plain implementation above on the same
    batch (two epochs of two minibatches at a learning rate high enough that the clip is active in the
    second epoch). Adam is blind to a constant scale of the gradient, so the losses and gradient
    norms are compared too."""
    metrics = _against_oracle(dict(loss_aggregation=aggregation, tis_cap=1.5, kl_coef=kl_coef))
    assert (metrics["kl_ref"] > 1e-6) == (kl_coef > 0)  # the KL term was there, measured after the first update
    assert metrics["clip_fraction"] > 0  # the clipped branch was exercised


@pytest.mark.parametrize("name", list(OPTION_RUNS))
def test_train_step_matches_the_oracle_under_each_objective_option(name):
    """The same check under the objective's options (GSPO, dual clip, log-ratio clamp, Dr. GRPO's
    aggregations, the rollout corrections, k1/k2/k3), each run's option active on this batch."""
    options, active = OPTION_RUNS[name]
    # the weights within 1e-3 of the update: over four steps Adam's per-coordinate scaling amplifies
    # rounding-level differences of the gradient (5e-4 measured; the gradient itself agrees to 1e-6, below)
    metrics = _against_oracle(options, weight_tol=1e-3)
    assert all(metrics[key] != 0 for key in active), {key: metrics[key] for key in active}


@pytest.mark.parametrize("name", list(OPTION_RUNS))
def test_the_gradient_is_the_oracles_under_each_objective_option(name):
    """The GRPO step's gradient at the trainer's weights (on-policy: the ratio 1; the correction, the KL
    and the aggregation all at work) is the oracle's to 1e-6, in fp32."""
    import copy

    G = 4
    options, _ = OPTION_RUNS[name]
    prompts, responses, rewards, batch, noise = _oracle_batch(G)
    policy, trainer = make(seed=4, **options)
    reference = copy.deepcopy(policy)
    batch.engine_logprobs = (trainer.logprobs(batch) + noise) * batch.response_mask
    engine_lp = [batch.engine_logprobs[i, len(p) : len(p) + len(r)].tolist()
                 for i, (p, r) in enumerate(zip(prompts, responses))]
    got, want = trainer.loss_gradient(batch), []
    oracle_grpo(reference, prompts, responses, engine_lp, rewards, G, lr=0.0, epochs=1, minibatches=1, eps_low=0.2,
                eps_high=0.28, grad_clip=1.0, gradients=want, **oracle_options(options))
    assert (got - want[0]).norm() <= 1e-6 * want[0].norm()


def _oracle_batch(G: int):
    """Two prompts, a group of 4 answers each, rewards 1 0 0 1 / 0 0 1 0, and the engine's noise."""
    from fastgrpo.grpo.advantages import group_advantages

    gen = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 50, (int(n),), generator=gen).tolist() for n in (3, 5, 3, 5, 3, 5, 3, 5)]
    prompts = [prompts[i // G * G] for i in range(8)]  # two prompts, a group of 4 each
    responses = [torch.randint(3, 50, (int(n),), generator=gen).tolist() for n in (4, 7, 2, 9, 5, 3, 8, 6)]
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    advantages = group_advantages(torch.tensor(rewards).view(-1, G)).flatten()
    batch = build_batch(prompts, responses, [[0.0] * len(r) for r in responses], advantages, pad_id=0)
    # engine log-probabilities that differ from the trainer's, so that the correction matters
    noise = 0.3 * torch.randn(batch.input_ids.shape, generator=gen)
    return prompts, responses, rewards, batch, noise


def _against_oracle(options: dict, weight_tol: float = 1e-4) -> dict[str, float]:
    """The torch trainer's step with GRPOConfig `options` and the oracle's on the same batch: the same
    losses, gradient norms and weights. The trainer's metrics."""
    import copy

    G = 4
    prompts, responses, rewards, batch, noise = _oracle_batch(G)
    policy, trainer = make(seed=4, epochs=2, minibatches=2, **options)
    reference, start = copy.deepcopy(policy), copy.deepcopy(policy.state_dict())
    batch.engine_logprobs = (trainer.logprobs(batch) + noise) * batch.response_mask
    engine_lp = [batch.engine_logprobs[i, len(p) : len(p) + len(r)].tolist()
                 for i, (p, r) in enumerate(zip(prompts, responses))]
    metrics = trainer.train_step(batch)
    losses, norms = oracle_grpo(reference, prompts, responses, engine_lp, rewards, G, lr=1e-2, epochs=2, minibatches=2,
                                eps_low=0.2, eps_high=0.28, grad_clip=1.0, **oracle_options(options))
    assert metrics["updates"] == 4
    assert metrics["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-4, abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(sum(norms) / len(norms), rel=1e-4)
    # whole tensors: Adam divides each coordinate's step by its own gradient scale, so a coordinate whose
    # gradient is at rounding level may move differently in the two (equally correct) computations;
    # seen in CI: one coordinate of an up_proj 1.3e-3 of the tensor's largest update off
    for (name, got), (_, want) in zip(policy.state_dict().items(), reference.state_dict().items()):
        update = (want - start[name]).norm()
        assert update > 0 and (got - want).norm() <= weight_tol * update, name
    return metrics
