"""Online draft learning: capture from rollout's own forwards, learning under a shifted policy,
checkpointed state, rejection of a broken update, and the training loop's metrics."""

import pytest
import torch

from fastgrpo.types import SamplingParams, Request
from fastgrpo.config import DraftConfig
from fastgrpo.draft_learning.online import OnlineDraftLearner
from fastgrpo.draft_learning.pretrain import target_states
from fastgrpo.draft_learning.trainer import DraftTrainer
from fastgrpo.engines.embedded.engine import EmbeddedEngine
from fastgrpo.models.policy import new_policy, policy_config
from fastgrpo.models.draft import DraftHead
from fastgrpo.speculation.policy import Static
from fastgrpo.speculation.spec import SpecConfig
from tests.conftest import assert_same_update

VOCAB = 16
EOS = VOCAB - 1
STATIC = Static(SpecConfig(depth=4, topk=2, num_verify=8))
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=40)


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, EOS, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def target():
    cfg = policy_config("test", VOCAB, 96, bos_id=1, eos_id=EOS, pad_id=0)
    model = new_policy(cfg, seed=11).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3.0)  # tied head: peaked, predictable distributions
    return model


@pytest.fixture(scope="module")
def warm_draft(target):
    """A draft trained offline on the unshifted target's samples."""
    out = engine(target, None).generate([Request(p) for p in prompts(48, 0)], SAMPLING, seed=1)
    draft = DraftHead(target.config)
    draft.bind_target(target.model.embed_tokens.weight, target.lm_head.weight)
    trainer = DraftTrainer(draft, lr=3e-3, batch_size=16)
    states = target_states(target, [p + o.token_ids for p, o in zip(prompts(48, 0), out)])
    for _ in range(150):
        trainer.step(*states)
    return draft


def engine(target, draft, policy=None) -> EmbeddedEngine:
    e = EmbeddedEngine(target.config, 16, 96, eos_id=EOS, pad_id=0, policy=policy)
    e.update_weights(target.state_dict().items(), 0)
    if draft is not None:
        e.update_draft(draft.state_dict().items(), 0)
    return e


