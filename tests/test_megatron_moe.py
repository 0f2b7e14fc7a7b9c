"""The Megatron trainer on Qwen3-MoE: megatron-core's MoELayer (alltoall token dispatcher,
SequentialMLP experts) at TP x PP x EP on gloo, against Hugging Face's Qwen3MoeForCausalLM and the torch
trainer.

A tiny Qwen3-MoE (4 experts, top-2, renormalised top-k, 2 layers, head_dim 32 != hidden / heads,
untied head), every weight redrawn away from its initial value (norms 1 + 0.1 N, the router 0.5 N; no
token's 2nd and 3rd experts near a tie, checked), fp32.

- Fast: the name map (HF -> the tensors each TP x PP x EP rank holds -> gathered -> HF equals what
  `save_pretrained` writes, bit for bit, from the stacked or the per-expert names); which EP rank holds
  which expert; the megatron options the config maps to; bad input refused naming its key; the MoE
  patches' fingerprints.
- Worlds (slow): at TP2 x EP2 and PP2 x EP2 (4 ranks each) the trainer's log-probabilities and
  entropy are within 1e-5 of Hugging Face's, its weight push is Hugging Face's checkpoint tensors bit
  for bit (experts gathered from their EP ranks), and a GRPO step equals the torch trainer's; at EP2
  (2 ranks, data-parallel 2, ranks with unequal micro-batch counts) two GRPO updates equal the torch
  trainer's (loss and gradient norm within 1e-6 relative), its weight push through the bridge arrives
  in buckets with matching checksums, each expert its own tensor, earlier buckets freed; its
  checkpoint's policy is the pushed weights and its Megatron part converts to them; a conversion of
  another model loads at EP2; the router's auxiliary losses move the gradient, not the loss.
  With the distributed optimizer at EP2: the same step, and a bit-exact resume.
  Conversion at TP2 x PP2 x EP2 itself: tests/test_convert_checkpoint.py.
  Routing replay and the router losses' padding: tests/test_megatron_moe_routing.py.
"""

from __future__ import annotations

import json
import time
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastgrpo.local_world import run_world
from tests.conftest import assert_same_update
from tests.test_megatron_families import hf_scores, max_diff  # the same scoring (temperature 0.8)

pytest.importorskip("megatron.core")

VOCAB, EXPERTS, TOP_K = 128, 4, 2
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, moe_intermediate_size=32, num_experts=EXPERTS,
             num_experts_per_tok=TOP_K, norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=256,
             tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=1e6),
             pad_token_id=7)  # Hugging Face's padding_idx: its row gets no gradient from its lookups
SAMPLING = dict(temperature=0.8)
OPTIM = dict(lr=1e-3, grad_clip=1.0)
TOL = 1e-5


def moe_config(**changes):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**SHAPE, **changes})


def hf_model(seed: int = 0, **changes):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(**changes), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # the router: well separated expert choices
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return model.eval()


def on_disk(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's stacked experts as each expert's own tensors (what save_pretrained writes:
    gate_up_proj[e] is [gate; up]); checked against save_pretrained in test_the_layout_round_trip."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            for e in range(t.shape[0]):
                out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"], out[
                    f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = t[e].chunk(2)
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3-moe") / "policy"
    hf_model().save_pretrained(directory)
    return directory


def grpo_batch(seed: int = 0):
    """Five rows of mixed (odd) lengths: widths that sequence parallelism at TP2 pads."""
    from fastgrpo.grpo.batch import build_batch

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (4 + i,), generator=gen).tolist() for i in range(5)]
    for p in prompts:  # the pad token inside the text (as Qwen's <|endoftext|> can be): no gradient to its row
        p[1] = SHAPE["pad_token_id"]
    responses = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (12, 5, 8, 3, 10)]
    return build_batch(prompts, responses, [[0.0] * len(r) for r in responses], torch.randn(5, generator=gen),
                       pad_id=0)


# -- fast: the layout ---------------------------------------------------------------------------------

