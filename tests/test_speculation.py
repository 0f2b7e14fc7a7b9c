"""Speculative decoding: lossless (greedy identity, chi-square on sampled joints), correct KV paths."""

import pytest
import torch

from fastgrpo.types import SamplingParams, Request
from fastgrpo.backends.torch_trainer import token_logprobs
from fastgrpo.draft_learning.pretrain import target_states
from fastgrpo.draft_learning.trainer import DraftTrainer
from fastgrpo.engine.engine import EmbeddedEngine
from fastgrpo.engine.model import KVCache, block_mask, cache_kv
from fastgrpo.engine.sampling import sampling_logprobs
from fastgrpo.grpo.batch import build_batch
from fastgrpo.models.policy import new_policy, policy_config
from fastgrpo.speculation.draft import DraftHead
from fastgrpo.speculation.cost_model import CostModel, load_or_calibrate
from fastgrpo.speculation.policy import Aware, FastGRPOFormula, Static
from fastgrpo.speculation.tree import SpecConfig
from tests.conftest import first_divergence_is_a_near_tie

VOCAB = 8
PROMPT = [1, 3, 4]


@pytest.fixture(scope="module")
def small_vocab():
    """A target with 8 tokens and peaked distributions, and a random (deliberately poor) draft."""
    cfg = policy_config("test", VOCAB, 64, bos_id=1, eos_id=VOCAB + 1, pad_id=0)
    target = new_policy(cfg, seed=11).eval()
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(3.0)  # tied head: sharper, varied next-token distributions
    draft = DraftHead(cfg)
    draft.reset_parameters(seed=5)
    return cfg, target, draft


@pytest.fixture(scope="module")
def trained_draft(small_vocab):
    """A draft trained briefly on the target's own samples: accepted often, far from always."""
    cfg, target, _ = small_vocab
    out = engine_for(cfg, target, None).generate([Request(PROMPT)] * 64, SamplingParams(max_new_tokens=40), seed=1)
    hidden, tokens, mask = target_states(target, [PROMPT + o.token_ids for o in out])
    draft = DraftHead(cfg)
    draft.bind_target(target.model.embed_tokens.weight, target.lm_head.weight)
    trainer = DraftTrainer(draft, lr=3e-3)
    for _ in range(150):
        trainer.step(hidden, tokens, mask)
    return draft


def engine_for(cfg, target, draft, policy=None, max_batch=64):
    e = EmbeddedEngine(cfg, max_batch, 64, eos_id=VOCAB + 1, pad_id=0, policy=policy)
    e.update_weights(target.state_dict().items(), 0)
    if draft is not None:
        e.update_draft(draft.state_dict().items(), 0)
    return e


def exact_joint(target, sampling):
    """P(t1, t2, t3 | prompt) under the sampling distribution, from full forwards."""
    seqs = [[]]
    probs = torch.ones(1)
    for _ in range(3):
        ids = torch.tensor([PROMPT + s for s in seqs])
        with torch.no_grad():
            p = sampling_logprobs(target(ids).logits[:, -1], sampling).exp()
        probs = (probs[:, None] * p).flatten()
        seqs = [s + [t] for s in seqs for t in range(VOCAB)]
    return probs  # index t1 * 64 + t2 * 8 + t3


def sampled_counts(engine, sampling, n, seed):
    counts = torch.zeros(VOCAB**3)
    for i in range(0, n, 500):
        out = engine.generate([Request(PROMPT, max_new_tokens=3)] * 500, sampling, seed=seed + i)
        for o in out:
            t = o.token_ids
            counts[t[0] * 64 + t[1] * 8 + t[2]] += 1
    return counts


def chi_square_p(counts, probs):
    """Goodness of fit; the least likely cells are pooled until every bin expects >= 5 samples."""
    expected = probs * counts.sum()
    order = torch.argsort(expected)
    exp_sorted, obs_sorted = expected[order], counts[order]
    pooled = torch.cumsum(exp_sorted, 0) < 5  # the rare tail, pooled into one bin with the next cell
    cut = int(pooled.sum()) + 1
    exp = torch.cat([exp_sorted[:cut].sum()[None], exp_sorted[cut:]])
    obs = torch.cat([obs_sorted[:cut].sum()[None], obs_sorted[cut:]])
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = exp.numel() - 1
    return torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0).item()


