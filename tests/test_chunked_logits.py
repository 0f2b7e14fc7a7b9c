"""Logits in chunks (issue 49, `trainer.logits_chunk_tokens`): the per-token log-probabilities and
entropy every trainer scores, computed from the final hidden states a chunk of tokens at a time
(`trainers/chunked_logprobs.py`), never holding the whole logits:
- `chunked_scores` equals the whole logits' scores and their gradients (with respect to the hidden
  states, the output weight and a bias) to fp32 rounding, at chunk sizes that do and do not divide the
  tokens, at several temperatures, under top-k / top-p with the engine's sets, and with padding masked
  out of the loss; and both equal the distribution written out by hand in float64;
- no operation makes a tensor of more than one chunk's logits, forward or backward (a dispatch mode
  sees every tensor made), where the whole computation makes the whole logits (the control);
- the peak of bytes allocated (torch's profiler on CPU, `tools/logits_memory.peak_bytes`) is within the
  plan's `LOGIT_COPIES` of one chunk's logits, and the whole logits' within its multiple of them;
- each trainer's step is the same with and without chunking: torch in this process (a mixture of
  experts with the router's logits, a tied head), Megatron (TP2 with sequence parallelism, TP2 without,
  PP2 with the tied head's copy on the last stage, a reference policy) and DeepSpeed ZeRO-3 at DP2 in
  worlds of two processes (slow tier);
- `fastgrpo plan` prices one chunk instead of the whole sequence's logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fastgrpo.config import ConfigError, GRPOConfig, OptimConfig, TrainerConfig, load_config
from fastgrpo.plan import LOGIT_COPIES, LOGIT_COPIES_CUT
from fastgrpo.trainers.chunked_logprobs import chunked_scores, token_scores
from fastgrpo.types import SamplingParams
from tools.logits_memory import peak_bytes

V, H = 96, 16
ROWS, WIDTH = 3, 12  # 36 tokens


def _case(seed: int = 0, vocab: int = V, hidden: int = H, rows: int = ROWS, width: int = WIDTH):
    """Hidden states, an output weight and bias, the tokens, and a loss's weights: rows of advantages,
    padding on the right of two rows (masked out of the loss), an entropy bonus."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, width, hidden, generator=g)
    w = 0.4 * torch.randn(vocab, hidden, generator=g)
    b = 0.2 * torch.randn(vocab, generator=g)
    tokens = torch.randint(0, vocab, (rows, width), generator=g)
    lengths = torch.tensor([width, width - 3, 5, width, 2][:rows])
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    advantages = torch.randn(rows, 1, generator=g)
    return h, w, b, tokens, mask, advantages


def _loss(logp, entropy, mask, advantages):
    return ((advantages * logp + 0.05 * entropy) * mask).sum() / mask.sum()


def _scores_and_grads(h, w, b, tokens, mask, advantages, score, chunk, sets=None):
    h, w, b = (t.detach().clone().requires_grad_() for t in (h, w, b))
    logp, entropy = chunked_scores(h, w, tokens, score, chunk, sets, b)
    loss = _loss(logp, entropy, mask, advantages)
    return (logp.detach(), entropy.detach(), *torch.autograd.grad(loss, (h, w, b)))


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """Equal to `rel` of the larger magnitude in `want` (fp32 rounding scales with it)."""
    scale = float(want.abs().max())
    assert float((got.double() - want.double()).abs().max()) <= rel * scale, (got, want)