def test_the_fixture_routes_away_from_ties():
    """Every token of the test batch (padding too) has its 2nd and 3rd router logits at least 1e-3
    apart in every layer, a thousand times what the two implementations' rounding moves them by:
    no comparison depends on which of two tied experts rounding picks (HF ranks the softmax's
    probabilities, megatron the logits: the same order)."""
    model = hf_model()
    batch = grpo_batch()
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask, output_router_logits=True).router_logits
    top = torch.cat([r.float().topk(TOP_K + 1, dim=-1).values for r in logits])
    assert float((top[:, TOP_K - 1] - top[:, TOP_K]).min()) > 1e-3
    assert model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].shape == (EXPERTS, 64, 64)


def rank_round_trip(layout, full: dict, tp: int, pp: int, ep: int) -> tuple[dict, dict]:
    """What each (TP, PP, EP) rank holds of the full Megatron tensors, and those pieces gathered back into
    Hugging Face tensors."""
    ranks = {(t, p, e): layout.rank_tensors(full, t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)}
    back = {}
    for p in range(pp):
        for e in range(ep):
            for local in ranks[(0, p, e)]:
                name = layout.global_name(local, p, e)
                back.update(layout.to_hf(name, layout.unshard(name, [ranks[(t, p, e)][local] for t in range(tp)])))
    return ranks, back


@pytest.mark.parametrize("tp, pp, ep", [(1, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 4), (1, 1, 4)])
@pytest.mark.parametrize("names", ["stacked", "per-expert"])
def test_the_layout_round_trip_is_bit_exact_and_places_each_expert_on_its_rank(tmp_path, tp, pp, ep, names):
    """HF (transformers' in-memory stacked experts, or a checkpoint's per-expert tensors) -> full
    Megatron tensors -> what each (TP, PP, EP) rank holds -> gathered back -> HF: exactly the tensors
    save_pretrained writes. Global expert e is on EP rank e // (E / EP) as its local expert
    e % (E / EP), split over TP as fc1 = [gate_r; up_r], fc2 along its input; the router is replicated."""
    from fastgrpo.trainers.megatron.layout import Layout

    model = hf_model()
    model.save_pretrained(tmp_path)
    disk = load_file(tmp_path / "model.safetensors")
    assert on_disk(model.state_dict()).keys() == disk.keys()
    assert all(torch.equal(on_disk(model.state_dict())[k], t) for k, t in disk.items())
    layout = Layout.of(model.config, tp, pp, ep)
    assert (layout.experts, layout.top_k, layout.expert_ffn, layout.norm_topk, layout.qk_norm) == (4, 2, 32, True, True)
    full = layout.to_megatron(model.state_dict() if names == "stacked" else disk)
    assert set(full) == set(layout.megatron_names())
    ranks, back = rank_round_trip(layout, full, tp, pp, ep)
    assert back.keys() == disk.keys()
    for name, t in disk.items():
        assert torch.equal(back[name], t), name
    per = EXPERTS // ep
    gate_up = model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    for (t, p, e), tensors in ranks.items():
        held = {n.split(".")[6] for n in tensors if ".local_experts." in n}
        assert held == {str(j) for j in range(per)}  # local indices
        if p == pp - 1:
            layer = 1 - p * (2 // pp)
            for j in range(per):
                fc1 = tensors[f"decoder.layers.{layer}.mlp.experts.local_experts.{j}.linear_fc1.weight"]
                gate, up = gate_up[e * per + j].chunk(2)
                assert torch.equal(fc1, torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]]))
            assert torch.equal(tensors[f"decoder.layers.{layer}.mlp.router.weight"],
                               model.state_dict()["model.layers.1.mlp.gate.weight"])