@pytest.mark.slow
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sampled_joint_matches_target(small_vocab, trained_draft, top_p):
    cfg, target, _ = small_vocab
    draft = trained_draft
    sampling = SamplingParams(temperature=1.0, top_p=top_p, max_new_tokens=3)
    probs = exact_joint(target, sampling)
    spec = engine_for(cfg, target, draft, Static(SpecConfig(depth=3, topk=3, num_verify=8)))
    counts = sampled_counts(spec, sampling, 12000, seed=100)
    assert 1.2 < spec.stats()["accept_len"] < 3.0  # accepted often, rejected often: both branches matter
    assert chi_square_p(counts, probs) > 1e-3
    plain = sampled_counts(engine_for(cfg, target, None), sampling, 12000, seed=100)
    assert chi_square_p(plain, probs) > 1e-3
    # the test has power: sampling at temperature 1.15 instead of 1 is caught
    biased = exact_joint(target, SamplingParams(temperature=1.15, top_p=top_p, max_new_tokens=3))
    assert chi_square_p(counts, biased) < 1e-3


def test_greedy_speculative_equals_greedy_plain(small_vocab, trained_draft):
    cfg, target, _ = small_vocab
    draft = trained_draft
    g = torch.Generator().manual_seed(0)
    reqs = [Request(torch.randint(2, VOCAB, (int(n),), generator=g).tolist(), max_new_tokens=m)
            for n, m in [(3, 30), (5, 12), (2, 40), (7, 25), (4, 1), (6, 33)]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    plain = [c.token_ids for c in engine_for(cfg, target, None).generate(reqs, greedy)]
    for policy, max_batch in [(Static(SpecConfig(2, 2, 3)), 2), (Static(SpecConfig(4, 3, 10)), 6),
                              (FastGRPOFormula(), 3)]:
        engine = engine_for(cfg, target, draft, policy, max_batch)
        assert [c.token_ids for c in engine.generate(reqs, greedy)] == plain
        assert engine.stats()["accept_len"] > 1.0  # paths were accepted, so the KV moves were exercised


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0, max_new_tokens=40),
                                      SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=40)])
def test_sampled_speculative_equals_sampled_plain(small_vocab, trained_draft, sampling):
    """With noise keyed by (seed, request, position), verification samples each position exactly as
    plain decoding does: the same tokens, except after a float-rounding flip at a CDF boundary. Covers
    deep accepts, trees that change with concurrency (fastgrpo, aware) and prompts of mixed lengths."""
    cfg, target, _ = small_vocab
    g = torch.Generator().manual_seed(3)
    reqs = [Request(torch.randint(2, VOCAB, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist(),
                    max_new_tokens=int(torch.randint(5, 41, (1,), generator=g))) for _ in range(48)]
    plain = [c.token_ids for c in engine_for(cfg, target, None).generate(reqs, sampling, seed=9)]
    costs = CostModel({t: 0.01 for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)},
                      {t: 0.001 for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)})  # verify is free: speculate
    for policy, max_batch in [(Static(SpecConfig(4, 3, 10)), 16), (FastGRPOFormula(), 48), (Aware(costs), 48)]:
        engine = engine_for(cfg, target, trained_draft, policy, max_batch)
        spec = [c.token_ids for c in engine.generate(reqs, sampling, seed=9)]
        assert engine.stats()["spec_steps"] > 0 and engine.stats()["accept_len"] > 1.3
        same = sum(a == b for a, b in zip(spec, plain))
        assert same >= 44, f"{policy.name}: only {same} of 48 sequences identical"
        for i, (a, b) in enumerate(zip(spec, plain)):
            assert first_divergence_is_a_near_tie(target, reqs[i].prompt_ids, a, b, sampling, 9, i), (policy.name, i)


