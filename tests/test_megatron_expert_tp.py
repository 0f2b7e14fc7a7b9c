"""Expert tensor parallelism 1 (`parallel.expert_tensor=1`) for the Megatron trainer on Qwen3-MoE: each
expert whole on one rank, the expert-parallel ranks spanning the TP ranks (megatron-core's expert grid,
expert tensor x expert x expert-data x pipeline), as slime runs Qwen3-30B-A3B. The tiny Qwen3-MoE, its
batch, the trainer builder and the torch trainer's step are tests/test_megatron_moe.py's.

- Fast: the layout at ETP1 (every expert whole on each TP rank of its EP rank, the round trip bit for
  bit); megatron's options; bad values refused naming parallel.expert_tensor (the layout, the config,
  the world rule); a conversion at TP2 x PP2 x EP2 x ETP1 and back bit for bit, its stored pieces whole
  experts; the plan's memory at ETP1 against ETP = TP, by hand from Qwen3-30B-A3B's shapes.
- Worlds (slow): at TP2 x EP2 x ETP1 and TP2 x EP4 x ETP1 (4 ranks each) the scores are Hugging Face's
  within 1e-5, the push is the checkpoint bit for bit, and a GRPO step has the torch trainer's loss,
  gradient norm and expert load within 1e-6 relative and moves the weights as it does; at TP2 x EP2 x
  ETP1 a converted ETP1 checkpoint of another model loads bit for bit, and routing replay steps as the
  torch trainer under replay.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fastgrpo.local_world import run_world
from tests.conftest import assert_same_update
from tests.test_megatron_families import hf_scores, max_diff
from tests.test_megatron_moe import (EXPERTS, GRPO_ONE, GRPO_TWO, SHAPE, TOL, _trainer, assert_same_metrics,  # noqa: F401
                                     distributed_optimizer_and_resume, grpo_batch, hf_model, moe_config, on_disk,
                                     policy, rank_round_trip, torch_step)  # (policy: its fixture)

pytest.importorskip("megatron.core")


# -- fast: the layout -------------------------------------------------------------------------------

@pytest.mark.parametrize("tp, pp, ep", [(2, 1, 2), (2, 1, 4), (2, 2, 2), (2, 1, 1)])
def test_at_etp1_every_expert_is_whole_on_each_tp_rank_of_its_ep_rank_and_round_trips(tmp_path, tp, pp, ep):
    """HF -> full Megatron tensors -> what each (TP, PP, EP) rank holds at expert_tensor 1 -> back: the
    checkpoint's tensors bit for bit. Every rank holds its EP rank's experts whole (fc1 = [gate; up] of
    the whole expert, fc2 the whole down projection), the same on each TP rank; attention is still
    split over TP."""
    from fastgrpo.trainers.megatron.layout import Layout

    model = hf_model()
    model.save_pretrained(tmp_path)
    disk = load_file(tmp_path / "model.safetensors")
    layout = Layout.of(model.config, tp, pp, ep, expert_tensor=1)
    assert (layout.expert_tp, layout.tensor) == (1, tp)
    full = layout.to_megatron(disk)
    ranks, back = rank_round_trip(layout, full, tp, pp, ep)
    assert back.keys() == disk.keys()
    assert all(torch.equal(back[k], t) for k, t in disk.items())
    per, gate_up = EXPERTS // ep, model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    down = model.state_dict()["model.layers.1.mlp.experts.down_proj"]
    for (t, p, e), tensors in ranks.items():
        if p != pp - 1:
            continue
        layer = 1 - p * (2 // pp)
        for j in range(per):
            prefix = f"decoder.layers.{layer}.mlp.experts.local_experts.{j}."
            assert torch.equal(tensors[prefix + "linear_fc1.weight"], gate_up[e * per + j])  # [gate; up], whole
            assert torch.equal(tensors[prefix + "linear_fc2.weight"], down[e * per + j])
        qkv = tensors[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"]
        assert qkv.shape[0] == (4 + 2 * 2) * 32 // tp  # (heads + 2 kv heads) x head_dim, over TP
    # the same layout at ETP = TP splits the experts: a different piece on each TP rank
    fc2 = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"
    assert (Layout.of(model.config, tp, pp, ep).pieces(fc2), layout.pieces(fc2)) == (tp, 1)


def test_megatrons_options_at_etp1_keep_sequence_parallelism_and_whole_experts():
    from fastgrpo.trainers.megatron.layout import Layout
    from fastgrpo.trainers.megatron.model import moe_config as options

    o = options(Layout.of(moe_config(), 2, 1, 2, expert_tensor=1))
    assert (o["expert_model_parallel_size"], o["expert_tensor_parallel_size"], o["sequence_parallel"]) == (2, 1, True)
    o = options(Layout.of(moe_config(), 2, 1, 2, expert_tensor=2))  # the same as 0: TP
    assert (o["expert_tensor_parallel_size"], o["sequence_parallel"]) == (2, True)
    assert Layout.of(moe_config(), 2, 1, 2) == Layout.of(moe_config(), 2, 1, 2, expert_tensor=2)


def test_bad_expert_tensor_sizes_are_refused_naming_the_key(monkeypatch):
    """The layout (3 at TP2; set on a dense model), the config alone (a trainer without megatron's expert
    layout; a size other than 0, 1 or TP) and a launched world (megatron-core's expert grid does not
    split the stage's ranks) each name parallel.expert_tensor or the rule's key."""
    from transformers import Qwen3Config

    from fastgrpo.config import ConfigError, load_config
    from fastgrpo.run_setup import check_layout
    from fastgrpo.trainers.megatron.layout import Layout, LayoutError

    with pytest.raises(LayoutError, match=r"parallel\.expert_tensor=3: must be 0"):
        Layout.of(moe_config(), 2, 1, 2, expert_tensor=3)
    dense = Qwen3Config(**{k: v for k, v in SHAPE.items() if "expert" not in k
                           and k not in ("moe_intermediate_size", "norm_topk_prob")})
    with pytest.raises(LayoutError, match=r"parallel\.expert_tensor breaks a layout rule: parallel\.expert_tensor=1 "
                                          r"sets the experts' tensor parallelism of a mixture-of-experts model "
                                          r"\(qwen3: 0 experts\)"):
        Layout.of(dense, 2, 1, 1, expert_tensor=1)
    with pytest.raises(ConfigError, match=r"parallel\.expert_tensor breaks a layout rule: parallel\.expert_tensor=1 "
                                          r"sets megatron-core's expert tensor parallelism: trainer\.backend=megatron "
                                          r"\(trainer\.backend=deepspeed\)"):
        load_config(None, ["trainer.backend=deepspeed", "parallel.expert_tensor=1", "parallel.draft_ranks=0"])
    with pytest.raises(ConfigError, match=r"parallel\.expert_tensor must be 0 \(the same as parallel\.tensor\), 1 "
                                          r"\(each expert whole on one rank\) or parallel\.tensor=4, got 2"):
        load_config(None, ["trainer.backend=megatron", "parallel.tensor=4", "parallel.expert_tensor=2"])
    # TP4 x ETP1 x EP16 on a world of 8: 8 ranks of a stage, which expert 16 x expert tensor 1 does not split
    cfg = load_config("configs/qwen3_30b_a3b.yaml", ["parallel.tensor=4", "parallel.expert=16",
                                                     "parallel.expert_tensor=1"])
    ok = load_config("configs/qwen3_30b_a3b.yaml", ["parallel.tensor=4", "parallel.expert=8",
                                                    "parallel.expert_tensor=1"])
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match=r"parallel\.expert breaks a layout rule: parallel\.expert=16 x "
                                          r"parallel\.expert_tensor=1 divides the 8 ranks of a stage"):
        check_layout(cfg)
    check_layout(ok)  # 8 = expert tensor 1 x expert 8 x expert-data 1 (at ETP = TP, expert 8 would need data 8)


# -- fast: conversion ---------------------------------------------------------------------------------

def test_a_conversion_at_etp1_stores_whole_experts_and_round_trips_bit_exact(tmp_path):
    """hf-to-megatron at TP2 x PP2 x EP2 --etp 1 and back: every tensor bit for bit; the stored expert
    stacks hold each expert as one piece (no gate/up halves over TP), attention still in TP pieces; the
    record says expert_tensor 1; a reshard to ETP = TP and back is the same tensors."""
    from tests.test_convert_checkpoint import assert_bit_exact, hf_tensors, real_scaled, run, save_hf
    from tools import convert_checkpoint as cc

    config = real_scaled("qwen3-30b-a3b")
    save_hf(config, tmp_path / "hf")
    expected = hf_tensors(tmp_path / "hf")
    assert run("hf-to-megatron", "--hf", tmp_path / "hf", "--out", tmp_path / "mg", "--tp", 2, "--pp", 2, "--ep", 2,
               "--etp", 1) == 0
    info = json.loads((tmp_path / "mg" / "megatron" / "fastgrpo.json").read_text())
    assert info["saved_at"] == {"tensor": 2, "pipeline": 2, "expert": 2, "expert_tensor": 1, "data": 1}
    md = cc.MegatronSource(tmp_path / "mg").metadata.state_dict_metadata
    fc1 = md["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert tuple(fc1.size) == (2, 8, 2 * 48, 128) and len(fc1.chunks) == 2 * 8  # layer x expert: whole experts
    assert all(tuple(c.sizes) == (1, 1, 2 * 48, 128) for c in fc1.chunks)
    assert len(md["decoder.layers.mlp.experts.experts.linear_fc2.weight"].chunks) == 2 * 8
    assert len(md["decoder.layers.self_attention.linear_qkv.weight"].chunks) == 2 * 2  # layer x TP
    assert run("megatron-to-hf", "--megatron", tmp_path / "mg", "--out", tmp_path / "back") == 0
    assert_bit_exact(hf_tensors(tmp_path / "back"), expected)
    assert run("reshard", "--megatron", tmp_path / "mg", "--out", tmp_path / "split", "--tp", 2, "--ep", 2) == 0
    split = cc.MegatronSource(tmp_path / "split").metadata.state_dict_metadata
    assert len(split["decoder.layers.mlp.experts.experts.linear_fc1.weight"].chunks) == 2 * 8 * 2 * 2
    assert run("megatron-to-hf", "--megatron", tmp_path / "split", "--out", tmp_path / "back2") == 0
    assert_bit_exact(hf_tensors(tmp_path / "back2"), expected)
    # the dry run: a rank holds E / EP experts whole at ETP1, split over TP2 at ETP = TP
    experts = 2 * 8 * 3 * 48 * 128 * 4  # layers x experts x (gate, up, down) x their size, fp32
    whole, split = (cc.dry_run(config, 2, 1, expert=2, expert_tensor=e)["per_rank"]["tp1_pp0"] for e in (1, 0))
    assert whole - split == experts // 2 - experts // 2 // 2
    assert run("hf-to-megatron", "--hf", tmp_path / "hf", "--out", tmp_path / "bad", "--tp", 2, "--etp", 3) == 2
    assert not (tmp_path / "bad").exists()


# -- fast: the plan ---------------------------------------------------------------------------------

def test_the_plan_prices_whole_experts_at_etp1(capsys):
    """Qwen3-30B-A3B on 8 GPUs at TP4 x EP2 (data 2): at ETP = TP a GPU holds 64 experts a layer split 4
    ways, 48 x A3B_EXPERTS / 8; at ETP1 64 whole experts, 48 x A3B_EXPERTS / 2 (4 x as many expert bytes).
    With the distributed optimizer the experts' state divides by their expert-data ranks: tensor 4 x data
    2 / (expert tensor x expert) = 8 / 8 = 1 at ETP = TP, 8 / 2 = 4 at ETP1. The rest (attention, router,
    embeddings, final norm) / TP 4, its optimizer state / data 2. bf16: 2 B weights, 4 B gradients, 12 B
    main weights and moments."""
    # Qwen3-30B-A3B by hand (tests/test_plan.py's figures): attention, router and norms a layer; the experts
    # a layer; the untied embeddings and the final norm
    from tests.test_plan import A3B_ATTENTION, A3B_EMBEDDINGS, A3B_EXPERTS, _rows, plan

    rest = (48 * A3B_ATTENTION + A3B_EMBEDDINGS) / 4
    base = ("--config", "configs/qwen3_30b_a3b.yaml", "parallel.tensor=4", "parallel.expert=2")
    figures = {}
    for etp, experts, expert_dp in ((0, 48 * A3B_EXPERTS / 8, 1), (1, 48 * A3B_EXPERTS / 2, 4)):
        status, out = plan(capsys, *base, f"parallel.expert_tensor={etp}")
        rows = _rows(out, "policy GPU, training")
        P = rest + experts
        assert rows["weights (bf16)"][0] == pytest.approx(2 * P / 2**30, abs=0.01), out
        assert rows["gradients (fp32)"][0] == pytest.approx(4 * P / 2**30, abs=0.01)
        optimizer = rows["main weights + Adam moments (fp32)"]
        assert optimizer[0] == pytest.approx(12 * ((P - experts) / 2 + experts / expert_dp) / 2**30, abs=0.01)
        assert f"experts / expert-data {expert_dp}" in optimizer[1]
        figures[etp] = rows["weights (bf16)"][0]
    assert "[ok] parallel.expert=2 x parallel.expert_tensor=1 divides the 8 ranks of a stage" in out
    assert "the Megatron layout accepts tensor 4 x pipeline 1 x expert 2 x expert tensor 1" in out
    assert "tensor 4, pipeline 1, expert 2, expert tensor 1 (experts whole)" in out
    assert figures[1] - figures[0] == pytest.approx(2 * 48 * A3B_EXPERTS * (1 / 2 - 1 / 8) / 2**30, abs=0.02)


# -- worlds ---------------------------------------------------------------------------------------------

def _etp1_score_push_and_step(rank, world, policy_dir, tp, ep, converted):
    """At expert_tensor 1: scores of the batch, the pushed weights, one GRPO step's metrics and the
    weights after it; with `converted`, a fresh trainer loading that converted checkpoint, its weights."""
    from megatron.core import parallel_state

    trainer = _trainer(policy_dir, tp, 1, ep, GRPO_ONE, expert_tensor=1)
    groups = (parallel_state.get_expert_tensor_parallel_world_size(), parallel_state.get_expert_model_parallel_world_size(),
              parallel_state.get_expert_data_parallel_world_size(), parallel_state.get_tensor_model_parallel_world_size())
    batch = grpo_batch()
    scores = trainer.logprobs_and_entropy(batch)
    pushed = dict(trainer.export_weights())
    batch.engine_logprobs = scores[0] * batch.response_mask
    metrics = trainer.train_step(batch)
    loaded = None
    if converted is not None:
        fresh = _trainer(policy_dir, tp, 1, ep, GRPO_ONE, expert_tensor=1)
        fresh.load(converted)
        loaded = dict(fresh.export_weights())
    return scores, pushed, metrics, dict(trainer.export_weights()), groups, loaded


@pytest.mark.slow  # two worlds of 4
@pytest.mark.parametrize("ep", [2, 4], ids=["TP2xEP2xETP1", "TP2xEP4xETP1"])
def test_etp1_scores_as_hugging_face_pushes_its_tensors_and_steps_as_torch(tmp_path, policy, ep):
    """A world of 4 at TP2 with each expert whole: EP2 (megatron's expert grid: the EP groups are the TP
    groups, expert-data 2) or EP4 (one expert a rank, expert-data 1). Every rank's log-probabilities and
    entropy within 1e-5 of Hugging Face's; every rank's push is the checkpoint's tensors bit for bit; one
    GRPO step has the torch trainer's loss, gradient norm, entropy, clip fraction and expert load, and
    moves its weights as the torch trainer's. At EP2 a checkpoint of another model converted at
    TP2 x EP2 x ETP1 loads bit for bit."""
    from tools import convert_checkpoint as cc

    converted = None
    if ep == 2:
        hf_model(seed=1).save_pretrained(tmp_path / "other")
        converted = tmp_path / "converted"
        assert cc.main(["hf-to-megatron", "--hf", str(tmp_path / "other"), "--out", str(converted), "--tp", "2",
                        "--ep", "2", "--etp", "1"]) == 0
    results = run_world(_etp1_score_push_and_step, 4, tmp_path / "world", policy, 2, ep, converted, timeout_s=500)
    batch = grpo_batch()
    want_logp, want_entropy = hf_scores(policy, batch)
    disk = load_file(policy / "model.safetensors")
    for (logp, entropy), pushed, metrics, _, groups, loaded in results:
        assert groups == (1, ep, 4 // ep, 2)  # expert tensor, expert, expert-data; TP
        assert max_diff(logp, want_logp, batch) <= TOL and max_diff(entropy, want_entropy, batch) <= TOL
        assert pushed.keys() == disk.keys() and all(torch.equal(pushed[k], t) for k, t in disk.items())
        assert metrics == results[0][2]
        if converted is not None:
            other = load_file(tmp_path / "other" / "model.safetensors")
            assert loaded.keys() == other.keys() and all(torch.equal(loaded[k], t) for k, t in other.items())
    batch.engine_logprobs = want_logp * batch.response_mask
    (want,), state = torch_step(policy, batch, GRPO_ONE)
    got = results[0][2]
    print(f"\nTP2 x EP{ep} x ETP1: loss {got['loss']:.9g} vs {want['loss']:.9g}, grad norm {got['grad_norm']:.9g} "
          f"vs {want['grad_norm']:.9g}")
    assert_same_metrics(got, want, rel=1e-6)
    assert_same_update(results[-1][3], state, disk, min_moved=1e-5)


def _etp1_replayed_step(rank, world, policy_dir, batch):
    trainer = _trainer(policy_dir, 2, 1, 2, GRPO_TWO, routing_replay=True, expert_tensor=1)
    return trainer.logprobs(batch), trainer.train_step(batch), dict(trainer.export_weights())


@pytest.mark.slow  # a world of 4
def test_routing_replay_at_etp1_steps_as_the_torch_trainer(tmp_path, policy):
    """Routing replay of another model's routing at TP2 x EP2 x ETP1: the replayed log-probabilities are
    the torch trainer's under replay, and the step has its loss, gradient norm, expert load and
    routing_mismatch, and moves the weights as it does."""
    from tests.test_megatron_moe_routing import replay_batch

    batch, want_logp, reference = replay_batch(policy)
    start = load_file(policy / "model.safetensors")
    want = reference.train_step(batch)
    want_weights = on_disk(reference.model.state_dict())
    results = run_world(_etp1_replayed_step, 4, tmp_path / "world", policy, batch, timeout_s=500)
    for logp, metrics, weights in results:
        assert max_diff(logp, want_logp, batch) <= TOL
        assert_same_metrics(metrics, want, rel=1e-6)
        assert metrics["routing_mismatch"] == pytest.approx(want["routing_mismatch"], rel=1e-12)
        assert_same_update(weights, want_weights, start)
    assert 0.3 < want["routing_mismatch"] < 1.0


@pytest.mark.slow  # a world of 4
def test_etp1_with_the_distributed_optimizer_steps_alike_and_resumes_bit_for_bit(tmp_path, policy):
    """megatron's distributed optimizer at TP2 x EP2 with each expert whole (ETP1): the replicated
    optimizer's step to rounding; saved and resumed, the next step is the continued run's bit for bit."""
    out = run_world(distributed_optimizer_and_resume, 4, tmp_path / "world", policy, tmp_path / "checkpoint", 2,
                    {"expert_tensor": 1}, timeout_s=500)[0]
    for key in ("loss", "grad_norm"):
        assert out[True][key] == pytest.approx(out[False][key], rel=1e-6), key
    assert out["resumed"] == out["continued"]
    resumed, continued = out["weights"]
    assert all(torch.equal(resumed[k], t) for k, t in continued.items())
