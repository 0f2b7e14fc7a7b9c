"""`fastgrpo plan`: every shipped config fits its cluster; impossible layouts fail naming what to change;
the parameter counts and the rank map are the real ones (the model on the meta device, megatron's
own rank generator)."""

import json
from pathlib import Path

import pytest
import torch

from fastgrpo.cli import main
from fastgrpo.config import load_config
from fastgrpo.plan import Shape, coordinates, draft_parameters, make_plan, model_config, parameters

CONFIGS = sorted(Path("configs").glob("*.yaml"))


def plan(capsys, *args: str) -> tuple[int, str]:
    status = main(["plan", *args])
    captured = capsys.readouterr()
    return status, captured.out + captured.err


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_fits_its_cluster(capsys, config):
    status, out = plan(capsys, "--config", str(config))
    assert status == 0 and "verdict: fits" in out, out
    assert "DOES NOT FIT" not in out and "[NO]" not in out


def test_the_70b_plan_maps_every_gpu_and_prices_both_phases(capsys):
    status, out = plan(capsys, "--config", "configs/llama3_70b.yaml")
    assert status == 0
    assert "72 ranks = tensor 8 x pipeline 4 x data 2 + 8 draft rank(s)" in out
    assert "node   8: draft0" in out
    # engines sized apart from the trainer: 8 of engine.tensor 8, one per node, every policy GPU in one
    engines = [line.strip() for line in out.splitlines() if line.strip().startswith("engine ") and "led by" in line]
    assert engines == [f"engine {e}: ranks {8 * e}-{8 * e + 7} on node {e}, led by rank {8 * e}; 4 prompt(s) x 16 "
                       f"per step" for e in range(8)]
    assert "engine: weights + draft (bf16)            16.66" in out  # 71.5B x 2 B / 8 GPUs of an engine
    for phase in ("policy GPU, rollout", "policy GPU, training", "draft GPU, training"):
        assert phase in out


def test_an_engine_layout_train_cannot_build_does_not_plan(capsys):
    """engine.tensor that does not divide the policy GPUs, spans a node, or is not 1 for the embedded
    engine: the plan says no (exit 1), or the config is refused naming the key (exit 2)."""
    status, out = plan(capsys, "--config", "configs/llama3_8b.yaml", "engine.tensor=8")  # 6 policy GPUs
    assert status == 1 and "[NO] engine.tensor=8 divides the 6 policy ranks into engines" in out
    status, out = plan(capsys, "--config", "configs/llama3_70b.yaml", "engine.tensor=16")
    assert status == 2 and "engine.tensor breaks a layout rule: engine.tensor=16 divides cluster.gpus_per_node=8" in out
    status, out = plan(capsys, "--config", "configs/llama3_70b.yaml", "--gpus-per-node", "4", "--nodes", "18")
    assert status == 1 and "[NO] engine.tensor=8 divides the 4 ranks of a node" in out
    status, out = plan(capsys, "--config", "configs/tiny_cpu.yaml", "engine.tensor=2")
    assert status == 2 and "engine.tensor=2 needs engine.backend=sglang" in out


def test_the_tiny_config_plans_at_the_70b_topology_on_five_processes(capsys):
    """What slurm/train.sh runs before the tiny job of make test-slurm: TP2 x PP2 and a draft rank, an
    embedded engine on every policy rank (so on both pipeline stages)."""
    status, out = plan(capsys, "--config", "configs/tiny_cpu.yaml", "--nodes", "1", "--gpus-per-node", "5",
                       "--gpu-memory-gb", "8", "trainer.backend=megatron", "parallel.tensor=2", "parallel.pipeline=2",
                       "parallel.draft_ranks=1", "draft.online=async")
    assert status == 0 and "t0p0d0*    t1p0d0*    t0p1d0*    t1p1d0*    draft0" in out and "verdict: fits" in out, out
    assert "engine 3: ranks 3 on node 0, led by rank 3; 4 prompt(s) x 8 per step" in out
    status, out = plan(capsys, "--config", "configs/tiny_cpu.yaml", "--nodes", "1", "--gpus-per-node", "2",
                       "--gpu-memory-gb", "8", "trainer.backend=megatron", "parallel.tensor=2")
    assert status == 1 and "[NO] draft.online=sync learns beside the one engine (2 engine(s);" in out