class EveryKth(Static):
    """Speculates on every k-th decode step and decodes plainly between (as aware's probes do)."""

    def __init__(self, config: SpecConfig, k: int):
        super().__init__(config)
        self.k, self.steps = k, 0

    def choose(self, running: int) -> SpecConfig | None:
        self.steps += 1
        return self.config if self.steps % self.k == 0 else None


def test_draft_catch_up_after_plain_steps_feeds_only_a_window(small_vocab, trained_draft):
    """After a stretch of plain steps the draft consumes at most `draft_window` states per row, and
    the output is still exactly the plain engine's (greedy), with paths still accepted."""
    cfg, target, _ = small_vocab
    reqs = [Request(p, max_new_tokens=m) for p, m in [(PROMPT, 40), ([1, 2], 30), ([1, 5, 5, 6, 7], 35)]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    plain = [c.token_ids for c in engine_for(cfg, target, None).generate(reqs, greedy)]
    engine = engine_for(cfg, target, trained_draft, EveryKth(SpecConfig(3, 2, 5), k=6), max_batch=2)
    engine.draft_window = 3
    widths = []
    features = engine.draft.features

    def recording(hidden, *args):
        widths.append(hidden.shape[1])
        return features(hidden, *args)

    engine.draft.features = recording
    assert [c.token_ids for c in engine.generate(reqs, greedy)] == plain
    assert engine.stats()["accept_len"] > 1.0
    assert widths and max(widths) <= 3  # catch-ups and tree levels (topk 2) alike


def test_a_draft_swapped_in_mid_rollout_catches_up_instead_of_reading_the_old_drafts_cache(
        small_vocab, trained_draft, monkeypatch):
    """A new draft version installed between decode steps starts from the rows' target states, not from
    the cache the previous version wrote: its first prediction equals a fresh forward of the new draft
    over each row's whole history (captured from the same rollout)."""
    import fastgrpo.engine.engine as engine_module

    cfg, target, poor_draft = small_vocab
    reqs = [Request(p, max_new_tokens=30) for p in (PROMPT, [1, 2], [1, 5, 5, 6, 7])]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    engine = engine_for(cfg, target, poor_draft, Static(SpecConfig(3, 2, 5)))
    engine.draft_window = 64  # the catch-up after the swap may feed the whole history
    polls = iter(range(10_000))
    engine.draft_source = lambda: (trained_draft.state_dict().items(), 1) if next(polls) == 6 else None
    roots = []
    draft_tree = engine_module.draft_tree

    def recording(draft, cache, rows, root_features, *args):
        roots.append((engine.draft_version, engine.cache.lengths[rows].clone(), root_features.clone()))
        return draft_tree(draft, cache, rows, root_features, *args)

    monkeypatch.setattr(engine_module, "draft_tree", recording)
    out = engine.generate(reqs, greedy, capture=True)
    version, lengths, root = next(r for r in roots if r[0] == 1)  # the first step after the swap
    assert roots[0][0] == 0 and lengths.min() >= 8  # the swap came after the old version wrote its cache
    for b, (req, o) in enumerate(zip(reqs, out)):
        L = int(lengths[b])  # positions in the target cache; the pending token follows
        history = torch.tensor(req.prompt_ids + o.token_ids)
        positions = torch.arange(L)[None]
        with torch.inference_mode():
            fresh = trained_draft.features(o.hidden[None, :L], history[None, 1 : L + 1], positions,
                                           block_mask(torch.tensor([0]), L, L, None),
                                           cache_kv(KVCache(cfg, 1, 64, layers=1), 0, slice(0, 1), positions, L))
        assert torch.allclose(root[b], fresh[0, L - 1], atol=1e-4), b


def test_a_windowed_draft_row_ignores_what_came_before_the_window(small_vocab, trained_draft):
    """Keys before `visible_from` are invisible: the draft's output over a window equals its output
    over the same states in a fresh cache, whatever the skipped slots hold."""
    cfg, _, _ = small_vocab
    draft = trained_draft
    g = torch.Generator().manual_seed(2)
    hidden, tokens = torch.randn(1, 4, cfg.hidden_size, generator=g), torch.randint(0, VOCAB, (1, 4), generator=g)
    positions = torch.arange(10, 14)[None]

    def window_features(cache: KVCache) -> torch.Tensor:
        cache.visible_from[0] = 10
        mask = block_mask(torch.tensor([10]), 4, 14, None, cache.visible_from[:1])
        return draft.features(hidden, tokens, positions, mask, cache_kv(cache, 0, slice(0, 1), positions, 14))

    stale = KVCache(cfg, 1, 32, layers=1)
    stale.k.normal_(generator=g), stale.v.normal_(generator=g)
    fresh = KVCache(cfg, 1, 32, layers=1)
    with torch.inference_mode():
        assert torch.allclose(window_features(stale), window_features(fresh), atol=1e-6)
        stale.visible_from[0] = 0
        mask = block_mask(torch.tensor([10]), 4, 14, None)
        unmasked = draft.features(hidden, tokens, positions, mask, cache_kv(stale, 0, slice(0, 1), positions, 14))
    assert not torch.allclose(unmasked, window_features(fresh), atol=1e-3)  # the stale slots did matter


def test_accepted_path_cache_gives_full_forward_logprobs(small_vocab, trained_draft):
    """Every emitted token's log-probability from the speculative engine (computed over a cache
    rebuilt from accepted paths) equals a fresh full forward's."""
    cfg, target, _ = small_vocab
    draft = trained_draft
    engine = engine_for(cfg, target, draft, Static(SpecConfig(3, 3, 8)), max_batch=4)
    prompts = [PROMPT, [1, 2], [1, 5, 5, 6, 7], [1, 7, 2, 3]] * 2
    out = engine.generate([Request(p) for p in prompts], SamplingParams(temperature=1.0, max_new_tokens=40), seed=3)
    assert engine.stats()["accept_len"] > 1.2
    batch = build_batch(prompts, [o.token_ids for o in out], [o.logprobs for o in out], torch.zeros(8), pad_id=0)
    with torch.no_grad():
        lp, _ = token_logprobs(target, batch, SamplingParams(temperature=1.0))
    m = batch.response_mask
    assert (lp[m] - batch.engine_logprobs[m]).abs().max() < 1e-4


def test_fastgrpo_formula_is_guarded():
    f = FastGRPOFormula()
    assert f.choose(1) == SpecConfig(depth=5, topk=8, num_verify=160)
    assert f.choose(16) == SpecConfig(depth=3, topk=8, num_verify=10)
    assert f.choose(80) == SpecConfig(depth=3, topk=1, num_verify=2)
    assert f.choose(81) is None and f.choose(200) is None  # the original breaks (k = 0) / crashes here


def test_fastgrpo_policy_runs_200_sequences(small_vocab):
    cfg, target, draft = small_vocab
    engine = engine_for(cfg, target, draft, FastGRPOFormula(), max_batch=200)
    out = engine.generate([Request(PROMPT)] * 200, SamplingParams(temperature=1.0, max_new_tokens=12), seed=0)
    assert len(out) == 200 and all(len(o.token_ids) == 12 for o in out)
    buckets = engine.stats()["config_by_concurrency"]
    assert buckets[">128"] == {"off": 11}  # 200 running: plain decoding (token 1 comes from the prefill)


def test_bad_drafts_fall_back_or_fail_clearly(small_vocab):
    cfg, target, draft = small_vocab
    engine = engine_for(cfg, target, draft, Static(SpecConfig(3, 3, 8)), max_batch=4)
    wrong = {k: torch.zeros(3, 3) if k == "fc" else v for k, v in draft.state_dict().items()}
    with pytest.raises(ValueError, match="does not match"):
        engine.update_draft(wrong.items(), 1)
    nan_draft = {k: torch.full_like(v, float("nan")) if k == "norm" else v for k, v in draft.state_dict().items()}
    engine.update_draft(nan_draft.items(), 2)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    plain = engine_for(cfg, target, None).generate([Request(PROMPT)], greedy)[0].token_ids
    assert engine.generate([Request(PROMPT)], greedy)[0].token_ids == plain


def synthetic_costs():
    # memory-bound (flat) up to 64 tokens per forward, then compute-bound (linear); the draft is cheap
    target = {t: 0.010 * max(1.0, t / 64) for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)}
    draft = {t: 0.001 * max(1.0, t / 64) for t in target}
    return CostModel(target, draft)