def test_the_megatron_options_map_the_routing_and_the_router_losses():
    """norm_topk_prob -> softmax over the top-k logits (pre_softmax off), else softmax then top-k; no
    load balancing and no z-loss unless the trainer asks for them; sequence parallelism with TP;
    expert parallelism of parallel.expert, the experts split over TP; no grouped GEMM."""
    from fastgrpo.trainers.megatron.layout import Layout
    from fastgrpo.trainers.megatron.model import moe_config as options

    o = options(Layout.of(moe_config(), 2, 1, 2))
    assert (o["num_moe_experts"], o["moe_router_topk"], o["moe_ffn_hidden_size"]) == (4, 2, 32)
    assert o["moe_router_score_function"] == "softmax" and o["moe_router_pre_softmax"] is False
    assert o["moe_router_topk_scaling_factor"] is None and o["moe_router_dtype"] == "fp32"
    assert o["moe_router_load_balancing_type"] == "none" and o["moe_aux_loss_coeff"] == 0.0
    assert o["moe_z_loss_coeff"] is None and o["moe_grouped_gemm"] is False
    assert o["moe_token_dispatcher_type"] == "alltoall" and o["sequence_parallel"] is True
    assert (o["expert_model_parallel_size"], o["expert_tensor_parallel_size"]) == (2, 2)
    o = options(Layout.of(moe_config(norm_topk_prob=False)), router_aux_loss=1e-3, router_z_loss=1e-4)
    assert o["moe_router_pre_softmax"] is True and o["sequence_parallel"] is False
    assert (o["moe_router_load_balancing_type"], o["moe_aux_loss_coeff"], o["moe_z_loss_coeff"]) == ("aux_loss", 1e-3, 1e-4)
    from transformers import Qwen3Config

    assert options(Layout.of(Qwen3Config(**{k: v for k, v in SHAPE.items() if "expert" not in k
                                            and k not in ("moe_intermediate_size", "norm_topk_prob")}))) == {}


@pytest.mark.parametrize("changes, tp, ep, says", [
    ({}, 1, 3, r"parallel\.expert breaks a layout rule: parallel\.expert=3 divides the 4 experts"),
    ({"moe_intermediate_size": 31}, 2, 1,
     r"parallel\.tensor breaks a layout rule: tensor 2 divides the expert MLP width 31"),
    ({"decoder_sparse_step": 2}, 1, 1, r"decoder_sparse_step=2"),
    ({"mlp_only_layers": [0]}, 1, 1, r"mlp_only_layers=\[0\]"),
    ({"attention_bias": True}, 1, 1, r"attention_bias=True"),
    ({"num_experts_per_tok": 5}, 1, 1, r"num_experts_per_tok=5"),
])
def test_the_layout_refuses_what_it_cannot_lay_out_naming_the_key(changes, tp, ep, says):
    from fastgrpo.trainers.megatron.layout import Layout, LayoutError

    with pytest.raises(LayoutError, match=says):
        Layout.of(moe_config(**changes), tp, 1, ep)


def test_expert_parallelism_of_a_dense_model_is_refused_naming_parallel_expert():
    from transformers import Qwen3Config

    from fastgrpo.trainers.megatron.layout import Layout, LayoutError

    dense = Qwen3Config(**{k: v for k, v in SHAPE.items() if "expert" not in k
                           and k not in ("moe_intermediate_size", "norm_topk_prob")})
    with pytest.raises(LayoutError, match=r"parallel\.expert breaks a layout rule: parallel\.expert=2 splits the "
                                          r"experts of a mixture-of-experts model \(qwen3: 0 experts\)"):
        Layout.of(dense, 1, 1, 2)
    assert Layout.of(dense, 1, 1, 1).experts == 0


def test_the_moe_patches_refuse_a_changed_megatron_core(monkeypatch):
    """The MoE patches carry fingerprints of what they replace and of what they rely on, as the others do."""
    import megatron.core.tensor_parallel.mappings as mappings
    from megatron.core.transformer.moe import moe_utils

    import megatron_patches

    monkeypatch.setattr(megatron_patches, "_applied", {})  # as in a fresh process
    assert megatron_patches.mismatches() == []

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        return input_

    class Gating(moe_utils.RouterGatingLinearFunction):
        @staticmethod
        def forward(ctx, inp, weight, bias, router_dtype):
            return inp

    monkeypatch.setattr(mappings, "_gather_along_first_dim", _gather_along_first_dim)
    monkeypatch.setattr(moe_utils, "RouterGatingLinearFunction", Gating)
    problems = megatron_patches.mismatches()
    assert any("_gather_along_first_dim changed" in p for p in problems), problems
    assert any("RouterGatingLinearFunction.forward changed" in p and "Transformer Engine names" in p
               for p in problems), problems


def _apply_as_with_cuda(rank, world):
    """In a fresh process: what `apply` patches where CUDA is present (needed() False)."""
    import megatron_patches

    megatron_patches.needed = lambda: False
    return megatron_patches.apply()