def test_a_world_that_does_not_divide_fails_with_what_to_change(capsys):
    status, out = plan(capsys, "--config", "configs/llama3_70b.yaml", "--nodes", "8")
    assert status == 1
    assert "[NO] 64 ranks = tensor 8 x pipeline 4 x data ?" in out
    assert "a multiple of 32 GPUs" in out and "verdict: does not fit" in out


def test_a_layout_out_of_memory_names_the_term_and_the_fix(capsys):
    """70B at TP8 x PP1: 8.8B parameters on each GPU (109 GiB in bf16 with the distributed optimizer,
    its fp32 gradient buffer the largest term; 141 GiB in fp32, Adam's moments the largest)."""
    status, out = plan(capsys, "--config", "configs/llama3_70b.yaml", "parallel.pipeline=1")
    assert status == 1 and "DOES NOT FIT" in out
    assert "the largest term is gradients (fp32)" in out and "more tensor or pipeline ranks" in out
    status, out = plan(capsys, "--config", "configs/llama3_70b.yaml", "parallel.pipeline=1", "trainer.precision=fp32",
                       "trainer.distributed_optimizer=false")
    assert status == 1 and "the largest term is Adam moments (fp32)" in out
    status, out = plan(capsys, "--config", "configs/llama3_70b.yaml", "trainer.recompute=false")
    assert status == 1 and "the largest term is activations" in out and "trainer.recompute=true" in out
    status, out = plan(capsys, "--config", "configs/llama3_70b.yaml", "parallel.tensor=3")
    assert status == 1 and "[NO] tensor 3 divides the 64 attention heads" in out
    assert "[NO] the Megatron layout refuses it: parallel.tensor breaks a layout rule: tensor 3 divides the 64 attention heads" in out
    status, out = plan(capsys, "--config", "configs/llama3_70b.yaml", "parallel.tensor=16", "parallel.pipeline=2")
    assert status == 1 and "[NO] tensor 16 divides the 8 key/value heads" in out  # GQA: 8 groups


def test_bad_input_is_a_config_error(capsys):
    status, out = plan(capsys, "--config", "configs/llama3_70b.yaml", "--nodes", "0")
    assert status == 2 and "--nodes must be > 0" in out
    status, out = plan(capsys, "--config", "configs/llama3_70b.yaml", "model.architecture=configs/models/none.json")
    assert status == 2 and "model.architecture: no Hugging Face config" in out


# The real checkpoints' config.json (configs/models/README.md says where each comes from) and their parameter
# counts as transformers builds them (AutoModelForCausalLM.from_config on the meta device, transformers 5.24):
# the published sizes 8.03B, 70.6B, 7.62B, 8.19B, 32.8B.
PUBLISHED = {"llama-3.1-8b-instruct": 8_030_261_248, "llama-3.1-70b-instruct": 70_553_706_496,
             "qwen2.5-7b-instruct": 7_615_616_512, "qwen3-8b": 8_190_735_360, "qwen3-32b": 32_762_123_264}
MODELS = sorted(p.stem for p in Path("configs/models").glob("*.json"))


def _meta_counts(config) -> tuple[int, int]:
    """Parameters of the Hugging Face model and of the draft head, built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    from fastgrpo.models.draft import DraftHead

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        draft = DraftHead(config, max_len=16)
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in draft.parameters())


@pytest.mark.parametrize("name", MODELS)
def test_parameter_counts_are_the_models(name):
    """The counts the memory terms use, for every shape in configs/models, against the model built on
    the meta device; the five families' real checkpoints also against their published counts."""
    cfg = load_config("configs/tiny_cpu.yaml", [f"model.architecture=configs/models/{name}.json"])
    config, _ = model_config(cfg)
    model, draft = _meta_counts(config)
    shape = Shape.of(config)
    assert parameters(shape) == model
    assert draft_parameters(shape) == draft
    if name in PUBLISHED:
        assert model == PUBLISHED[name]


def test_the_five_real_shapes_are_there():
    assert set(PUBLISHED) <= set(MODELS)


