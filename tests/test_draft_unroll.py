"""The draft's training-time test (`draft.unroll`): each unrolled step computes what a tree node at that
depth computes, held to a token-by-token oracle and to the engine's own draft tree (eager and static
steps); step 1 is the teacher-forced loss unchanged; the config refuses an unroll out of range by name."""

import pytest
import torch

from fastgrpo.config import Config, ConfigError, DraftConfig
from fastgrpo.draft_learning.online import OnlineDraftLearner
from fastgrpo.models.draft import DraftHead, draft_loss, unrolled_states
from fastgrpo.models.policy import new_policy, policy_config

VOCAB, T = 24, 11


@pytest.fixture(scope="module")
def draft():
    cfg = policy_config("test", VOCAB, 64, bos_id=1, eos_id=VOCAB - 1, pad_id=0)
    target = new_policy(cfg, seed=3)
    d = DraftHead(cfg)
    d.reset_parameters(seed=5)
    d.bind_target(target.model.embed_tokens.weight, target.lm_head.weight)
    with torch.no_grad():  # weights large enough that a wrong key or input moves the output visibly
        for w in d.layer.values():
            if w.dim() == 2:
                w.mul_(8.0)
    return d.eval()


def sequence(seed: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, T, 64, generator=g)
    tokens = torch.randint(1, VOCAB - 1, (batch, T), generator=g)
    return hidden, tokens


def node_by_node(draft: DraftHead, hidden: torch.Tensor, tokens: torch.Tensor, p: int, depth: int) -> torch.Tensor:
    """A depth-`depth` tree node at position p, computed as decoding does, one position at a time over
    a growing list of keys: positions 0..p - depth + 1 fed the target's states (the committed context
    and the root), then a chain of positions each fed its predecessor's prediction."""
    keys, values = [], []

    def kv(k, v):
        keys.append(k)
        values.append(v)
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    def one(state, position):
        every = torch.ones(1, 1, 1, len(keys) + 1, dtype=torch.bool)  # attends over every key so far
        pos = torch.full((hidden.shape[0], 1), position)
        return draft.features(state[:, None], tokens[:, position + 1, None], pos, every, kv)[:, 0]

    for r in range(p - depth + 2):
        out = one(hidden[:, r], r)
    for r in range(p - depth + 2, p + 1):
        out = one(out, r)
    return out


@torch.no_grad()
def test_each_unrolled_step_is_the_tree_node_at_that_depth(draft):
    hidden, tokens = sequence(0)
    states = unrolled_states(draft, hidden, tokens, unroll=4)
    assert len(states) == 4 and all(s.shape == (2, T - 1, 64) for s in states)
    for depth, state in enumerate(states, start=1):
        for p in range(depth - 1, T - 1):
            torch.testing.assert_close(state[:, p], node_by_node(draft, hidden, tokens, p, depth), atol=1e-4, rtol=1e-4)
    # the steps differ from one another: feeding predictions back changes the states (else the test
    # above would hold for a draft that ignored its input)
    assert (states[1][:, 3:] - states[0][:, 3:]).abs().max() > 1e-2


@torch.no_grad()
def test_unroll_keeps_step_one_and_scores_deeper_steps(draft):
    hidden, tokens = sequence(1)
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[1, 8:] = False  # right padding
    loss1, m1 = draft_loss(draft, hidden, tokens, mask)
    loss3, m3 = draft_loss(draft, hidden, tokens, mask, unroll=3)
    for key in ("draft_hidden_l1", "draft_ce", "draft_top1"):
        assert m1[key] == m3[key]  # step 1 is the teacher-forced figure either way
    assert set(m3) - set(m1) == {"draft_top1_2", "draft_top1_3"}
    assert loss1.item() == m1["draft_loss"] and loss3.item() == m3["draft_loss"]
    assert loss3.item() != loss1.item()
    with pytest.raises(ValueError, match="unroll"):
        draft_loss(draft, hidden, tokens, mask, unroll=0)