def test_with_cuda_only_the_local_specs_patches_apply(tmp_path):
    """On a GPU megatron-core runs unpatched but for the local spec's torch fallbacks, which a MoE
    needs whatever the device: the torch norms under sequence parallelism and the router's Transformer
    Engine names (where Transformer Engine is absent); none of the CPU/gloo patches, no torch.cuda
    stand-in."""
    done = run_world(_apply_as_with_cuda, 1, tmp_path)[0]
    assert "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__" in done
    assert "megatron.core.transformer.moe.moe_utils.te_general_gemm = None" in done
    assert not any("token_dispatcher" in d or "mappings" in d or d.startswith("torch.cuda") or "random" in d
                   for d in done), done


# -- worlds ---------------------------------------------------------------------------------------------

def _trainer(policy_dir, tp, pp, ep, grpo, **kwargs):
    from fastgrpo.config import GRPOConfig, OptimConfig
    from fastgrpo.trainers.megatron.trainer import MegatronPolicyTrainer
    from fastgrpo.types import SamplingParams

    return MegatronPolicyTrainer(policy_dir, GRPOConfig(**grpo), OptimConfig(**OPTIM), SamplingParams(**SAMPLING),
                                 tensor=tp, pipeline=pp, expert=ep, **kwargs)


GRPO_ONE = dict(minibatches=1, micro_batch_size=2, tis_cap=2.0, kl_coef=0.0)


def _score_push_and_step(rank, world, policy_dir, tp, pp, ep):
    """Scores of the batch, the pushed weights, one GRPO step's metrics and the weights after it."""
    trainer = _trainer(policy_dir, tp, pp, ep, GRPO_ONE)
    batch = grpo_batch()
    scores = trainer.logprobs_and_entropy(batch)
    pushed = dict(trainer.export_weights())
    batch.engine_logprobs = scores[0] * batch.response_mask
    metrics = trainer.train_step(batch)
    return scores, pushed, metrics, dict(trainer.export_weights())


def torch_step(policy_dir, batch, grpo, steps: int = 1):
    """The torch trainer's metrics of `steps` GRPO steps on `batch`, and its weights after them."""
    from fastgrpo.config import GRPOConfig, OptimConfig
    from fastgrpo.models.policy import load_policy
    from fastgrpo.trainers.torch_trainer import TorchPolicyTrainer
    from fastgrpo.types import SamplingParams

    trainer = TorchPolicyTrainer(load_policy(policy_dir), GRPOConfig(**grpo), OptimConfig(**OPTIM),
                                 SamplingParams(**SAMPLING))
    metrics = [trainer.train_step(batch) for _ in range(steps)]
    return metrics, on_disk(trainer.model.state_dict())


def assert_same_metrics(got: dict, want: dict, rel: float) -> None:
    """The step's numbers as the torch trainer's; its expert load (counts of routed real tokens, the
    same routing) exactly."""
    for key in ("loss", "grad_norm", "entropy", "clip_fraction"):
        assert got[key] == pytest.approx(want[key], rel=rel, abs=1e-9), (key, got[key], want[key])
    assert want["grad_norm"] > 0
    for key in ("expert_load_max_over_mean", "expert_idle_fraction"):
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-12), (key, got[key], want[key])
    assert want["expert_load_max_over_mean"] > 1.0


@pytest.mark.slow  # two worlds of 4
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["TP2xEP2", "PP2xEP2"])
def test_tp_or_pp_with_ep2_scores_as_hugging_face_pushes_its_tensors_and_steps_as_torch(tmp_path, policy, tp, pp):
    """A world of 4: TP2 x EP2 (sequence parallel, each micro-batch padded to an even width, the
    dispatcher's uneven gathers over TP) or PP2 x EP2 (one layer a stage). Every rank's
    log-probabilities and entropy within 1e-5 of Hugging Face's; every rank's push (experts gathered
    from their EP ranks and TP shards) is the checkpoint's tensors bit for bit; one GRPO step (two
    micro-batches per data-parallel rank) has the torch trainer's loss, gradient norm, entropy and
    clip fraction, and its weights moved as the torch trainer's."""
    results = run_world(_score_push_and_step, 4, tmp_path / "world", policy, tp, pp, 2, timeout_s=500)
    batch = grpo_batch()
    want_logp, want_entropy = hf_scores(policy, batch)
    disk = load_file(policy / "model.safetensors")
    figures = []
    for (logp, entropy), pushed, metrics, _ in results:
        figures.append(max_diff(logp, want_logp, batch))
        assert figures[-1] <= TOL and max_diff(entropy, want_entropy, batch) <= TOL
        assert float(entropy[batch.response_mask.bool()].min()) > 0.1  # real numbers, not zeros on both sides
        assert pushed.keys() == disk.keys()
        assert all(torch.equal(pushed[k], t) for k, t in disk.items())
        assert metrics == results[0][2]
    print(f"\nmax |log-prob diff| vs Hugging Face, TP{tp} x PP{pp} x EP2: {max(figures):.2e}")
    batch.engine_logprobs = want_logp * batch.response_mask
    (want,), state = torch_step(policy, batch, GRPO_ONE)
    got = results[0][2]
    print(f"loss {got['loss']:.9g} vs {want['loss']:.9g}, grad norm {got['grad_norm']:.9g} vs {want['grad_norm']:.9g}")
    assert_same_metrics(got, want, rel=1e-6)
    assert_same_update(results[-1][3], state, disk, min_moved=1e-5)