def test_aware_chooses_the_shape_of_highest_predicted_goodput_or_plain_decoding():
    """Against a search written here: at each concurrency the best candidate by goodput, taken only if
    it beats plain decoding by the margin."""
    aware = Aware(synthetic_costs())
    choices = {}
    for running in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        best = max(aware.candidates, key=lambda c: aware.goodput(c, running))
        expected = best if aware.goodput(best, running) > aware.goodput(None, running) * (1 + aware.margin) else None
        choices[running] = aware.choose(running)
        assert choices[running] == expected, running
    assert choices[1] is not None and choices[1].depth >= 3  # the tail: speculate deep
    assert choices[256] is None  # saturated: plain decoding
    assert len({c for c in choices.values()}) >= 3  # the shape follows the concurrency


def test_aware_speculates_only_for_a_gain_above_its_margin():
    chain = SpecConfig(1, 1, 2)
    gain = Aware(synthetic_costs(), [chain]).goodput(chain, 1) / Aware(synthetic_costs(), [chain]).goodput(None, 1)
    assert gain > 1.1
    assert Aware(synthetic_costs(), [chain], margin=gain - 1 - 0.01).choose(1) == chain
    assert Aware(synthetic_costs(), [chain], margin=gain - 1 + 0.01).choose(1) is None