@pytest.mark.parametrize("family, options", [
    ("llama", {}), ("llama", {"tie_word_embeddings": True}), ("llama", {"attention_bias": True}),
    ("llama", {"head_dim": 48}),
    ("qwen2", {}), ("qwen2", {"tie_word_embeddings": True}),
    ("qwen3", {}), ("qwen3", {"tie_word_embeddings": True}), ("qwen3", {"attention_bias": True}),
])
def test_each_family_option_is_counted(family, options):
    """What each family adds to the Llama layer, one option at a time on a small model: Qwen3's q/k
    norms and its own head size (head_dim 32 where hidden / heads is 16), Qwen2's q/k/v biases,
    Llama's attention_bias (q/k/v and o), a tied or untied LM head."""
    from transformers import AutoConfig

    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=301, max_position_embeddings=128, tie_word_embeddings=False)
    if family == "qwen3":
        base["head_dim"] = 32
    config = AutoConfig.for_model(family, **{**base, **options})
    model, draft = _meta_counts(config)
    shape = Shape.of(config)
    assert parameters(shape) == model and draft_parameters(shape) == draft
    assert shape.tied == config.tie_word_embeddings and shape.qk_norm == (family == "qwen3")


def test_the_qwen3_shape_is_planned_as_qwen3(capsys):
    """Qwen3-8B: head_dim 128 and the q/k norms in the count; the KV cache at 36 layers x 8 KV heads x 128
    (2 x 36 x 8 x 128 x 2 B / TP2 = 72 KiB a token per GPU)."""
    status, out = plan(capsys, "--config", "configs/qwen3_8b.yaml")
    assert status == 0 and "verdict: fits" in out
    assert ("8.19B parameters (qwen3: 36 layers, hidden 4096, 32 heads x head_dim 128, 8 KV heads, MLP 12288, "
            "vocab 151936, q/k norms, untied LM head) from configs/models/qwen3-8b.json") in out
    assert "at 72.0 KiB/token/GPU" in out and "[ok] the Megatron layout accepts tensor 2 x pipeline 1" in out


def test_qwen3_32b_plans_at_its_own_head_size(capsys):
    """Qwen3-32B: 64 heads x head_dim 128 = 8192, not the hidden size 5120: the count and the KV cache follow
    head_dim (2 x 64 layers x 8 KV heads x 128 x 2 B / TP8 = 32 KiB a token per GPU)."""
    status, out = plan(capsys, "--config", "configs/qwen3_8b.yaml", "model.architecture=configs/models/qwen3-32b.json",
                       "parallel.tensor=8", "parallel.draft_ranks=0", "draft.online=off", "engine.tensor=8",
                       "engine.mem_fraction=0.55", "--nodes", "2")
    assert "32.76B parameters (qwen3: 64 layers, hidden 5120, 64 heads x head_dim 128" in out
    assert "at 32.0 KiB/token/GPU" in out, out


def test_a_context_longer_than_the_models_positions_does_not_plan(capsys):
    """Llama 3 (8192 positions) at the 8B config's 18k tokens: the plan says no; Llama 3.1 (131072) holds them."""
    status, out = plan(capsys, "--config", "configs/llama3_8b.yaml", "model.architecture=configs/models/llama-3-8b.json")
    assert status == 1
    assert "[NO] model.max_context 18432 is within the model's 8192 positions (max_position_embeddings)" in out
    status, out = plan(capsys, "--config", "configs/llama3_8b.yaml")
    assert status == 0 and "[ok] model.max_context 18432 is within the model's 131072 positions" in out


@pytest.mark.parametrize("change, named", [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "model_type 'mistral' is not supported"),
    ({"auto_map": {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}}, "custom modelling code (auto_map"),
])
def test_an_unsupported_checkpoint_is_refused_naming_the_families(capsys, tmp_path, change, named):
    """One rule (models/families.check_family) for plan as for train, sft and convert: an unknown
    model_type or a config asking for remote code is a config error (exit 2) naming the supported
    families, before anything is planned."""
    raw = json.loads(Path("configs/models/qwen3-8b.json").read_text())
    file = tmp_path / "config.json"
    file.write_text(json.dumps({**raw, **change}))
    status, out = plan(capsys, "--config", "configs/qwen3_8b.yaml", f"model.architecture={file}")
    assert status == 2 and named in out and str(file) in out
    assert "llama: Llama 3.x" in out and "qwen2: Qwen2.5" in out and "qwen3: Qwen3 dense" in out
    assert "verdict" not in out
    status, out = plan(capsys, "--config", "configs/tiny_cpu.yaml", f"model.path={tmp_path}")
    assert status == 2 and named in out  # the checkpoint's own config.json, without model.architecture