def test_learners_train_unrolled_from_the_config():
    """`draft.unroll` reaches the online learner's trainer: its steps report each unrolled step's top-1,
    and the unrolled steps' losses move the weights (the same batch moves them differently than teacher
    forcing alone)."""
    cfg = policy_config("test", VOCAB, 64, bos_id=1, eos_id=VOCAB - 1, pad_id=0)
    target = new_policy(cfg, seed=3)
    hidden, tokens = sequence(4, batch=3)
    mask = torch.ones(3, T, dtype=torch.bool)
    moved = {}
    for unroll in (1, 3):
        d = DraftHead(cfg)
        d.bind_target(target.model.embed_tokens.weight, target.lm_head.weight)
        learner = OnlineDraftLearner(d, DraftConfig(unroll=unroll), engines=[])
        metrics = learner.trainer.step(hidden, tokens, mask)
        assert {f"draft_top1_{j}" for j in range(2, unroll + 1)} <= set(metrics)
        assert ("draft_top1_2" in metrics) == (unroll > 1)
        moved[unroll] = d.fc.detach().clone()
    assert (moved[1] - moved[3]).abs().max() > 1e-6


def test_config_refuses_an_unroll_out_of_range():
    for bad in (0, 9):
        with pytest.raises(ConfigError, match="draft.unroll"):
            DraftConfig(unroll=bad).check()
    DraftConfig(unroll=4).check()
    assert Config().draft.unroll == 1


@torch.no_grad()
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_each_unrolled_step_is_the_engines_own_tree_level(draft, static):
    """Against the engine itself: a chain tree (top-1, depth 4) drafted after a prompt's prefill. Its root
    state is unrolled step 1 at the prompt's last position, and its level-j state is step j + 1 one
    position further on each level, when the unrolled sequence's tokens past the prompt are the pending
    token and the tokens the engine drafted."""
    from fastgrpo.engines.embedded.engine import EmbeddedEngine
    from fastgrpo.draft_learning.pretrain import target_states
    from fastgrpo.speculation.policy import Static
    from fastgrpo.speculation.spec import SpecConfig
    from fastgrpo.types import Request, SamplingParams

    target = new_policy(draft.cfg, seed=3).eval()
    engine = EmbeddedEngine(draft.cfg, 2, 64, eos_id=VOCAB - 1, pad_id=0, policy=Static(SpecConfig(4, 1, 5)),
                            static_steps=static)
    engine.update_weights(target.state_dict().items(), version=0)
    engine.update_draft(draft.state_dict().items(), version=0)
    calls = []
    features = engine.draft.features

    def recorded(hidden, next_tokens, *args, **kwargs):
        out = features(hidden, next_tokens, *args, **kwargs)
        calls.append((next_tokens.clone(), out.clone()))
        return out

    engine.draft.features = recorded
    prompt = [1, 5, 9, 4, 7, 3, 12]
    out = engine.generate([Request(prompt)], SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    (_, caught_up), *levels = calls[:4]  # the first step: catch-up over the prompt, then three levels
    L = len(prompt)
    root = caught_up[0, L - 1]  # the draft's state at the pending token, the prompt's first answer
    drafted = [int(tok[0, 0]) for tok, _ in levels]
    tokens = torch.tensor([prompt + [out.token_ids[0]] + drafted])
    hidden = torch.zeros(1, tokens.shape[1], 64)
    hidden[:, : L] = target_states(target, [prompt])[0]
    states = unrolled_states(draft, hidden, tokens, unroll=4)
    torch.testing.assert_close(states[0][0, L - 1], root, atol=1e-4, rtol=1e-4)
    for j, (_, state) in enumerate(levels, start=1):
        torch.testing.assert_close(states[j][0, L - 1 + j], state[0, 0], atol=1e-4, rtol=1e-4)