def test_aware_learns_acceptance_online():
    aware = Aware(synthetic_costs())
    deep = SpecConfig(6, 1, 7)
    before = aware.acceptance.expected(deep)
    for _ in range(50):  # a draft that is always right
        aware.observe(deep, 1, 7, 0.012, accepted=[6])
    assert aware.acceptance.expected(deep) > before + 2
    shallow = SpecConfig(2, 1, 3)
    for _ in range(50):  # and one that never is
        aware.observe(shallow, 1, 1, 0.012, accepted=[0])
    assert aware.acceptance.expected(shallow) < 1.3


def test_aware_corrects_its_cost_model_per_concurrency():
    """Speculation measured slower than predicted at 16 sequences turns it off there, and only there."""
    aware = Aware(synthetic_costs())
    spec16, spec1 = aware.choose(16), aware.choose(1)
    assert spec16 is not None and spec1 is not None
    for _ in range(48):
        c = aware.choose(16)
        if c is None:
            aware.observe(None, 16, 16, aware.predicted_seconds(None, 16))
        else:  # each speculative step takes three times its prediction
            aware.observe(c, 16, 16, 3 * aware.predicted_seconds(c, 16), accepted=[0] * 16)
    assert aware.choose(16) is None
    assert aware.choose(1) is not None  # what was learned at 16 sequences leaves 1 sequence alone
    assert aware.correction.get(("spec", 1), 1.0) == 1.0 and aware.correction[("spec", 16)] > 2


def test_aware_probes_plain_decoding_when_its_calibration_overrates_it():
    """A calibration that makes plain decoding look slow (here: 4x too slow at 16 sequences) keeps
    `aware` speculating until a probe measures plain decoding; then it switches, and only probes
    speculation now and then."""
    costs = synthetic_costs()
    aware = Aware(costs, probe_every=32)
    real_off = costs.target(16) / 4
    assert aware.choose(16) is not None
    chosen = []
    for _ in range(200):
        c = aware.choose(16)
        chosen.append(c)
        if c is None:
            aware.observe(None, 16, 16, real_off)
        else:  # speculation costs what the calibration says and accepts one draft token per step
            raw = aware.predicted_seconds(c, 16) / aware._correction("spec", 16)
            aware.observe(c, 16, 32, raw, accepted=[1] * 16)
    assert aware.choose(16) is None
    assert sum(c is not None for c in chosen[-100:]) <= 100 // 32 + 1  # probes only