def shifted(target, steps: int = 60):
    """The policy after RL moved it: fine-tuned to continue every token t with (3t + 1) mod 14 + 1, a
    pattern the warm draft never saw."""
    model = new_policy(target.config, seed=0)
    model.load_state_dict(target.state_dict())
    g = torch.Generator().manual_seed(0)
    start = torch.randint(1, EOS, (64, 1), generator=g)
    seqs = [start]
    for _ in range(24):
        seqs.append((3 * seqs[-1] + 1) % 14 + 1)
    ids = torch.cat(seqs, dim=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval().requires_grad_(False)


def learner_for(target, warm_draft, engines, **cfg) -> OnlineDraftLearner:
    draft = DraftHead(target.config)
    draft.load_state_dict(warm_draft.state_dict())
    draft.bind_target(target.model.embed_tokens.weight, target.lm_head.weight)
    return OnlineDraftLearner(draft, DraftConfig(online_lr=3e-3, batch_size=16, sync_max_steps=40, **cfg), engines)


def test_capture_needs_no_extra_target_forward_and_holds_the_true_states(target, warm_draft):
    calls = {}

    def counted(e, key):
        real = e.model.forward
        def forward(*a, **k):
            calls[key] = calls.get(key, 0) + 1
            return real(*a, **k)
        e.model.forward = forward
        return e

    plain = counted(engine(target, warm_draft, STATIC), "plain")
    capturing = counted(engine(target, warm_draft, STATIC), "capture")
    reqs = [Request(p) for p in prompts(12, 3)]
    a = plain.generate(reqs, SAMPLING, seed=5)
    b = capturing.generate(reqs, SAMPLING, seed=5, capture=True)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert calls["plain"] == calls["capture"]
    assert capturing.stats()["spec_steps"] > 0 and all(o.hidden is None for o in a)
    # the captured rows are the target's own states along prompt + accepted path
    for r, o in zip(reqs, b):
        seq = r.prompt_ids + o.token_ids
        assert o.hidden.shape == (len(seq) - 1, target.config.hidden_size)
        full, _, _ = target_states(target, [seq])
        torch.testing.assert_close(o.hidden, full[0, :-1], atol=1e-4, rtol=1e-4)


def test_online_draft_recovers_acceptance_on_a_shifted_policy(target, warm_draft):
    policy = shifted(target)
    frozen = engine(policy, warm_draft, STATIC)
    online = engine(policy, warm_draft, STATIC)
    learner = learner_for(policy, warm_draft, [online])
    fresh_top1 = []  # the published draft scored on each new rollout before it trains on it
    for round in range(4):
        ps = prompts(32, 100 + round)
        out = online.generate([Request(p) for p in ps], SAMPLING, seed=round, capture=True)
        learner.observe(ps, out, policy_version=1)
        fresh_top1.append(learner.fresh["draft_top1_fresh"])
        assert learner.train(budget_s=60.0)["draft_rejected"] == 0.0
    assert fresh_top1[-1] > fresh_top1[0] + 0.1, fresh_top1
    assert learner.version == 4 and online.draft_version == 4
    test = [Request(p) for p in prompts(48, 999)]
    frozen.generate(test, SAMPLING, seed=42)
    online.generate(test, SAMPLING, seed=42)
    before, after = frozen.stats()["accept_len"], online.stats()["accept_len"]
    assert after > 1.15 * before, (before, after)


def observing_learner(target, warm_draft, prompt_seed: int, policy_version: int) -> OnlineDraftLearner:
    """A learner that has buffered one rollout of 8 prompts from a capturing engine."""
    e = engine(target, warm_draft, STATIC)
    learner = learner_for(target, warm_draft, [e])
    ps = prompts(8, prompt_seed)
    learner.observe(ps, e.generate([Request(p) for p in ps], SAMPLING, seed=0, capture=True), policy_version=policy_version)
    return learner


def test_checkpoint_restores_draft_optimizer_and_buffer(tmp_path, target, warm_draft):
    learner = observing_learner(target, warm_draft, prompt_seed=5, policy_version=3)
    learner.train(budget_s=60.0)
    learner.save(tmp_path / "draft")

    fresh_engine = engine(target, warm_draft, STATIC)
    restored = learner_for(target, warm_draft, [fresh_engine])
    restored.load(tmp_path / "draft")
    assert restored.version == learner.version == 1 and restored.policy_version == 3
    assert restored.trainer.buffered_tokens == learner.trainer.buffered_tokens > 0
    for (h1, t1, m1), (h2, t2, m2) in zip(learner.trainer.buffer, restored.trainer.buffer):
        assert torch.equal(h1, h2) and torch.equal(t1, t2) and torch.equal(m1, m2)
    for k, v in learner.draft.state_dict().items():
        assert torch.equal(v, restored.draft.state_dict()[k]), k
        assert torch.equal(v, fresh_engine.draft.state_dict()[k]), k
    # identical next steps: optimizer moments and the batch sampler's RNG came back too
    a, b = learner.train(budget_s=60.0), restored.train(budget_s=60.0)
    assert a["draft_steps"] == b["draft_steps"] and a["draft_loss"] == b["draft_loss"]


def test_a_nan_update_is_rejected_and_the_previous_draft_kept(target, warm_draft, monkeypatch):
    learner = observing_learner(target, warm_draft, prompt_seed=6, policy_version=1)
    e = learner.engines[0]
    before = {k: v.clone() for k, v in learner.draft.state_dict().items()}
    real_step = DraftTrainer.step

    def poisoned(self, *batch):
        out = real_step(self, *batch)
        with torch.no_grad():
            self.draft.fc.fill_(float("nan"))
        return out

    monkeypatch.setattr(DraftTrainer, "step", poisoned)
    m = learner.train(budget_s=60.0)
    assert m["draft_rejected"] == 1.0 and learner.version == 0 and e.draft_version == 0
    for k, v in learner.draft.state_dict().items():
        assert torch.equal(v, before[k]), k
        assert torch.equal(e.draft.state_dict()[k], warm_draft.state_dict()[k]), k
    monkeypatch.setattr(DraftTrainer, "step", real_step)
    assert learner.train(budget_s=60.0)["draft_rejected"] == 0.0 and learner.version == 1


def test_bench_e2e_runs_the_three_modes(tmp_path, tiny_policy, tiny_draft):
    import json
    import statistics

    from fastgrpo.bench.e2e import bench_e2e
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path, tiny_policy, **{"draft.path": tiny_draft, "speculation.cost_model_dir": tmp_path / "costs",
                                                "draft.sync_budget": 0.5, "task.eval_size": 48})
    result = bench_e2e(cfg, quick=True, output=tmp_path / "e2e.json", steps=2)
    saved = json.loads((tmp_path / "e2e.json").read_text())
    assert saved["steps"] == 2 and (tmp_path / "e2e.png").stat().st_size > 10_000
    for mode in ("off", "frozen", "online"):
        assert len(saved[mode]["step_s"]) == len(saved[mode]["rollout_s"]) == len(saved[mode]["accuracy"]) == 2
        assert len(saved[mode]["rollout_tok_s"]) == 2 and all(t > 0 for t in saved[mode]["rollout_tok_s"])
        assert all(r < s for r, s in zip(saved[mode]["rollout_s"], saved[mode]["step_s"]))
    # `aware` times its own steps, so on a loaded machine it may keep a whole step plain (accepted length
    # 1); over the four speculative-mode steps it must have speculated, and drafts must have been accepted
    accepted = saved["frozen"]["accept_len"] + saved["online"]["accept_len"]
    assert len(accepted) == 4 and all(a >= 1.0 for a in accepted) and max(accepted) > 1.0
    assert len(saved["online"]["draft_train_s"]) == 2
    fresh = saved["online"]["draft_top1_fresh"]
    assert len(fresh) == 2 and all(0 <= t <= 1 for t in fresh)
    # both drafts scored against the online run's final policy; the online one trained, so they differ
    fit = saved["draft_fit"]
    assert fit["policy"].endswith("step_00000002/policy") and set(fit["scores"]) == {"frozen", "online"}
    assert fit["scores"]["frozen"]["heldout_loss"] != fit["scores"]["online"]["heldout_loss"]
    f, per_token = saved["rollout_fraction_off"], saved["rollout_throughput_speedup"]
    assert 0 < f < 1 and saved["amdahl_bound"] == pytest.approx(1 / ((1 - f) + f / per_token))
    per_step = {m: statistics.median(t / n for t, n in zip(saved[m]["step_s"], saved[m]["response_len"]))
                for m in ("off", "online")}
    assert saved["speedup_end_to_end_per_token"] == pytest.approx(per_step["off"] / per_step["online"])
    assert result["speedup_end_to_end"] == saved["speedup_end_to_end"] > 0
    from mlflow.tracking import MlflowClient

    from fastgrpo.tracking import default_tracking_uri

    client = MlflowClient(default_tracking_uri(tmp_path / "e2e-runs"))
    (summary,) = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    assert summary.data.metrics["speedup_end_to_end"] == pytest.approx(saved["speedup_end_to_end"])
    assert {a.path for a in client.list_artifacts(summary.info.run_id)} == {"e2e.json", "e2e.png", "config.yaml"}