def test_the_rank_map_is_megatrons():
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    t, p, d = 8, 4, 2
    generator = parallel_state.RankGenerator(tp=t, ep=1, dp=d, pp=p, cp=1, order="tp-cp-ep-dp-pp")
    for index, token in ((0, "tp"), (1, "pp"), (2, "dp")):
        for group in generator.get_ranks(token):
            others = {tuple(c for i, c in enumerate(coordinates(r, t, d)) if i != index) for r in group}
            assert len(others) == 1, (token, group)  # a group varies in its own coordinate only
            assert sorted(coordinates(r, t, d)[index] for r in group) == list(range(len(group)))
    assert make_plan(load_config("configs/llama3_70b.yaml"), 9, 8, 80).fits


def test_zero_stages_shard_what_they_say(capsys):
    """Llama-3-8B under trainer.backend=deepspeed on one node of 8 (no draft slice): ZeRO-1 shards
    Adam over the 8 data ranks, ZeRO-2 the gradients too, ZeRO-3 the weights too; offload moves Adam
    off the GPU."""
    base = ["--config", "configs/llama3_8b.yaml", "trainer.backend=deepspeed", "parallel.tensor=1",
            "parallel.draft_ranks=0", "draft.online=off", "trainer.recompute=false", "trainer.distributed_optimizer=false",
            "trainer.precision=fp32"]

    def terms(*extra):
        _, out = plan(capsys, *base, *extra)
        section = out.split("policy GPU, rollout")[1].split("\n\n")[0]
        return {name: float(line.strip()[len(name):].split()[0]) for line in section.splitlines()
                for name in ("weights (fp32)", "gradients (fp32)", "Adam moments (fp32)") if line.strip().startswith(name)}

    p = parameters(Shape.of(model_config(load_config("configs/llama3_8b.yaml"))[0])) * 4 / 2**30  # GiB of fp32
    one, two, three = (terms(f"deepspeed.zero_stage={z}") for z in (1, 2, 3))
    assert one["weights (fp32)"] == pytest.approx(p, abs=0.01) and one["gradients (fp32)"] == pytest.approx(p, abs=0.01)
    assert one["Adam moments (fp32)"] == pytest.approx(2 * p / 8, abs=0.01)
    assert two["gradients (fp32)"] == pytest.approx(p / 8, abs=0.01) and two["weights (fp32)"] == pytest.approx(p, abs=0.01)
    assert three["weights (fp32)"] == pytest.approx(p / 8, abs=0.01)
    assert terms("deepspeed.zero_stage=3", "deepspeed.offload_optimizer=true")["Adam moments (fp32)"] == 0.0


def test_deepspeed_bf16_is_priced_as_zero_accounts_it(capsys):
    """bf16 under ZeRO: 2 B of weights, 2 B of gradients and 12 B of fp32 master weights and moments per
    parameter (the ZeRO paper's 2 + 2 + K), each sharded from the stage that shards it."""
    base = ["--config", "configs/llama3_8b.yaml", "trainer.backend=deepspeed", "parallel.tensor=1",
            "parallel.draft_ranks=0", "draft.online=off", "trainer.recompute=false", "trainer.distributed_optimizer=false",
            "trainer.precision=bf16"]
    names = ("weights (bf16)", "gradients (bf16)", "main weights + Adam moments (fp32)")

    def terms(*extra):
        _, out = plan(capsys, *base, *extra)
        section = out.split("policy GPU, rollout")[1].split("\n\n")[0]
        return {name: float(line.strip()[len(name):].split()[0]) for line in section.splitlines()
                for name in names if line.strip().startswith(name)}

    p = parameters(Shape.of(model_config(load_config("configs/llama3_8b.yaml"))[0])) / 2**30  # GiB per byte a parameter
    one, two, three = (terms(f"deepspeed.zero_stage={z}") for z in (1, 2, 3))
    assert one[names[0]] == pytest.approx(2 * p, abs=0.01) and one[names[1]] == pytest.approx(2 * p, abs=0.01)
    assert one[names[2]] == pytest.approx(12 * p / 8, abs=0.01)
    assert two[names[1]] == pytest.approx(2 * p / 8, abs=0.01) and two[names[0]] == pytest.approx(2 * p, abs=0.01)
    assert three[names[0]] == pytest.approx(2 * p / 8, abs=0.01) and three[names[2]] == pytest.approx(12 * p / 8, abs=0.01)
    assert terms("deepspeed.zero_stage=3", "deepspeed.offload_optimizer=true")[names[2]] == 0.0