# -- the scores and gradients ----------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])  # 0: greedy, scored at temperature 1
@pytest.mark.parametrize("chunk", [1, 7, 12, 29])  # 36 tokens: 7 and 29 do not divide them, 12 does
def test_chunks_equal_the_whole_logits_and_the_distribution_by_hand(chunk, temperature):
    h, w, b, tokens, mask, advantages = _case()
    sampling = SamplingParams(temperature=temperature)

    def score(logits, t, s):
        return token_scores(logits, t, sampling, s)

    whole = _scores_and_grads(h, w, b, tokens, mask, advantages, score, 0)
    chunked = _scores_and_grads(h, w, b, tokens, mask, advantages, score, chunk)
    for got, want in zip(chunked, whole):  # log p, entropy, d/dhidden, d/dweight, d/dbias
        _close(got, want, 1e-6)
    # padding positions: their scores are computed, but no gradient reaches their hidden states
    assert float(chunked[2][mask == 0].abs().max()) == 0.0

    # the distribution by hand, in float64: softmax(z / T) (greedy: T = 1), its log at the token, its entropy
    h64, w64, b64 = (t.double().requires_grad_() for t in (h, w, b))
    z = (h64 @ w64.T + b64) / (temperature or 1.0)
    logp_all = z - z.logsumexp(-1, keepdim=True)
    logp = logp_all.gather(-1, tokens[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    grads = torch.autograd.grad(_loss(logp, entropy, mask, advantages), (h64, w64, b64))
    for got, want in zip(chunked, (logp, entropy, *grads)):
        _close(got, want.detach(), 2e-6)


def test_chunks_equal_the_whole_logits_under_top_k_top_p_and_the_engines_sets():
    h, w, b, tokens, mask, advantages = _case(seed=1)
    sampling = SamplingParams(temperature=0.8, top_k=30, top_p=0.9)
    # the engine's sets at every other position: 12 token ids (the sampled one among them), -1 padded to 16
    g = torch.Generator().manual_seed(2)
    sets = torch.full((*tokens.shape, 16), -1)
    for i in range(ROWS):
        for j in range(0, WIDTH, 2):
            ids = torch.randperm(V, generator=g)[:12]
            ids[0] = tokens[i, j]
            sets[i, j, :12] = ids

    def score(logits, t, s):
        return token_scores(logits, t, sampling, s)

    whole = _scores_and_grads(h, w, b, tokens, mask, advantages, score, 0, sets)
    for chunk in (5, 18):
        for got, want in zip(_scores_and_grads(h, w, b, tokens, mask, advantages, score, chunk, sets), whole):
            _close(got, want, 1e-6)
    # the sets took effect: a position scored in its 12-token set has an entropy below log 12
    assert float(whole[1][:, ::2].max()) < float(torch.tensor(12.0).log())


def test_a_weight_without_gradient_and_hidden_states_without_one():
    """The reference policy's scoring (nothing needs a gradient) and a head trained alone (the hidden
    states need none): each gradient asked for is the whole logits' one."""
    h, w, b, tokens, mask, advantages = _case(seed=3)
    sampling = SamplingParams(temperature=0.7)

    def score(logits, t, s):
        return token_scores(logits, t, sampling, s)

    with torch.no_grad():
        got = chunked_scores(h, w, tokens, score, 5)
    want = chunked_scores(h, w, tokens, score, 0)
    for a, b_ in zip(got, want):
        _close(a, b_, 1e-6)
    weights = [w.clone().requires_grad_() for _ in range(2)]
    for chunk, weight in zip((0, 5), weights):
        _loss(*chunked_scores(h, weight, tokens, score, chunk), mask, advantages).backward()
    _close(weights[1].grad, weights[0].grad, 1e-6)


# -- memory ------------------------------------------------------------------------------------------------
class LargestLogits(TorchDispatchMode):
    """The most rows of any floating tensor an operation makes (views excluded: they hold no memory of
    their own) whose last dimension is a vocabulary's (`vocab`: one width or several, e.g. Megatron's
    shard per TP rank, the padded and the tokenizer's vocabulary): logits and the log-softmax, exp and
    gradients of them."""

    def __init__(self, vocab: int | set[int]):
        super().__init__()
        self.widths, self.rows = {vocab} if isinstance(vocab, int) else set(vocab), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() and t.shape[-1] in self.widths:
                    self.rows = max(self.rows, t.numel() // t.shape[-1])
        return out


def test_no_tensor_holds_more_than_one_chunks_logits():
    vocab, chunk = 512, 32
    h, w, b, tokens, mask, advantages = _case(seed=4, vocab=vocab, rows=4, width=64)  # 256 tokens
    sampling = SamplingParams(temperature=0.7)

    def score(logits, t, s):
        return token_scores(logits, t, sampling, s)

    rows = {}
    for c in (0, chunk):
        with LargestLogits(vocab) as seen:
            _scores_and_grads(h, w, b, tokens, mask, advantages, score, c)
        rows[c] = seen.rows
    assert rows[0] == 256  # the control: the whole computation makes the whole logits
    assert rows[chunk] == chunk


@pytest.mark.parametrize("cut", [False, True], ids=["temperature", "top-k-top-p"])
def test_peak_memory_is_one_chunks_logits_within_the_plans_multiple(cut):
    """What `fastgrpo plan` prices (plan.LOGIT_COPIES x 4 B x tokens x vocab, and for a chunk the
    output weight's fp32 gradient beside) covers what forward and backward allocate at their peak,
    and chunking brings that peak from the whole logits' multiple to one chunk's."""
    vocab, hidden, tokens_n, chunk = 4096, 16, 512, 64
    h, w, b, tokens, mask, advantages = _case(seed=5, vocab=vocab, hidden=hidden, rows=2, width=tokens_n // 2)
    sampling = SamplingParams(temperature=0.7, top_k=50 if cut else 0, top_p=0.9 if cut else 1.0)
    copies = LOGIT_COPIES_CUT if cut else LOGIT_COPIES

    def score(logits, t, s):
        return token_scores(logits, t, sampling, s)

    peaks = {}
    for c in (0, chunk):
        def step():
            _scores_and_grads(h, w, b, tokens, mask, advantages, score, c)

        step()  # (a first run's one-time allocations out of the measurement)
        peaks[c] = peak_bytes(step)
    whole, one = 4 * tokens_n * vocab, 4 * chunk * vocab
    # beside the logits: the weight's gradient (and its fp32 sum over chunks) and the hidden states'
    others = 4 * (3 * vocab + 2 * tokens_n) * hidden
    assert whole < peaks[0] <= copies["whole"] * whole + others
    assert one < peaks[chunk] <= copies["chunk"] * one + 4 * vocab * hidden + others
    assert peaks[chunk] < peaks[0] / 4


# -- the torch trainer ---------------------------------------------------------------------------------------
def _batch(vocab: int, rows: int = 4, seed: int = 0):
    """Sequences of several lengths (right-padded), engine log-probabilities off the policy's."""
    from fastgrpo.grpo.batch import build_batch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, vocab, (3 + i,), generator=g).tolist() for i in range(rows)]
    responses = [torch.randint(5, vocab, (4 + 2 * i,), generator=g).tolist() for i in range(rows)]
    engine = [(-1.0 - torch.rand(len(r), generator=g)).tolist() for r in responses]
    return build_batch(prompts, responses, engine, torch.linspace(-1, 1, rows), pad_id=0)


@pytest.fixture(scope="module")
def policies(tmp_path_factory) -> dict[str, Path]:
    from fastgrpo.bench.family_checkpoints import MOE_FAMILY, write_family_checkpoint

    policies = {name: write_family_checkpoint(name, tmp_path_factory.mktemp(name)) for name in (MOE_FAMILY, "qwen2.5")}
    # Megatron's MoE: every layer sparse
    policies["qwen3_moe-sparse"] = write_family_checkpoint(MOE_FAMILY, tmp_path_factory.mktemp("sparse"),
                                                           mlp_only_layers=[])
    return policies


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2.5"])  # router logits beside; a head tied to the embedding
def test_the_torch_trainers_step_is_the_same_in_chunks(policies, family):
    from fastgrpo.models.policy import load_policy
    from fastgrpo.trainers.torch_trainer import TorchPolicyTrainer
    from tests.conftest import assert_same_update

    sampling = SamplingParams(temperature=0.7, top_k=40, top_p=0.95)
    start = load_policy(policies[family]).state_dict()
    vocab = start["model.embed_tokens.weight"].shape[0]
    batch = _batch(vocab)
    results = {}
    for chunk in (0, 7):  # micro-batches of 2 rows, 10 and 16 wide: 18 and 30 scored tokens, 7 divides neither
        trainer = TorchPolicyTrainer(load_policy(policies[family]), GRPOConfig(micro_batch_size=2, minibatches=2),
                                     OptimConfig(lr=1e-3), sampling, trainer=TrainerConfig(logits_chunk_tokens=chunk))
        logprobs = trainer.logprobs(batch)
        gradient = trainer.loss_gradient(batch)
        with LargestLogits(vocab) as seen:  # the training forwards and backwards
            metrics = trainer.train_step(batch)
        results[chunk] = (seen.rows, logprobs, gradient, metrics, trainer.model.state_dict())
    (rows0, lp0, grad0, m0, w0), (rows7, lp7, grad7, m7, w7) = results[0], results[7]
    assert rows0 == 2 * 16 and rows7 == 7  # the whole micro-batch's logits [2, 16, V] without chunks; 7 rows with
    _close(lp7, lp0, 1e-6)
    assert float((grad7 - grad0).norm()) <= 1e-6 * float(grad0.norm())
    assert m0["updates"] == m7["updates"] == 2
    for key in ("loss", "grad_norm", "entropy", "clip_fraction", "kl_engine_trainer"):
        assert m7[key] == pytest.approx(m0[key], rel=1e-6, abs=1e-7), key
    assert_same_update(w7, w0, start, names=_compared(n for n, _ in load_policy(policies[family]).named_parameters()))


def _compared(names) -> list[str]:
    """The parameters whose updates two equal steps must share: all but the key biases, whose gradient is
    exactly zero (softmax ignores a shift common to every key), so that Adam moves them by rounding noise."""
    return [n for n in names if not n.endswith("k_proj.bias")]


def test_the_chunk_size_is_a_validated_config_key(tmp_path):
    assert load_config(None, [f"run_dir={tmp_path}"]).trainer.logits_chunk_tokens == 1024
    assert load_config(None, [f"run_dir={tmp_path}", "trainer.logits_chunk_tokens=0"]).trainer.logits_chunk_tokens == 0
    with pytest.raises(ConfigError, match="trainer.logits_chunk_tokens must be >= 0"):
        load_config(None, [f"run_dir={tmp_path}", "trainer.logits_chunk_tokens=-1"])


# -- Megatron and DeepSpeed in worlds of two -------------------------------------------------------------------
def _steps(rank, world, policy, tmp, backend, overrides, chunk):
    """In the world: a fresh trainer without chunks and one with chunks of `chunk` tokens, each scoring
    the batch and taking one GRPO step (two minibatches) on it; and the most rows of logits any
    operation made (`LargestLogits`)."""
    from fastgrpo.trainers import build_trainer

    out = {}
    for c in (0, chunk):
        cfg = load_config(None, [f"model.path={policy}", f"run_dir={tmp}/run{c}", f"trainer.backend={backend}",
                                 "grpo.micro_batch_size=2", "grpo.minibatches=2", "optim.lr=1e-3", "threads=1",
                                 "rollout.temperature=0.7", f"trainer.logits_chunk_tokens={c}", *overrides])
        trainer = build_trainer(cfg)
        vocab = _vocab(policy)
        batch = _batch(vocab)
        widths = {vocab}
        if backend == "megatron":  # this rank's shard of the padded vocabulary, and the padded one (top-k)
            from megatron.core import parallel_state

            padded = trainer.layout.padded_vocab
            widths |= {padded // parallel_state.get_tensor_model_parallel_world_size(), padded}
        with LargestLogits(widths) as seen:
            if backend == "megatron":
                logprobs, entropy = trainer.logprobs_and_entropy(batch)
            else:
                logprobs, entropy = trainer.logprobs(batch), None
            metrics = trainer.train_step(batch)
        last = getattr(trainer, "last_stage", True)  # a pipeline's earlier stages make no logits
        out[c] = (logprobs, entropy, metrics, {n: t.detach().clone() for n, t in trainer.export_weights()},
                  seen.rows if last else None)
    return out


def _vocab(policy) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(policy).vocab_size


def _check_same_steps(results: list, policy: Path, chunk: int) -> None:
    from fastgrpo.models.policy import load_policy
    from tests.conftest import assert_same_update

    start = load_policy(policy).state_dict()
    for out in results:
        (lp0, ent0, m0, w0, rows0), (lp, ent, m, w, rows) = out[0], out[chunk]
        # the micro-batches' whole logits without chunks (2 rows x up to 16 positions); one chunk's with
        if rows0 is not None:
            assert rows0 >= 2 * 10 and rows == chunk, (rows0, rows)
        _close(lp, lp0, 1e-6)
        if ent0 is not None:
            _close(ent, ent0, 1e-6)
        assert m0["updates"] == m["updates"] == 2
        for key in ("loss", "grad_norm", "entropy", "clip_fraction", "kl_engine_trainer", "kl_ref"):
            if key in m0:
                # the gradient norm sums every parameter's squared gradient in fp32, in another order with
                # chunks: 1.2e-6 apart under DeepSpeed ZeRO-3 on one machine (its other figures within 1e-6)
                rel = 1e-5 if key == "grad_norm" else 1e-6
                assert m[key] == pytest.approx(m0[key], rel=rel, abs=1e-7), key
        assert w.keys() == w0.keys()
        assert_same_update(w, w0, start, names=_compared(n for n in w0 if n in start))


MEGATRON_LAYOUTS = {
    # sequence parallel (a mixture of experts at TP > 1): the output layer's input gathered over the TP ranks
    "moe-tp2-sequence-parallel": ("qwen3_moe-sparse", ["parallel.tensor=2"]),
    # TP2 without sequence parallelism: the input's gradient all-reduced; a tied head; a reference policy
    "dense-tp2-tied-reference": ("qwen2.5", ["parallel.tensor=2", "grpo.kl_coef=0.05"]),
    # the tied head's copy on the last stage; top-k / top-p (the chunk's logits gathered over the vocabulary)
    "dense-pp2-tied-top-k": ("qwen2.5", ["parallel.pipeline=2", "rollout.top_k=40", "rollout.top_p=0.95"]),
}


@pytest.mark.slow  # worlds of two (gloo)
@pytest.mark.parametrize("layout", list(MEGATRON_LAYOUTS))
def test_the_megatron_trainers_step_is_the_same_in_chunks(policies, tmp_path, layout):
    pytest.importorskip("megatron.core")
    from fastgrpo.local_world import run_world

    family, overrides = MEGATRON_LAYOUTS[layout]
    results = run_world(_steps, 2, tmp_path / "world", str(policies[family]), str(tmp_path), "megatron", overrides, 5,
                        timeout_s=600.0)
    _check_same_steps(results, policies[family], 5)


@pytest.mark.slow  # a world of two (gloo)
def test_the_deepspeed_zero3_step_is_the_same_in_chunks(policies, tmp_path):
    """ZeRO-3 partitions the head's weight: the chunked scoring runs inside the head's own module call,
    where ZeRO gathers it (and again before the backward)."""
    pytest.importorskip("deepspeed")
    from fastgrpo.local_world import run_world

    policy = policies["qwen3_moe"]
    results = run_world(_steps, 2, tmp_path / "world", str(policy), str(tmp_path), "deepspeed",
                        ["deepspeed.zero_stage=3", "rollout.top_k=40"], 5, timeout_s=600.0)
    _check_same_steps(results, policy, 5)


# -- the plan ------------------------------------------------------------------------------------------------
def _logits_row(capsys, *overrides: str) -> tuple[str, float, str]:
    from fastgrpo.cli import main

    assert main(["plan", "--config", "configs/qwen3_30b_a3b.yaml", *overrides]) == 0
    out = capsys.readouterr().out
    section = out.split("policy GPU, training")[1].split("\n\n")[0]
    (line,) = [line for line in section.splitlines() if line.strip().startswith("logits")]
    name, rest = line[2:40].strip(), line[40:].split(None, 1)
    return name, float(rest[0]), rest[1]


def test_the_plan_prices_one_chunk_instead_of_the_whole_sequence(capsys):
    """Qwen3-30B-A3B at TP1: a 151936-token vocabulary (a multiple of 128 already), hidden 2048, one
    18432-token sequence per micro-batch."""
    vocab, hidden, tokens, gib = 151936, 2048, 18432, 2**30
    name, figure, formula = _logits_row(capsys)  # the shipped config: the default chunk of 1024 tokens
    assert name == "logits (last stage, one chunk)" and "1024 tokens (trainer.logits_chunk_tokens)" in formula
    assert figure == pytest.approx((6.5 * 4 * 1024 * vocab + 4 * vocab * hidden) / gib, abs=0.006)  # 4.93
    name, figure, formula = _logits_row(capsys, "trainer.logits_chunk_tokens=4096")
    assert figure == pytest.approx((6.5 * 4 * 4096 * vocab + 4 * vocab * hidden) / gib, abs=0.006)  # 16.25
    for off in ("trainer.logits_chunk_tokens=0", f"trainer.logits_chunk_tokens={tokens}"):  # no chunk smaller
        name, figure, formula = _logits_row(capsys, off)
        assert name == "logits (last stage)" and f"{tokens} tokens (micro-batch)" in formula
        assert figure == pytest.approx(5.25 * 4 * tokens * vocab / gib, abs=0.006)  # 54.77
    name, figure, formula = _logits_row(capsys, "rollout.top_k=50")  # a sort and masks beside
    assert figure == pytest.approx((9.5 * 4 * 1024 * vocab + 4 * vocab * hidden) / gib, abs=0.006)  # 6.66
    assert "top-k/top-p" in formula