def test_async_draft_rank_over_gloo_publishes_versions_swapped_between_steps(tmp_path, target, warm_draft):
    import json
    import time

    from fastgrpo.draft_learning.async_learner import AsyncDraftClient

    policy = shifted(target)
    e = engine(policy, warm_draft, STATIC)
    draft = DraftHead(policy.config)
    draft.load_state_dict(warm_draft.state_dict())
    client = AsyncDraftClient(draft, DraftConfig(online_lr=3e-3, batch_size=16, sync_max_steps=5), [e])
    # the rank trains against the policy it is sent: first the unshifted target, then the shifted policy
    client.update_weights(target.state_dict().items(), version=0)
    client.update_weights(policy.state_dict().items(), version=1)
    swaps, generating = [], [False]
    real_update, real_generate = e.update_draft, e.generate

    def recording(named, version):  # (version, inside a decode step, inside a rollout after its first step)
        swaps.append((version, e._in_step, generating[0] and e._counts["decode_steps"] > 0))
        real_update(named, version)

    def generate(*a, **k):
        generating[0] = True
        try:
            return real_generate(*a, **k)
        finally:
            generating[0] = False

    e.update_draft, e.generate = recording, generate
    e.draft_source = client.poll
    try:
        ps = prompts(32, 100)
        first = e.generate([Request(p) for p in ps], SAMPLING, seed=0, capture=True)
        client.observe(ps, first, policy_version=1)
        deadline = time.monotonic() + 120
        while e.draft_version < 3 and time.monotonic() < deadline:  # rollouts go on while the draft trains
            e.generate([Request(p) for p in prompts(16, 7)], SAMPLING, seed=1)
        assert e.draft_version >= 3, "the draft rank published no versions"
        versions = [v for v, _, _ in swaps]
        assert versions == sorted(versions) and len(set(versions)) == len(versions)
        assert not any(in_step for _, in_step, _ in swaps)  # never inside a decode step
        assert any(mid for _, _, mid in swaps)  # picked up mid-rollout, between decode steps
        assert client.metrics(policy_version=2)["draft_lag"] == 1.0
        # the rank scored the warm draft on the first rollout before training on it, with the head it
        # was sent last: the same score as a learner given the shifted policy's head, not the old one's
        fresh_on_rank = client.metrics(policy_version=2)["draft_loss_fresh"]
        fresh = {}
        for name, head_of in (("shifted", policy), ("unshifted", target)):
            learner = learner_for(target, warm_draft, [])
            learner.update_weights(head_of.state_dict().items(), version=1)
            learner.observe(ps, first, policy_version=1)
            fresh[name] = learner.fresh["draft_loss_fresh"]
        assert fresh_on_rank == pytest.approx(fresh["shifted"], rel=1e-5)
        assert abs(fresh["shifted"] - fresh["unshifted"]) > 0.05 * fresh["shifted"], fresh
        client.save(tmp_path / "async")
        saved = DraftHead.load(tmp_path / "async", policy.config)
        assert (tmp_path / "async" / "draft_buffer.safetensors").is_file()
        assert all(torch.isfinite(p).all() for p in saved.parameters())
        # resume: the draft rank restores that state and publishes its version again
        saved_version = json.loads((tmp_path / "async" / "draft_config.json").read_text())["version"]
        client.poll()
        client.load(tmp_path / "async")  # returns once the rank has restored (and published) it
        deadline, update = time.monotonic() + 60, None
        while update is None and time.monotonic() < deadline:
            update = client.poll()
        assert update is not None and update[1] >= saved_version
    finally:
        client.close()
    assert client.process.exitcode == 0