def test_precision_and_the_distributed_optimizer_price_what_megatron_keeps(capsys):
    """Per parameter of a GPU's shard, with the formula printed beside each term: fp32 keeps 4 B of
    weights, 4 B of gradient buffer and 8 B of Adam moments; bf16 2 B of bf16 weights, 4 B of fp32
    gradient buffer and 12 B of fp32 main weights and moments; the distributed optimizer divides the
    optimizer's part (only) by the data-parallel size. Activations follow the training dtype;
    precision auto plans bf16 for SGLang's GPUs and fp32 for the embedded engine's CPU worlds."""
    base = ["--config", "configs/llama3_70b.yaml"]  # TP8 x PP4 x DP2: 2.27B parameters a GPU

    def terms(*extra):
        _, out = plan(capsys, *base, *extra)
        section = out.split("policy GPU, training")[1].split("\n\n")[0]
        rows = {}
        for line in section.splitlines()[1:]:
            name, rest = line[2:40].strip(), line[40:].split(None, 1)
            rows[name] = (float(rest[0]), rest[1] if len(rest) > 1 else "")
        return rows

    p = 2.27e9 / 2**30  # GiB per byte per parameter, to the plan's rounding
    fp32 = terms("trainer.precision=fp32", "trainer.distributed_optimizer=false")
    assert fp32["weights (fp32)"][0] == pytest.approx(4 * p, rel=0.01) and "4 B x 2.27B" in fp32["weights (fp32)"][1]
    assert fp32["gradients (fp32)"][0] == pytest.approx(4 * p, rel=0.01)
    assert fp32["Adam moments (fp32)"][0] == pytest.approx(8 * p, rel=0.01)
    assert "8 B x parameters replicated over data ranks" in fp32["Adam moments (fp32)"][1]
    sharded = terms("trainer.precision=fp32", "trainer.distributed_optimizer=true")
    assert sharded["Adam moments (fp32)"][0] == pytest.approx(8 * p / 2, rel=0.01)
    assert "/ data 2 (trainer.distributed_optimizer)" in sharded["Adam moments (fp32)"][1]
    assert sharded["weights (fp32)"] == fp32["weights (fp32)"] and sharded["gradients (fp32)"] == fp32["gradients (fp32)"]
    bf16 = terms("trainer.precision=bf16", "trainer.distributed_optimizer=false")
    assert bf16["weights (bf16)"][0] == pytest.approx(2 * p, rel=0.01) and "2 B x 2.27B" in bf16["weights (bf16)"][1]
    assert bf16["gradients (fp32)"][0] == pytest.approx(4 * p, rel=0.01) and "grad_reduce_in_fp32" in bf16["gradients (fp32)"][1]
    assert bf16["main weights + Adam moments (fp32)"][0] == pytest.approx(12 * p, rel=0.01)
    assert bf16["activations (bf16)"][0] == pytest.approx(fp32["activations (fp32)"][0] / 2, rel=0.01)
    shipped = terms()  # the config's own: bf16 with the distributed optimizer
    assert shipped["main weights + Adam moments (fp32)"][0] == pytest.approx(12 * p / 2, rel=0.01)
    assert "12 B x parameters / data 2 (trainer.distributed_optimizer)" in shipped["main weights + Adam moments (fp32)"][1]
    assert terms("trainer.precision=auto") == shipped  # SGLang engines: GPUs, bf16
    _, out = plan(capsys, "--config", "configs/tiny_cpu.yaml", "--gpu-memory-gb", "8")
    assert "weights (fp32)" in out and "activations (fp32)" in out  # auto with the embedded engine: a CPU, fp32