def test_aware_probes_less_often_while_probes_confirm_its_choice():
    """Each probe that confirms plain decoding doubles the wait before the next (up to a cap); when
    speculation turns out faster, a probe overturns the choice and aware speculates from then on."""
    costs = synthetic_costs()
    # probe_budget=1: the back-off alone (the probes' share of time is bounded by the next test)
    aware = Aware(costs, probe_every=16, max_probe_every=128, probe_budget=1.0)
    real_off = costs.target(16) / 4  # plain decoding is much faster than calibrated
    spec_factor = 1.0  # speculation costs what the calibration says...

    def step() -> SpecConfig | None:
        c = aware.choose(16)
        if c is None:
            aware.observe(None, 16, 16, real_off)
        else:  # accepting one draft token per sequence per step
            raw = aware.predicted_seconds(c, 16) / aware._correction("spec", 16)
            aware.observe(c, 16, 32, raw * spec_factor, accepted=[1] * 16)
        return c

    chosen = [step() for _ in range(1200)]
    switched = chosen.index(None)  # speculates until a probe of plain decoding measures it
    probes = [i for i, c in enumerate(chosen) if c is not None and i > switched]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[-4:] == [129] * 4  # the interval doubled to its cap (128 plain steps, then the probe)
    assert gaps[0] < gaps[1] < gaps[2]
    spec_factor = 0.05  # ...until it becomes 20x cheaper: the next probe must overturn the choice
    chosen = [step() for _ in range(500)]
    assert sum(c is not None for c in chosen[-100:]) >= 90


def test_aware_spends_at_most_its_probe_budget_probing_while_plain_decoding_wins():
    """At high concurrency a probe (a speculative step) costs several plain steps: aware probes rarely
    enough that the probes' extra time stays within `probe_budget` of the whole, by the costs it sees."""
    costs = synthetic_costs()
    for budget in (0.01, 0.05):
        aware = Aware(costs, probe_budget=budget)
        spent = {"plain": 0.0, "probe": 0.0}
        for _ in range(20_000):
            c = aware.choose(256)
            seconds = aware.predicted_seconds(c, 256) / aware._correction("spec" if c else "off", 256)
            spent["probe" if c else "plain"] += seconds
            aware.observe(c, 256, 256 if c is None else 256 * 2, seconds, accepted=None if c is None else [1] * 256)
        plain_step = costs.target(256)
        probes_extra = spent["probe"] - (spent["probe"] / aware.predicted_seconds(aware.best_tree(256)[0], 256)) * plain_step
        assert spent["probe"] > 0  # it still probes
        assert probes_extra / (spent["plain"] + spent["probe"]) <= budget * 1.05


def test_cost_model_ignores_a_noisy_calibration_point():
    """A sample slowed by a busy machine (64 tokens measured slower than 128) must not make plain
    decoding at 64 sequences look expensive."""
    target = {1: 0.007, 16: 0.018, 64: 0.093, 128: 0.066, 256: 0.104}
    costs = CostModel(target, {t: 0.001 for t in target})
    assert costs.target(64) == 0.066 and costs.target(128) == 0.066 and costs.target(16) == 0.018
    assert all(costs.target(a) <= costs.target(b) for a, b in zip(range(1, 300), range(2, 301)))


def test_cost_model_calibrates_and_caches(small_vocab, tmp_path):
    cfg, target, draft = small_vocab
    engine = engine_for(cfg, target, draft)
    costs = load_or_calibrate(engine.model, engine.draft, tmp_path)
    assert all(v > 0 for v in costs.target_s.values()) and set(costs.target_s) == set(costs.draft_s)
    assert costs.target(10_000) > costs.target(1)  # extrapolates the compute-bound slope
    cached = list(tmp_path.glob("cost_model-*.json"))
    assert len(cached) == 1
    again = load_or_calibrate(engine.model, engine.draft, tmp_path)
    assert again.target_s == costs.target_s  # read from the cache, not re-measured