def _data_parallel_steps(rank, world, config, state, embed, head, batches):
    """A draft slice of `world` ranks: each steps on its own batch (None: nothing buffered)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    draft = DraftHead(config)
    draft.load_state_dict(state)
    draft.bind_target(embed, head)
    trainer = DraftTrainer(draft, lr=3e-3, data_parallel=True)
    states = [trainer.step(*(b[rank] if b[rank] is not None else (None, None, None)))["draft_states"] for b in batches]
    dist.destroy_process_group()
    return {k: v.clone() for k, v in draft.state_dict().items()}, states


@pytest.mark.slow  # a multi-process world
def test_a_data_parallel_draft_slice_steps_as_one_trainer_on_all_its_batches(tmp_path, target, warm_draft):
    """Two draft ranks, each with a batch of its own (and then one with none): after each step both hold
    the same draft bit for bit, and it is the draft one trainer gets from the union of the batches."""
    from fastgrpo.local_world import run_world

    hidden, tokens, mask = target_states(target, [p + [3, 4, 5] * (i % 4) for i, p in enumerate(prompts(12, 5))])
    halves = [(hidden[s], tokens[s], mask[s]) for s in (slice(0, 7), slice(7, 12))]  # unequal: weighting matters
    batches = [halves, [halves[1], None]]
    embed, head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    state = {k: v.clone() for k, v in warm_draft.state_dict().items()}
    results = run_world(_data_parallel_steps, 2, tmp_path / "world", target.config, state, embed, head, batches)
    (rank0, states0), (rank1, states1) = results
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0) and states0 == states1
    assert states0 == [float(mask.sum()), float(halves[1][2].sum())]

    one = DraftHead(target.config)
    one.load_state_dict(state)
    one.bind_target(embed, head)
    trainer = DraftTrainer(one, lr=3e-3)
    trainer.step(hidden, tokens, mask)
    trainer.step(*halves[1])
    assert_same_update(rank0, one.state_dict(), state, min_moved=1e-4)