# Qwen3-30B-A3B by hand: attention q 32 x 128 = 4096 and k, v 4 x 128 = 512 wide at hidden 2048; a router of 128
# experts; two norms and the q/k norms of 128; 128 experts of three 2048 x 768 matrices; an untied 151936-token
# vocabulary and the final norm.
A3B_ATTENTION = 2048 * (4096 + 2 * 512) + 4096 * 2048 + 128 * 2048 + 2 * 2048 + 2 * 128  # 19,140,864 a layer
A3B_EXPERTS = 128 * 3 * 2048 * 768  # 603,979,776 a layer
A3B_EMBEDDINGS = 2 * 151936 * 2048 + 2048


def test_the_qwen3_30b_a3b_plan_divides_the_experts_over_expert_parallel_ranks(capsys):
    """configs/qwen3_30b_a3b.yaml (EP8 over data 8): each GPU holds the replicated attention, router and
    embeddings and 16 of every layer's 128 experts; the distributed optimizer shards the replicated part over
    the 8 data ranks and the experts over their expert-data ranks (8 / 8 = 1: each GPU's experts are its own)."""
    assert 48 * (A3B_ATTENTION + A3B_EXPERTS) + A3B_EMBEDDINGS == 30_532_122_624  # the published 30.5B
    active = 48 * (A3B_ATTENTION + 8 * 3 * 2048 * 768) + A3B_EMBEDDINGS  # top-8 experts a token
    replicated, experts = 48 * A3B_ATTENTION + A3B_EMBEDDINGS, 48 * A3B_EXPERTS // 8
    status, out = plan(capsys, "--config", "configs/qwen3_30b_a3b.yaml")
    assert f"30.53B parameters, {active / 1e9:.2f}B active" in out and "3.35B active" in out
    assert "[ok] parallel.expert=8 divides the 128 experts" in out
    assert "[ok] parallel.expert=8 divides the 8 data-parallel ranks" in out
    weights = 2 * (replicated + experts) / 2**30
    optimizer = 12 * (replicated / 8 + experts / 1) / 2**30
    assert f"{'weights (bf16)':<38} {weights:8.2f}" in out, out
    assert f"{'main weights + Adam moments (fp32)':<38} {optimizer:8.2f}" in out
    assert f"2 B x {(replicated + experts) / 1e9:.2f}B parameters" in out  # 5.16B a GPU, of 30.5B


@pytest.mark.parametrize("overrides, rule", [
    (["parallel.expert=3"], "[NO] parallel.expert=3 divides the 128 experts"),
    (["parallel.expert=16"], "[NO] parallel.expert=16 divides the 8 data-parallel ranks"),
    (["model.architecture=configs/models/qwen3-8b.json"],
     "[NO] parallel.expert=8 splits the experts of a mixture-of-experts model (qwen3: 0 experts)"),
])
def test_an_expert_layout_that_does_not_divide_is_refused(capsys, overrides, rule):
    status, out = plan(capsys, "--config", "configs/qwen3_30b_a3b.yaml", *overrides)
    assert status == 1 and rule in out and "verdict: does not fit" in out