GRPO_TWO = dict(minibatches=2, micro_batch_size=1, tis_cap=2.0, kl_coef=0.0)  # minibatches of 3 and 2 rows


class Recorder:
    """A weight consumer that keeps what a push sends it: each bucket's names and bytes, a copy of
    each tensor, and, when a bucket arrives, how many tensors of the earlier buckets are still alive
    (the push must not hold them); at the commit it checks each tensor against the sender's checksum,
    as an engine does."""

    def __init__(self, wait_s: float = 5.0):
        self.wait_s = wait_s
        self.buckets: list[tuple[list[str], int]] = []
        self.received: dict[str, torch.Tensor] = {}
        self.alive_earlier: list[int] = []
        self._earlier: list[weakref.ref] = []
        self.committed: int | None = None

    def update_weights(self, named_tensors, version: int, complete: bool = True) -> None:
        self.alive_earlier.append(self._alive_earlier())
        named = list(named_tensors)
        self._earlier += [weakref.ref(t) for _, t in named]
        self.buckets.append(([n for n, _ in named], sum(t.numel() * t.element_size() for _, t in named)))
        for name, t in named:
            assert name not in self.received, f"{name} pushed twice"
            self.received[name] = t.clone()

    def _alive_earlier(self) -> int:
        """How many tensors of the earlier buckets are alive. Gloo's worker thread marks a collective
        complete before it drops its reference to the work and the work's tensors
        (`ProcessGroupGloo::runLoop` resets `workInProgress_` after `execute`), so the tensor a broadcast
        just filled can outlive the push's own reference for as long as that thread waits for a core.
        The push is blocked inside this call while it waits, so only other threads can release
        anything: a reference the push itself kept stays alive through the wait and is counted."""
        deadline = time.monotonic() + self.wait_s
        while (alive := sum(ref() is not None for ref in self._earlier)) and time.monotonic() < deadline:
            time.sleep(0.01)
        return alive

    def commit_weights(self, version: int, checksums: dict[str, int] | None = None) -> None:
        from fastgrpo.bridge import checksum

        assert checksums is not None and checksums.keys() == self.received.keys()
        assert all(checksum(t) == checksums[n] for n, t in self.received.items())
        self.committed = version


def test_the_recorder_counts_what_a_push_keeps_and_not_what_it_frees():
    """The control for the push's no-holding check: a push whose source keeps every tensor it sent
    is counted at each later bucket; one that keeps none counts zero."""
    from fastgrpo.bridge import WeightBridge

    def source(keep: bool):
        kept = []
        for i in range(4):
            t = torch.full((1000,), float(i))  # 4000 bytes: one tensor a bucket
            if keep:
                kept.append(t)
            yield f"w{i}", t
            del t

    counts = {}
    for keep in (True, False):
        recorder = Recorder(wait_s=0.05)
        WeightBridge([recorder], bucket_bytes=4000).push(source(keep), 1)
        counts[keep] = recorder.alive_earlier
    # the last bucket is sent after the source is exhausted, its list gone with it
    assert counts == {True: [0, 1, 2, 0], False: [0, 0, 0, 0]}


PUSH_BUCKET = 40_000  # bytes: a few experts' matrices (16 KiB each) per bucket


def _ep2_steps_checkpoint_and_router_losses(rank, world, policy_dir, checkpoint, converted):
    """EP2 (data-parallel 2): one train step of two minibatches, the first of which the data-parallel
    ranks share as 1 and 2 rows (1 and 2 micro-batches: the rank with fewer pads); a push of the
    trained weights through the bridge (a consumer on rank 0; rank 1 takes part in the gathers and
    drops what passes); a checkpoint; then one step of one minibatch without and with the router's
    auxiliary losses; then a converted checkpoint (another model, written at TP2) loaded at EP2."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    from fastgrpo.bridge import WeightBridge
    from fastgrpo.engines.embedded.engine import EmbeddedEngine
    from fastgrpo.models.policy import load_policy

    trainer = _trainer(policy_dir, 1, 1, 2, GRPO_TWO)
    batch = grpo_batch()
    batch.engine_logprobs = trainer.logprobs(batch) * batch.response_mask
    micro_counts = [len(trainer._micro_batches(batch, [0, 1, 2])), len(trainer._micro_batches(batch, [3, 4]))]
    metrics = trainer.train_step(batch)
    trained = dict(trainer.export_weights())
    recorder, engine = Recorder(), EmbeddedEngine(trainer.hf_config, 2, 64, eos_id=2, pad_id=0)
    engine.update_weights(load_policy(policy_dir).state_dict().items(), version=0)
    consumers = [engine, recorder] if rank == 0 else []
    report = WeightBridge(consumers, bucket_bytes=PUSH_BUCKET).push(trainer.export_weights(), 1)
    served = on_disk({n: t.clone() for n, t in engine.model.named_weights()}) if rank == 0 else None
    push = (recorder.buckets, recorder.received, recorder.alive_earlier, recorder.committed, report.buckets,
            engine.stats()["weights_version"] if rank == 0 else None, served)
    trainer.save(checkpoint)
    del trainer
    router = {}
    for losses in ({}, {"router_aux_loss": 0.01, "router_z_loss": 0.001}):
        clear_aux_losses_tracker()
        router[bool(losses)] = (_trainer(policy_dir, 1, 1, 2, GRPO_ONE, **losses).train_step(batch),
                                sorted(get_moe_layer_wise_logging_tracker()))
    fresh = _trainer(policy_dir, 1, 1, 2, GRPO_ONE)
    fresh.load(converted)
    return metrics, trained, micro_counts, router, push, dict(fresh.export_weights())


@pytest.mark.slow  # a world of 2
def test_ep2_trains_as_the_torch_trainer_and_checkpoints_its_policy(tmp_path, policy):
    """Two optimizer updates at EP2 (the data-parallel ranks' micro-batch counts differ and are evened
    out) give the torch trainer's loss and gradient norm within 1e-6 relative, and its weights; the
    checkpoint's Hugging Face policy is the pushed weights (each expert's own tensors), which
    transformers loads, and its Megatron part converts to the same tensors; the router's
    load-balancing and z-losses change the gradient, not the loss; a conversion of another model
    (hf-to-megatron at TP2) loads at EP2 bit for bit."""
    from fastgrpo.models.policy import load_policy
    from tools import convert_checkpoint as cc

    hf_model(seed=1).save_pretrained(tmp_path / "other")
    assert cc.main(["hf-to-megatron", "--hf", str(tmp_path / "other"), "--out", str(tmp_path / "converted"),
                    "--tensor", "2"]) == 0
    results = run_world(_ep2_steps_checkpoint_and_router_losses, 2, tmp_path / "world", policy,
                        tmp_path / "checkpoint", tmp_path / "converted", timeout_s=400)
    metrics, trained, micro_counts, router, push, loaded = results[0]
    other = load_file(tmp_path / "other" / "model.safetensors")
    assert loaded.keys() == other.keys() and all(torch.equal(loaded[k], t) for k, t in other.items())
    assert micro_counts == [2, 1]  # rows 0 | 1, 2 evened to 2 micro-batches; rows 3 | 4 one each
    assert all(r[0] == metrics and r[3] == router for r in results)
    # the push: every trained tensor once, each expert's own matrices, in buckets of at most
    # PUSH_BUCKET bytes (or one tensor), checksums checked at the commit (by the recorder and by the
    # embedded engine, which then serves the trained weights), earlier buckets freed
    buckets, received, alive_earlier, committed, pushed_buckets, engine_version, served = push
    assert committed == engine_version == 1 and received.keys() == trained.keys()
    assert served.keys() == trained.keys() and all(torch.equal(served[k], t) for k, t in trained.items())
    assert all(torch.equal(received[k], t) for k, t in trained.items())
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in received
    assert len(buckets) == pushed_buckets == results[1][4][4] > 4
    assert all(size <= PUSH_BUCKET or len(names) == 1 for names, size in buckets)
    assert alive_earlier == [0] * len(buckets)
    batch = grpo_batch()
    batch.engine_logprobs = hf_scores(policy, batch)[0] * batch.response_mask
    (want,), state = torch_step(policy, batch, GRPO_TWO)
    print(f"\nEP2: loss {metrics['loss']:.9g} vs {want['loss']:.9g}, grad norm {metrics['grad_norm']:.9g} vs "
          f"{want['grad_norm']:.9g}")
    assert metrics["updates"] == want["updates"] == 2
    assert_same_metrics(metrics, want, rel=1e-6)
    disk = load_file(policy / "model.safetensors")
    assert_same_update(trained, state, disk, min_moved=1e-5)
    saved = load_file(tmp_path / "checkpoint" / "policy" / "model.safetensors")
    assert saved.keys() == trained.keys() and all(torch.equal(saved[k], t) for k, t in trained.items())
    reloaded = on_disk(load_policy(tmp_path / "checkpoint" / "policy").state_dict())
    assert all(torch.equal(reloaded[k], t) for k, t in trained.items())
    info = json.loads((tmp_path / "checkpoint" / "megatron" / "fastgrpo.json").read_text())
    assert info["saved_at"]["expert"] == 2 and info["model"]["experts"] == 4
    assert cc.main(["megatron-to-hf", "--megatron", str(tmp_path / "checkpoint"), "--out", str(tmp_path / "back")]) == 0
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == trained.keys() and all(torch.equal(back[k], t) for k, t in trained.items())
    # the router losses: the same forward (loss), another gradient; tracked per layer by megatron
    (plain, untracked), (lossy, tracked) = router[False], router[True]
    assert untracked == [] and tracked == ["load_balancing_loss", "z_loss"]
    assert lossy["loss"] == plain["loss"]
    assert abs(lossy["grad_norm"] - plain["grad_norm"]) > 1e-4 * plain["grad_norm"]


def distributed_optimizer_and_resume(rank, world, policy_dir, checkpoint, tp=1, layout=None):
    """At TP `tp` x EP2 (`layout`: more of the trainer's layout, e.g. {"expert_tensor": 1}): one step with the
    replicated optimizer and one with the distributed one; the latter saved, loaded by a new trainer,
    and one more step of each (resumed and continued)."""
    layout = layout or {}
    out = {}
    for distributed in (False, True):
        trainer = _trainer(policy_dir, tp, 1, 2, GRPO_TWO, distributed_optimizer=distributed, **layout)
        batch = grpo_batch()
        batch.engine_logprobs = trainer.logprobs(batch) * batch.response_mask
        out[distributed] = trainer.train_step(batch)
    trainer.save(checkpoint)
    resumed = _trainer(policy_dir, tp, 1, 2, GRPO_TWO, distributed_optimizer=True, **layout)
    resumed.load(checkpoint)
    out["resumed"], out["continued"] = resumed.train_step(batch), trainer.train_step(batch)
    out["weights"] = dict(resumed.export_weights()), dict(trainer.export_weights())
    return out


@pytest.mark.slow  # a world of 2
def test_ep2_with_the_distributed_optimizer_steps_alike_and_resumes_bit_for_bit(tmp_path, policy):
    """megatron's distributed optimizer (expert parameters sharded over their own data-parallel group)
    at EP2: the replicated optimizer's step to rounding; saved and resumed, the next step is the
    continued run's bit for bit."""
    out = run_world(distributed_optimizer_and_resume, 2, tmp_path / "world", policy, tmp_path / "checkpoint",
                    timeout_s=400)[0]
    for key in ("loss", "grad_norm"):
        assert out[True][key] == pytest.approx(out[False][key], rel=1e-6), key
    assert out["resumed"] == out["continued"]
    resumed, continued = out["weights"]
    assert all(torch.equal(resumed[k], t) for k, t in continued.items())