def test_the_config_a_launched_world_and_the_plan_judge_one_rule_alike(capsys, monkeypatch):
    """One rule, three judges: what `load_config` refuses, a launched rank refuses, and the plan marks NO,
    in the same words (config.layout_rules)."""
    from fastgrpo.config import ConfigError
    from fastgrpo.run_setup import check_layout

    # the config alone: an expert-parallel layout for a trainer that does not split the policy
    with pytest.raises(ConfigError, match=r"parallel\.expert breaks a layout rule: parallel\.expert=2 needs "
                                          r"trainer\.backend=megatron"):
        load_config(None, ["parallel.expert=2"])
    status, out = plan(capsys, "--config", "configs/qwen3_30b_a3b.yaml", "trainer.backend=deepspeed",
                       "trainer.recompute=false", "trainer.distributed_optimizer=false")
    assert status == 2 and "parallel.expert=8 needs trainer.backend=megatron" in out
    # the launched world: 6 policy ranks are 6 data ranks, which expert 4 does not divide
    cfg = load_config("configs/qwen3_30b_a3b.yaml", ["parallel.expert=4", "engine.tensor=2", "draft.online=off"])
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")
    with pytest.raises(ConfigError, match=r"parallel\.expert breaks a layout rule: parallel\.expert=4 divides the 6 "
                                          r"data-parallel ranks"):
        check_layout(cfg)
    status, out = plan(capsys, "--config", "configs/qwen3_30b_a3b.yaml", "parallel.expert=4", "engine.tensor=2",
                       "draft.online=off", "--gpus-per-node", "6")
    assert status == 1 and "[NO] parallel.expert=4 divides the 6 data-parallel ranks" in out


def _rows(out: str, section: str) -> dict[str, tuple[float, str]]:
    """A section of the plan's output: term name -> (GiB, formula)."""
    rows = {}
    for line in out.split(section)[1].split("\n\n")[0].splitlines()[1:]:
        name, rest = line[2:40].strip(), line[40:].split(None, 1)
        rows[name] = (float(rest[0]), rest[1] if len(rest) > 1 else "")
    return rows


def test_the_h100_config_keeps_the_30b_a3b_optimizer_in_host_memory(capsys):
    """configs/qwen3_30b_a3b_h100.yaml: configs/qwen3_30b_a3b.yaml's layout on 80 GB with
    trainer.optimizer_offload. Each GPU's optimizer share (the replicated 1.5B / data 8 and its 3.6B experts
    whole) leaves the GPU: its 12 B of fp32 main weights and Adam moments are 0 there, and each phase is that
    much lighter than at the same settings without the offload; a node's host memory holds 16 B of it per
    parameter (main weight, two moments, a pinned gradient copy) on each of the 8 ranks, a checkpoint's
    export (rank 0 the whole policy in bf16) beside it, and at the start, on every rank, one tensor at a
    time of the Hugging Face checkpoint: the largest, the embedding (151,936 x 2,048), held twice in fp32
    (as read and as made into the Megatron tensor). All by hand from the model's shapes."""
    total = 48 * (A3B_ATTENTION + A3B_EXPERTS) + A3B_EMBEDDINGS
    replicated, experts = 48 * A3B_ATTENTION + A3B_EMBEDDINGS, 48 * A3B_EXPERTS // 8
    share = replicated / 8 + experts  # a GPU's optimizer parameters: 3.82B
    status, out = plan(capsys, "--config", "configs/qwen3_30b_a3b_h100.yaml")
    assert status == 0 and "verdict: fits" in out, out
    assert "plan: 1 node(s) x 8 GPU(s) of 80 GiB" in out
    _, kept = plan(capsys, "--config", "configs/qwen3_30b_a3b_h100.yaml", "trainer.optimizer_offload=false")
    for phase in ("policy GPU, rollout", "policy GPU, training"):
        offloaded, on_gpu = _rows(out, phase), _rows(kept, phase)
        optimizer = offloaded["main weights + Adam moments (fp32)"]
        assert optimizer[0] == 0.0 and optimizer[1].startswith(
            f"in host memory (trainer.optimizer_offload): 12 B x {share / 1e9:.2f}B parameters / data 8, experts / "
            f"expert-data 1")
        assert on_gpu["main weights + Adam moments (fp32)"][0] == pytest.approx(12 * share / 2**30, abs=0.01)
        assert offloaded["weights (bf16)"][0] == pytest.approx(2 * (replicated + experts) / 2**30, abs=0.01)
        assert offloaded["gradients (fp32)"][0] == pytest.approx(4 * (replicated + experts) / 2**30, abs=0.01)
        assert offloaded["total"][0] == pytest.approx(on_gpu["total"][0] - 12 * share / 2**30, abs=0.02)
    assert _rows(kept, "policy GPU, rollout")["total"][0] > 80  # without it, the rollout does not fit on 80 GB
    host = _rows(out, "host memory per node")
    offload, export, start = 16 * share * 8 / 2**30, 2 * total / 2**30, 2 * 4 * 151936 * 2048 * 8 / 2**30
    assert host["training: optimizer offload"][0] == pytest.approx(offload, abs=0.01)
    assert host["checkpoint: exported policy (bf16)"][0] == pytest.approx(export, abs=0.01)
    assert host["start: loading the policy"][0] == pytest.approx(start, abs=0.01)
    assert host["peak"][0] == pytest.approx(offload + export, abs=0.01)
    # the H200 config keeps the optimizer on its GPUs: no offload in host memory, the rest as on the H100s
    _, h200 = plan(capsys, "--config", "configs/qwen3_30b_a3b.yaml")
    host = _rows(h200, "host memory per node")
    assert "training: optimizer offload" not in host and host["peak"][0] == pytest.approx(export, abs=0.01)


def test_one_rank_offloads_the_whole_models_optimizer_and_deepspeed_has_no_host_section(capsys):
    """Qwen3-8B (8,190,735,360 parameters) on one GPU with the offload: the rank's optimizer share is the whole
    model, 16 B a parameter in host memory, beside a checkpoint's bf16 export (2 B); the start holds twice its
    largest tensor in fp32, the 151,936 x 4,096 embedding (or LM head). DeepSpeed's plan has no host section
    (its offload is not priced there)."""
    n = PUBLISHED["qwen3-8b"]
    single = ["--config", "configs/qwen3_8b.yaml", "--nodes", "1", "--gpus-per-node", "1", "parallel.tensor=1",
              "parallel.draft_ranks=0", "draft.online=off", "engine.tensor=1", "trainer.optimizer_offload=true"]
    _, out = plan(capsys, *single)
    host = _rows(out, "host memory per node")
    assert host["training: optimizer offload"][0] == pytest.approx(16 * n / 2**30, abs=0.01)
    assert host["checkpoint: exported policy (bf16)"][0] == pytest.approx(2 * n / 2**30, abs=0.01)
    assert host["start: loading the policy"][0] == pytest.approx(8 * 151936 * 4096 / 2**30, abs=0.01)
    assert host["peak"][0] == pytest.approx(18 * n / 2**30, abs=0.01)
    assert _rows(out, "policy GPU, training")["main weights + Adam moments (fp32)"][0] == 0.0
    _, out = plan(capsys, "--config", "configs/llama3_8b.yaml", "trainer.backend=deepspeed", "parallel.tensor=1",
                  "parallel.draft_ranks=0", "draft.online=off", "trainer.recompute=false",
                  "trainer.distributed_optimizer=false")
    assert "host memory per node" not in out and "verdict" in out


def test_the_plans_in_the_docs_are_what_plan_prints(capsys):
    """docs/planning.md's table of the shipped GPU configs and its pasted Qwen3-8B and 70B plans are the
    current output of `fastgrpo plan` (each total, the sequences an engine holds)."""
    import re

    docs = Path("docs/planning.md").read_text()
    rows = [r for r in docs.splitlines() if r.startswith("| `fastgrpo plan --config configs/")]
    assert len(rows) >= 6
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        config = re.search(r"configs/\S+\.yaml", cells[0]).group(0)
        status, out = plan(capsys, "--config", config)
        totals = re.findall(r"^  total +([\d.]+) ", out, re.M)
        held = re.search(r"holds (\d+) full-length sequences \((\d+) tokens\)", out)
        want = [cells[2], cells[3]] + ([] if cells[4].startswith("(no draft") else [cells[4]])
        assert status == 0 and totals == want, (config, totals, want)
        assert cells[5].startswith(f"{held.group(1)} sequences of {held.group(2)}"), (config, cells[5])
    for config, opening in (("configs/qwen3_8b.yaml", "--config configs/qwen3_8b.yaml`):\n\n```\n"),
                            ("configs/llama3_70b.yaml", "configs/llama3_70b.yaml`, current code):\n\n```\n")):
        pasted = docs.split(opening, 1)[1].split("\n```", 1)[0]
        status, out = plan(capsys, "--config", config)
        assert pasted == out.rstrip("\n"), config
