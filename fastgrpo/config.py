"""The run configuration: typed sections, YAML loading, `key=value` overrides, validation, and the rules
of a run's layout (`layout_rules`) that validation, a launched rank and `fastgrpo plan` judge alike.

Everything is checked before any work starts, and every error names the offending key, so a typo
in a 70B launch fails in a second instead of after an hour of model loading.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fastgrpo.topology import EngineMap, Shape, WorldSize


class ConfigError(ValueError):
    """A bad configuration; the message names the key."""


# the values a word-valued key takes (OmegaConf refuses any other, naming the key)
ModelSize = Literal["test", "bench", "gpu"]  # `fastgrpo sft`'s recipes (models/policy.py SIZES)
SpeculationPolicyName = Literal["off", "static", "fastgrpo", "tlt", "aware", "aware_per_sequence"]  # speculation/registry.py
OnlineDraft = Literal["off", "sync", "async"]
DraftSource = Literal["learned", "index", "hybrid"]  # who proposes speculation's trees (docs/drafts.md)
# grpo/loss.py
LossAggregation = Literal["token_mean", "seq_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
RatioLevel = Literal["token", "sequence"]  # grpo.ratio_level: PPO's per-token ratio, or GSPO's per-sequence one
RolloutCorrection = Literal["none", "token_tis", "sequence_tis", "token_mask", "sequence_mask", "geometric_mask",
                            "icepop"]  # grpo/correction.py
KLEstimator = Literal["k1", "k2", "k3"]  # grpo/loss.py `kl_estimate`
Advantage = Literal["grpo", "rloo"]  # grpo/advantages.py
StdScope = Literal["group", "batch"]
EvalSplit = Literal["test", "validation"]
TrainerBackend = Literal["torch", "megatron", "deepspeed"]  # what `trainers.build_trainer` can build
RoutingReplay = Literal["off", "rollout"]  # trainer.routing_replay: a MoE trains on its own routing or the engine's
LayerSpec = Literal["auto", "local", "transformer_engine"]  # megatron layer specs `trainers/megatron/model.py` builds
Precision = Literal["auto", "bf16", "fp32"]
PromptFormat = Literal["auto", "chat", "plain"]
EngineBackend = Literal["embedded", "sglang"]  # what `engines.build_engine` can build
StepMode = Literal["auto", "static", "eager"]  # the embedded engine's decode steps (engine.steps)
Device = Literal["auto", "cpu", "cuda"]
BUILTIN_REWARDS = ("math",)  # task.reward's built-ins (tasks/rewards.py `load_reward`); else module:function
_IMPORT_PATH = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*")


def _check(ok: bool, key: str, rule: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key} {rule}, got {value!r}")


@dataclass
class ModelConfig:
    path: str = "artifacts/policy-bench"  # Hugging Face directory of the policy (and its tokenizer)
    size: ModelSize = "bench"  # recipe used by `fastgrpo sft` when building the policy: "test", "bench" or "gpu" (~300M)
    max_context: int = 512  # prompt + response tokens
    # a Hugging Face config.json of the policy's shape, for `fastgrpo plan` where model.path is not on this
    # machine (a login node planning a cluster run); empty: <model.path>/config.json
    architecture: str = ""

    def check(self) -> None:
        _check(self.max_context >= 8, "model.max_context", "must be >= 8", self.max_context)


@dataclass
class TaskConfig:
    # "arithmetic" (synthetic) or a path: a .jsonl / .json / .parquet / .arrow file, or a directory saved by
    # Hugging Face datasets' save_to_disk (fastgrpo/tasks/datasets.py)
    source: str = "arithmetic"
    eval_source: str = ""  # eval file for file sources; empty = hold out eval_size rows of `source`
    # file sources: where a row's prompt (a string, or chat messages [{role, content}]) and gold answer are,
    # as dotted paths into nested fields (e.g. reward_model.ground_truth, veRL's); empty = guessed from the
    # rows (prompt / question / problem; answer / ground_truth / reward_model.ground_truth / solution)
    prompt_key: str = ""
    answer_key: str = ""
    seed: int = 0  # the data's seed (problems, splits), apart from the run's: runs of several seeds share data
    train_size: int = 20000
    eval_size: int = 200  # the test split, what results are reported on
    validation_size: int = 500  # held out from training to tune settings on (eval.split=validation)
    min_steps: int = 1
    max_steps: int = 24
    tail: float = 0.75  # P(k steps) ~ tail**(k-1): a long tail of long answers
    max_value: int = 20  # every intermediate value stays in 0..max_value
    max_operand: int = 9
    # the reward (fastgrpo/tasks/rewards.py): "math" = the boxed answer by math-verify (1 or 0, with step_credit
    # below in training), or "module:function" (importable, e.g. from PYTHONPATH), called as function(response
    # text, problem: fastgrpo.tasks.problems.Problem) -> float in rollout and eval
    reward: str = "math"
    reward_timeout_s: float = 2.0  # per answer: math-verify's own limit; a module:function past it is an error
    # training reward of a wrong answer: this x the share of the worked solution's lines reproduced before
    # the first mistake (a correct answer scores 1); 0 = the answer alone. Eval always scores the answer.
    step_credit: float = 0.0
    # the SFT corpus's slipping teacher: this share of the training set's worked solutions states the final
    # answer outside \boxed{} (fastgrpo/tasks/arithmetic.py `slip`); 0 = exact solutions
    slip_rate: float = 0.0
    # how a problem becomes the prompt (fastgrpo.models.tokenizer.TextFormat): chat = the tokenizer's chat
    # template (the user turn: the problem and the instruction to put the answer in \boxed{}); plain = BOS
    # (if the tokenizer has one), the problem, a newline; auto = chat when the tokenizer has a chat template
    prompt_format: PromptFormat = "auto"
    system_prompt: str = ""  # chat: a system turn before the user's (empty: none, the template's default)

    def check(self) -> None:
        for key in ("train_size", "eval_size", "validation_size"):
            _check(getattr(self, key) >= 1, f"task.{key}", "must be >= 1", getattr(self, key))
        _check(1 <= self.min_steps <= self.max_steps, "task.min_steps", "must be in 1..task.max_steps", self.min_steps)
        _check(0 < self.tail <= 1, "task.tail", "must be in (0, 1]", self.tail)
        _check(self.max_value >= 2, "task.max_value", "must be >= 2", self.max_value)
        _check(self.max_operand >= 2, "task.max_operand", "must be >= 2", self.max_operand)
        _check(self.reward in BUILTIN_REWARDS or _IMPORT_PATH.fullmatch(self.reward) is not None, "task.reward",
               f"must be a built-in reward ({', '.join(BUILTIN_REWARDS)}) or module:function", self.reward)
        _check(self.reward_timeout_s > 0, "task.reward_timeout_s", "must be > 0", self.reward_timeout_s)
        _check(0 <= self.slip_rate < 1, "task.slip_rate", "must be in [0, 1)", self.slip_rate)
        _check(0 <= self.step_credit < 1, "task.step_credit", "must be in [0, 1) (a correct answer scores 1)",
               self.step_credit)
        _check(self.step_credit == 0 or self.reward == "math", "task.step_credit",
               f"applies to task.reward=math only (task.reward={self.reward})", self.step_credit)
        for key in ("prompt_key", "answer_key"):
            value = getattr(self, key)
            _check(not value or all(part.strip() for part in value.split(".")), f"task.{key}",
                   "must be a field name or a dotted path to a nested one (e.g. reward_model.ground_truth)", value)
            _check(not value or self.source != "arithmetic", f"task.{key}",
                   "applies to file sources only (task.source=arithmetic)", value)


@dataclass
class RolloutConfig:
    prompts_per_step: int = 8
    group_size: int = 8  # G samples per prompt
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_batch: int = 64  # engine slots (concurrent sequences)
    # DAPO's dynamic sampling (arXiv 2503.14476): while fewer than prompts_per_step groups carry a signal
    # (rewards not all equal), roll out up to this many more batches of prompts_per_step prompts; the step
    # trains on the first prompts_per_step informative groups. 0 = off: the step trains on what it has
    refill_rounds: int = 0

    def check(self) -> None:
        _check(self.prompts_per_step >= 1, "rollout.prompts_per_step", "must be >= 1", self.prompts_per_step)
        _check(self.refill_rounds >= 0, "rollout.refill_rounds", "must be >= 0 (0: off)", self.refill_rounds)
        _check(self.group_size >= 2, "rollout.group_size", "must be >= 2 (advantages compare samples)", self.group_size)
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1", self.max_new_tokens)
        _check(math.isfinite(self.temperature) and self.temperature >= 0, "rollout.temperature", "must be >= 0",
               self.temperature)
        _check(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k >= 0, "rollout.top_k", "must be >= 0", self.top_k)
        _check(self.max_batch >= 1, "rollout.max_batch", "must be >= 1", self.max_batch)


@dataclass
class SpeculationConfig:
    policy: SpeculationPolicyName = "off"
    depth: int = 4  # static: draft levels
    topk: int = 4  # static: children per expanded node
    num_verify: int = 12  # static: tokens verified per sequence (root included)
    cost_model_dir: str = "artifacts/cost_models"  # cached calibration sweeps, one per machine and model shape
    # who proposes a tree (docs/drafts.md): the learned draft; the suffix index of what each prompt's
    # responses wrote (earlier steps' and the live group's); or both merged into one tree of the same budget
    drafts: DraftSource = "learned"
    index_window: int = 8  # the index matches at most this many of a sequence's last tokens
    index_depth: int = 8  # its deepest proposed continuation
    index_responses: int = 16  # finished responses it keeps per prompt (the latest)
    # tokens it holds over all prompts, least recently used prompts dropped past it: up to 1.0 KiB of host
    # memory a token at window + depth = 16 (text that never repeats; 4.1 KiB without the C trie), 0.2 GB at 200k
    index_max_tokens: int = 200_000
    index_prior: float = 1.0  # a continuation seen c of n times after m matched tokens: probability c/(n + prior/m)

    def check(self) -> None:
        for key in ("index_window", "index_depth", "index_responses", "index_max_tokens"):
            _check(getattr(self, key) >= 1, f"speculation.{key}", "must be >= 1", getattr(self, key))
        _check(self.index_prior >= 0, "speculation.index_prior", "must be >= 0", self.index_prior)
        _check(self.depth >= 1, "speculation.depth", "must be >= 1", self.depth)
        _check(self.topk >= 1, "speculation.topk", "must be >= 1", self.topk)
        _check(2 <= self.num_verify <= 1 + self.topk + (self.depth - 1) * self.topk**2, "speculation.num_verify",
               "must be in 2..1 + topk + (depth - 1) * topk^2 (the tree's size)", self.num_verify)


@dataclass
class DraftConfig:
    path: str = ""  # directory of draft.safetensors; empty: model.path
    lr: float = 1e-3  # the offline warm start (`fastgrpo draft-pretrain`)
    batch_size: int = 16
    pretrain_steps: int = 2000
    pretrain_minutes: float = 0.0  # a guard, not a budget: stop (with a loud warning) after this long; 0 = none
    # training-time test: the draft is trained fed its own predictions for this many steps, as a tree's
    # deeper levels feed it (models/draft.py draft_loss); 1 = teacher-forced on the target's states (EAGLE-1)
    unroll: int = 1
    buffer_tokens: int = 200_000  # states held for the offline warm start
    online: OnlineDraft = "off"  # sync or async: the draft keeps learning from rollout's own target states
    online_buffer_tokens: int = 50_000  # online buffer cap; the oldest states are dropped
    online_lr: float = 1e-4  # online steps fine-tune a warm start: at the warm start's 1e-3 a fresh Adam undoes it
    sync_budget: float = 0.05  # sync: draft training seconds per step, as a fraction of rollout + train time
    sync_max_steps: int = 64  # sync: at most this many draft steps per GRPO step (async: per published version)
    async_publish_s: float = 5.0  # async: the draft rank publishes a version at least this often while it trains

    def check(self) -> None:
        for key in ("lr", "online_lr", "sync_budget", "async_publish_s"):
            _check(getattr(self, key) > 0, f"draft.{key}", "must be > 0", getattr(self, key))
        for key in ("batch_size", "buffer_tokens", "online_buffer_tokens", "sync_max_steps"):
            _check(getattr(self, key) >= 1, f"draft.{key}", "must be >= 1", getattr(self, key))
        _check(self.pretrain_steps >= 0, "draft.pretrain_steps", "must be >= 0", self.pretrain_steps)
        _check(1 <= self.unroll <= 8, "draft.unroll", "must be in 1..8", self.unroll)
        _check(self.pretrain_minutes >= 0, "draft.pretrain_minutes", "must be >= 0 (0: no guard)", self.pretrain_minutes)


@dataclass
class GRPOConfig:
    """The GRPO objective (docs/objective.md has every option's formula and paper)."""

    steps: int = 20
    eps_low: float = 0.2
    eps_high: float = 0.28  # clip-higher: eps_high > eps_low lets rare good tokens grow
    # the advantage's baseline: grpo = the group's mean reward; rloo = the mean of the group's other G - 1
    # rewards (RLOO, Ahmadian et al. arXiv 2402.14740), which is G / (G - 1) x grpo's centred reward
    advantage: Advantage = "grpo"
    scale_by_std: bool = True  # A = (r - baseline) / (std + eps); False: A = r - baseline (Dr. GRPO)
    # whose std scale_by_std divides by: each group's own, or every reward the step sampled (batch: TRL's
    # scale_rewards="batch"), which does not up-weight groups that are nearly all right or all wrong
    std_scope: StdScope = "group"
    # token_mean: sum over the minibatch's tokens / their count; seq_mean: each sequence's token mean, averaged
    # over sequences; seq_mean_token_sum: each sequence's token sum, averaged over sequences;
    # seq_mean_token_sum_norm: that over loss_norm_tokens, Dr. GRPO's constant (arXiv 2503.20783)
    loss_aggregation: LossAggregation = "token_mean"
    loss_norm_tokens: int = 0  # seq_mean_token_sum_norm's constant normaliser; 0 = rollout.max_new_tokens
    # the importance ratio the clip acts on: token = pi/pi_old per token (PPO); sequence = GSPO's
    # (pi(y|x)/pi_old(y|x))^(1/|y|) per sequence (arXiv 2507.18071: with loss_aggregation=seq_mean, its
    # objective; the paper clips it at eps ~ 3e-4..4e-4)
    ratio_level: RatioLevel = "token"
    # dual-clip PPO (arXiv 1912.09729): a negative-advantage token's loss is at most dual_clip x |A|, however
    # large its ratio; 0 = off, else c > 1 (veRL's clip_ratio_c, 3.0)
    dual_clip: float = 0.0
    # log-ratios (policy/old, and reference/policy in the KL term) clamped to +-this before exp; 0 = off
    log_ratio_clamp: float = 20.0
    kl_coef: float = 0.0  # KL to the initial policy; 0 skips the reference forward
    # the per-token KL estimate (Schulman, "Approximating KL divergence"): k1 = log(pi/pi_ref),
    # k2 = (log(pi/pi_ref))^2 / 2, k3 = pi_ref/pi - log(pi_ref/pi) - 1 (unbiased, non-negative)
    kl_estimator: KLEstimator = "k3"
    drop_equal_reward_groups: bool = True  # groups whose rewards are all equal carry no signal
    epochs: int = 1  # optimisation passes over one rollout batch
    minibatches: int = 1  # optimiser steps per epoch
    micro_batch_size: int = 16  # sequences per forward/backward (memory, not maths)
    # what corrects the engine/trainer mismatch, by rho = pi_trainer_old / pi_engine of each sampled token
    # (grpo/correction.py): none; token_tis: weight min(rho_t, tis_cap); sequence_tis: min(prod_t rho_t,
    # tis_cap) on the whole sequence; token_mask: tokens with rho_t outside [mask_low, mask_high] train
    # nothing; sequence_mask: sequences whose prod_t rho_t is outside it; geometric_mask: sequences whose
    # geometric mean (prod_t rho_t)^(1/|y|) is outside it; icepop: weight rho_t inside the band, 0 outside
    rollout_correction: RolloutCorrection = "token_tis"
    tis_cap: float = 2.0  # token_tis and sequence_tis: the largest weight (>= 1)
    # the masks' band [mask_low, mask_high] of rho; 0 = the mode's default: token_mask and sequence_mask
    # [0.5, 2], geometric_mask [0.999, 1.001], icepop [0.5, 5] (its paper's)
    mask_low: float = 0.0
    mask_high: float = 0.0

    def check(self) -> None:
        _check(self.steps >= 0, "grpo.steps", "must be >= 0", self.steps)
        _check(0 <= self.eps_low < 1, "grpo.eps_low", "must be in [0, 1)", self.eps_low)
        _check(self.eps_high >= 0, "grpo.eps_high", "must be >= 0", self.eps_high)
        _check(self.kl_coef >= 0, "grpo.kl_coef", "must be >= 0", self.kl_coef)
        for key in ("epochs", "minibatches", "micro_batch_size"):
            _check(getattr(self, key) >= 1, f"grpo.{key}", "must be >= 1", getattr(self, key))
        _check(self.dual_clip == 0 or self.dual_clip > 1, "grpo.dual_clip", "must be 0 (off) or > 1", self.dual_clip)
        _check(self.log_ratio_clamp >= 0, "grpo.log_ratio_clamp", "must be >= 0 (0: off)", self.log_ratio_clamp)
        _check(self.loss_norm_tokens >= 0, "grpo.loss_norm_tokens", "must be >= 0 (0: rollout.max_new_tokens)",
               self.loss_norm_tokens)
        _check(self.tis_cap >= 1 or self.rollout_correction not in ("token_tis", "sequence_tis"), "grpo.tis_cap",
               f"must be >= 1 with grpo.rollout_correction={self.rollout_correction} (grpo.rollout_correction=none "
               f"turns the correction off)", self.tis_cap)
        for key in ("mask_low", "mask_high"):
            _check(getattr(self, key) >= 0, f"grpo.{key}", "must be >= 0 (0: the mode's default)", getattr(self, key))
        low, high = self.mask_band()
        _check(low <= 1 <= high, "grpo.mask_low", f"and grpo.mask_high must hold 1 between them (the band "
               f"[{low:g}, {high:g}] of grpo.rollout_correction={self.rollout_correction})", self.mask_low)

    def mask_band(self) -> tuple[float, float]:
        """The band [low, high] of the engine/trainer ratio that a masking correction keeps: mask_low and
        mask_high, each 0 meaning the mode's default (`MASK_BANDS`)."""
        low, high = MASK_BANDS.get(self.rollout_correction, (0.5, 2.0))
        return self.mask_low or low, self.mask_high or high

    def for_rollout(self, max_new_tokens: int) -> GRPOConfig:
        """This section with loss_norm_tokens resolved: 0 means the rollout's token budget, the longest a
        response can be (Dr. GRPO's constant normaliser is the generation budget)."""
        return self if self.loss_norm_tokens else dataclasses.replace(self, loss_norm_tokens=max_new_tokens)


# grpo.rollout_correction's default bands of the engine/trainer ratio: veRL's rejection-sampling examples
# (0.5..2, and 0.999..1.001 for the geometric mean, its "Geo-RS"), and IcePop's [alpha, beta] = [0.5, 5]
MASK_BANDS = {"token_mask": (0.5, 2.0), "sequence_mask": (0.5, 2.0), "geometric_mask": (0.999, 1.001),
              "icepop": (0.5, 5.0)}


@dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0  # 0 = off
    warmup_steps: int = 0
    # a regular expression over parameter names: only those train (RL moves few directions, and every
    # trained parameter also takes the update's noise); empty = all
    trainable: str = ""

    def check(self) -> None:
        _check(self.lr > 0, "optim.lr", "must be > 0", self.lr)
        for key in ("weight_decay", "grad_clip", "warmup_steps"):
            _check(getattr(self, key) >= 0, f"optim.{key}", "must be >= 0", getattr(self, key))
        _check(all(0 <= b < 1 for b in self.betas), "optim.betas", "must be in [0, 1)", self.betas)
        try:
            re.compile(self.trainable)
        except re.error as e:
            raise ConfigError(f"optim.trainable is not a regular expression ({e}), got {self.trainable!r}") from None


@dataclass
class SFTConfig:
    # a Hugging Face checkpoint directory to start from: its weights, tokenizer, chat template and stop ids
    # (a real family's, e.g. Qwen2.5); empty: a new `model.size` Llama policy with a tokenizer trained on the task
    init: str = ""
    examples: int = 60000
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 100
    max_minutes: float = 0.0  # a guard, not a budget: stop (with a loud warning) after this long; 0 = none
    max_problem_steps: int = 8  # SFT on problems of at most this many steps: more, shorter examples per minute
    log_every: int = 50

    def check(self) -> None:
        for key in ("examples", "batch_size", "max_problem_steps"):
            _check(getattr(self, key) >= 1, f"sft.{key}", "must be >= 1", getattr(self, key))
        _check(self.lr > 0, "sft.lr", "must be > 0", self.lr)
        _check(self.max_minutes >= 0, "sft.max_minutes", "must be >= 0 (0: no guard)", self.max_minutes)


@dataclass
class TrackingConfig:
    enabled: bool = True
    uri: str = ""  # empty: sqlite:///<run_dir>/mlflow.db
    experiment: str = "fastgrpo"
    run_name: str = ""

    def check(self) -> None:
        pass  # nothing beyond the types


@dataclass
class CheckpointConfig:
    every: int = 10  # steps; a checkpoint is also written at the end
    keep_last: int = 2

    def check(self) -> None:
        _check(self.every >= 1, "checkpoint.every", "must be >= 1", self.every)
        _check(self.keep_last >= 1, "checkpoint.keep_last", "must be >= 1", self.keep_last)


@dataclass
class EvalConfig:
    samples: int = 4  # G samples per eval prompt for mean accuracy and pass@G
    every: int = 0  # steps between evals during training; 0 = only before and after
    at_start: bool = True  # evaluate the starting policy (step 0) before training
    split: EvalSplit = "test"  # or "validation", to tune settings without touching the test split

    def check(self) -> None:
        _check(self.samples >= 1, "eval.samples", "must be >= 1", self.samples)
        _check(self.every >= 0, "eval.every", "must be >= 0", self.every)


@dataclass
class TrainerConfig:
    backend: TrainerBackend = "torch"  # the policy trainer: torch (one process, a Hugging Face model)
    # megatron's layer spec: auto (Transformer Engine when importable, else local), local, transformer_engine
    layer_spec: LayerSpec = "auto"
    # megatron: full activation recompute, one layer at a time (only each layer's input is kept for the
    # backward): the same gradients for one more forward; what sequences of thousands of tokens need
    recompute: bool = False
    # auto (bf16 on CUDA, fp32 on a CPU), bf16 (bf16 weights and activations, fp32 master weights and fp32
    # gradient reduction, as megatron-core and DeepSpeed do them) or fp32
    precision: Precision = "auto"
    # megatron: the optimizer state (fp32 master weights and Adam's moments) sharded over the data-
    # parallel ranks (megatron-core's DistributedOptimizer)
    distributed_optimizer: bool = False
    # megatron: the optimizer's fp32 main weights and Adam moments (this rank's shard of them) held in host
    # memory and stepped there by torch's AdamW, megatron-core's optimizer CPU offload (what slime runs
    # Qwen3-30B-A3B on 8 H100s with); the GPU keeps the bf16 weights and the fp32 gradient buffer. It needs
    # trainer.distributed_optimizer, bf16 and, at run time, CUDA and Transformer Engine (`check`,
    # `MegatronPolicyTrainer`); `fastgrpo plan` prices it in host memory. DeepSpeed's: deepspeed.offload_optimizer
    optimizer_offload: bool = False
    # a mixture-of-experts policy: the router's load-balancing (auxiliary) loss and z-loss coefficients,
    # added to the GRPO loss. 0 (the default) leaves the pretrained routing to the policy gradient alone, as RL
    # recipes on Qwen3-MoE do (slime's scripts/models/qwen3-30B-A3B.sh: --moe-aux-loss-coeff 0; veRL's Megatron
    # converter sets moe_router_load_balancing_type "none"). The loss is each trainer's own: megatron-core's
    # switch loss per layer (1 per layer when routing is balanced) under trainer.backend=megatron, Hugging
    # Face's load_balancing_loss_func over all layers (top_k when balanced) under torch and deepspeed, so one
    # coefficient weighs them differently. router_z_loss is megatron-core's (Hugging Face has none)
    router_aux_loss: float = 0.0
    router_z_loss: float = 0.0
    # a mixture-of-experts policy: `rollout` trains on the experts the engine routed each token to
    # (models/routing.py; R3, arXiv 2510.11370: GRPO on Qwen3-30B-A3B without it collapsed), the gate
    # weights still the trainer's router's; `off` routes by the trainer's own router. Either way a step
    # whose batch carries the engine's routing reports routing_mismatch
    routing_replay: RoutingReplay = "off"
    # every trainer: the last stage's logits, log-softmax and gradient computed for at most this many tokens
    # at once (trainers/chunked_logprobs.py: each chunk's logits recomputed in the backward, one more LM-head
    # matmul); 0: a micro-batch's whole logits at once. 1024 tokens hold 0.58 GiB of fp32 logits at a 152K
    # vocabulary (an 18K-token sequence's whole: 10.4 GiB per copy), and a 1024 x hidden x vocab matmul is
    # still large enough to run at full speed; a micro-batch of no more tokens is scored as it was before
    logits_chunk_tokens: int = 1024

    def check(self) -> None:
        _check(self.router_aux_loss >= 0, "trainer.router_aux_loss", "must be >= 0", self.router_aux_loss)
        _check(self.logits_chunk_tokens >= 0, "trainer.logits_chunk_tokens", "must be >= 0 (0: no chunking)",
               self.logits_chunk_tokens)
        _check(self.router_z_loss >= 0, "trainer.router_z_loss", "must be >= 0", self.router_z_loss)
        _check(not self.recompute or self.backend == "megatron", "trainer.recompute",
               "is megatron's activation recompute: trainer.backend=megatron only", self.recompute)
        _check(not self.distributed_optimizer or self.backend == "megatron", "trainer.distributed_optimizer",
               "is megatron's DistributedOptimizer: trainer.backend=megatron only (ZeRO shards DeepSpeed's)",
               self.distributed_optimizer)
        # megatron-core 0.16.1's offload (megatron/core/optimizer/: optimizer_config.py, __init__.py,
        # distrib_optimizer.py, cpu_offloading/hybrid_optimizer.py), whose rules `MegatronPolicyTrainer` cites
        _check(not self.optimizer_offload or self.backend == "megatron", "trainer.optimizer_offload",
               f"is megatron-core's optimizer CPU offload: trainer.backend=megatron only (trainer.backend="
               f"{self.backend}; DeepSpeed's ZeRO offload is deepspeed.offload_optimizer=true)", self.optimizer_offload)
        _check(not self.optimizer_offload or self.distributed_optimizer, "trainer.optimizer_offload",
               "needs trainer.distributed_optimizer=true: megatron-core offloads the distributed optimizer's shards "
               "(only it rebuilds the offloading optimizer around its fp32 main-weight shards, and the precision-"
               "aware optimizer that keeps those off the GPU asserts it)", self.optimizer_offload)
        _check(not self.optimizer_offload or self.precision != "fp32", "trainer.optimizer_offload",
               "offloads bf16 training's optimizer: trainer.precision=bf16 (or auto, bf16 on CUDA); in fp32 "
               "megatron-core 0.16.1 hands its offloading optimizer views of the weights, which torch's optimizer "
               "refuses (\"can't optimize a non-leaf Tensor\")", self.optimizer_offload)


@dataclass
class DeepSpeedConfig:
    """trainer.backend=deepspeed: ZeRO data parallelism of the Hugging Face policy itself."""

    zero_stage: int = 2  # 1: optimizer states sharded; 2: and gradients; 3: and parameters
    offload_optimizer: bool = False  # keep the optimizer states (and their update) in CPU memory

    def check(self) -> None:
        _check(self.zero_stage in (1, 2, 3), "deepspeed.zero_stage", "must be 1, 2 or 3", self.zero_stage)


@dataclass
class EngineConfig:
    backend: EngineBackend = "embedded"  # the rollout engine: embedded (fastgrpo's own, CPU) or sglang (GPU nodes)
    # sglang: the share of each GPU's memory the engine holds for its weights and KV cache (SGLang's
    # mem_fraction_static); colocated with training, it is released while the policy trains
    mem_fraction: float = 0.5
    # GPUs per engine (SGLang's tp_size; the embedded engine runs on one rank: 1). Engines tile every
    # policy rank whatever the trainer's layout: policy ranks / tensor of them, none spanning a node
    tensor: int = 1
    # the embedded engine's decode steps: static (shapes fixed by batch and context buckets, captured as
    # CUDA graphs on a GPU), eager (shapes from the data), or auto (static on CUDA, eager on a CPU, where
    # an eager step is not launch-bound and pads nothing)
    steps: StepMode = "auto"
    # the embedded engine's static steps run the policy's and the draft's pointwise regions (RMSNorm, the
    # residual add, the q/k rotation, SwiGLU's gate) and the sampling noise as kernels torch.compile fuses:
    # fewer kernels a graph-captured step on a GPU (12 a layer instead of 28), a compile on first use. Off
    # until a GPU check measures it (tools/gpu_check.sh's decode_8b stage runs both)
    fused: bool = False

    def check(self) -> None:
        _check(self.tensor >= 1, "engine.tensor", "must be >= 1", self.tensor)
        _check(not (self.fused and self.backend != "embedded"), "engine.fused", "is the embedded engine's "
               "(SGLang fuses its own kernels)", self.fused)
        _check(not (self.fused and self.steps == "eager"), "engine.fused", "needs static steps (engine.steps "
               "static, or auto on a GPU)", self.fused)
        _check(0 < self.mem_fraction < 1, "engine.mem_fraction", "must be in (0, 1)", self.mem_fraction)


@dataclass
class ParallelConfig:
    """The policy's layout over the world; data parallelism is what remains of it."""

    tensor: int = 1
    pipeline: int = 1
    # expert parallelism (a mixture-of-experts policy, trainer.backend=megatron): each expert lives on one
    # of `expert` ranks, which split the data-parallel ranks of a pipeline stage (megatron-core's EP)
    expert: int = 1
    # the experts' own tensor-parallel size (megatron-core's expert_tensor_parallel_size): 0, the same as
    # `tensor` (each expert split over the TP ranks as the dense MLP is), or 1 (each expert whole on one
    # rank, as slime runs Qwen3-30B-A3B: no TP collective inside an expert's matmuls, and the expert-parallel
    # ranks then span the TP ranks too; megatron-core lays the experts out on a grid of their own, expert
    # tensor x expert x expert-data x pipeline = the policy's ranks). Any other value: refused
    expert_tensor: int = 0
    # the world's last ranks, reserved to train the draft (draft.online=async); 0: no slice
    draft_ranks: int = 0

    def check(self) -> None:
        _check(self.tensor >= 1, "parallel.tensor", "must be >= 1", self.tensor)
        _check(self.pipeline >= 1, "parallel.pipeline", "must be >= 1", self.pipeline)
        _check(self.expert >= 1, "parallel.expert", "must be >= 1", self.expert)
        _check(self.expert_tensor in (0, 1, self.tensor), "parallel.expert_tensor",
               f"must be 0 (the same as parallel.tensor), 1 (each expert whole on one rank) or parallel.tensor="
               f"{self.tensor}", self.expert_tensor)
        _check(self.draft_ranks >= 0, "parallel.draft_ranks", "must be >= 0", self.draft_ranks)


@dataclass
class ClusterConfig:
    """The machines a run is planned for (`fastgrpo plan`); at run time torchrun and Slurm decide the world."""

    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0

    def check(self) -> None:
        _check(self.nodes >= 1, "cluster.nodes", "must be >= 1", self.nodes)
        _check(self.gpus_per_node >= 1, "cluster.gpus_per_node", "must be >= 1", self.gpus_per_node)
        _check(self.gpu_memory_gb > 0, "cluster.gpu_memory_gb", "must be > 0", self.gpu_memory_gb)


@dataclass
class Config:
    run_dir: str = "runs/default"
    seed: int = 0
    threads: int = 0  # torch intra-op threads; 0 = all cores
    device: Device = "auto"  # auto (CUDA when present), cpu or cuda: where engine, trainer and draft learner compute
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


LAYER_SPECS = get_args(LayerSpec)

# keys whose documented values include the word `off`, which YAML 1.1 (and so OmegaConf) reads as false
def _off_keys() -> list[tuple[str, str]]:
    """(section, key) of every option whose values include the word `off` (a Literal of the schema)."""
    out = []
    for section, section_type in get_type_hints(Config).items():
        if dataclasses.is_dataclass(section_type):
            for key, t in get_type_hints(section_type).items():
                if get_origin(t) is Literal and "off" in get_args(t):
                    out.append((section, key))
    return out


def _off_as_word(node: Any) -> Any:
    """`policy: off` means the mode named off, not a boolean (YAML reads a bare off as false): give
    every key whose options include the word off its word back."""
    for section, key in _off_keys():
        if OmegaConf.select(node, f"{section}.{key}") is False:
            node[section][key] = "off"
    return node


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Schema defaults <- YAML file <- `key=value` overrides, then validation."""
    return _built(lambda: OmegaConf.structured(Config), path, overrides)


def with_overrides(config: Config, overrides: list[str]) -> Config:
    """`config` with `key=value` overrides, checked and validated as `load_config` checks a file's."""
    return _built(lambda: OmegaConf.structured(config), None, overrides)


def _built(base, path: str | Path | None, overrides: list[str] | None) -> Config:
    try:
        cfg = base()
        if path is not None:
            path = Path(path)
            if not path.is_file():
                raise ConfigError(f"config file not found: {path}")
            cfg = OmegaConf.merge(cfg, _off_as_word(OmegaConf.load(path)))
        if overrides:
            for item in overrides:
                if "=" not in item:
                    raise ConfigError(f"override {item!r} is not of the form key=value")
            cfg = OmegaConf.merge(cfg, _off_as_word(OmegaConf.from_dotlist(list(overrides))))
        config: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        msg = str(e.msg).splitlines()[0]
        raise ConfigError(f"config key {key!r}: {msg}" if key else msg) from None
    validate(config)
    # Dr. GRPO's constant resolved once, here, so every trainer built from this config (the run's, a
    # bench's, the GPU check's) gets the same one: 0 means the rollout's token budget
    config.grpo = config.grpo.for_rollout(config.rollout.max_new_tokens)
    return config


MODEL_PARALLEL_TRAINERS = ("megatron",)  # trainers that split the policy over ranks (parallel.tensor/pipeline/expert)
DISTRIBUTED_TRAINERS = ("megatron", "deepspeed")  # trainers of a torchrun world (data parallel, draft slice)


def expert_tensor_size(par: ParallelConfig) -> int:
    """The experts' tensor-parallel size a run uses: `parallel.expert_tensor`, 0 meaning `parallel.tensor`."""
    return par.expert_tensor or par.tensor


@dataclass(frozen=True)
class Rule:
    """One rule as it applies to this run: `text` says what must hold, `key` is the config key to change
    when it does not."""

    ok: bool
    key: str
    text: str


def layout_rules(c: Config, world: WorldSize | None = None, shape: Shape | None = None) -> list[Rule]:
    """The rules of a run's layout, written once: the config against itself, against the world it runs on
    (`world`) and against the model's shape (`shape`), each judged only when given. Three callers judge
    them with what they know: `load_config` the config alone, a launched rank the world torchrun started
    too (`run_setup.check_layout`, before any process group exists), and `fastgrpo plan` the planned
    cluster and the model's config as well, where it prints every rule, kept or broken. A rule that does
    not apply (the expert-parallel ones at `parallel.expert=1`) is not listed: the plan shows what this
    run must keep and no more."""
    rules: list[Rule] = []

    def rule(ok: bool, key: str, text: str) -> None:
        rules.append(Rule(bool(ok), key, text))

    trainer, draft, par, engine = c.trainer.backend, c.draft.online, c.parallel, c.engine
    t, p, ep, d_ranks, et = par.tensor, par.pipeline, par.expert, par.draft_ranks, engine.tensor
    etp = expert_tensor_size(par)

    # the config alone
    for key in ("tensor", "pipeline", "expert"):
        if getattr(par, key) > 1:
            rule(trainer in MODEL_PARALLEL_TRAINERS, f"parallel.{key}",
                 f"parallel.{key}={getattr(par, key)} needs trainer.backend=megatron, which splits the policy over "
                 f"ranks (trainer.backend={trainer})")
    if par.expert_tensor:  # set at all: an option of megatron-core's expert layout, meaningless elsewhere
        rule(trainer in MODEL_PARALLEL_TRAINERS, "parallel.expert_tensor",
             f"parallel.expert_tensor={par.expert_tensor} sets megatron-core's expert tensor parallelism: "
             f"trainer.backend=megatron (trainer.backend={trainer}); leave it 0")
    if trainer in DISTRIBUTED_TRAINERS and draft == "async":
        rule(d_ranks >= 1, "draft.online", f"draft.online=async with trainer.backend={trainer} trains the draft on "
                                           f"a reserved draft slice: parallel.draft_ranks >= 1 (one more rank launched)")
    if d_ranks:
        rule(trainer in DISTRIBUTED_TRAINERS, "parallel.draft_ranks",
             f"parallel.draft_ranks={d_ranks} reserves ranks of a torchrun world: trainer.backend=megatron or deepspeed")
        rule(draft == "async", "parallel.draft_ranks",
             f"parallel.draft_ranks={d_ranks} trains the draft there: draft.online=async")
    if et > 1:
        rule(engine.backend != "embedded", "engine.tensor",
             f"engine.tensor={et} needs engine.backend=sglang (the embedded engine runs on one rank)")
    if engine.backend == "sglang":
        rule(c.cluster.gpus_per_node % et == 0, "engine.tensor",
             f"engine.tensor={et} divides cluster.gpus_per_node={c.cluster.gpus_per_node} (an engine never spans "
             f"a node)")

    if world is not None:
        if trainer == "torch":
            rule(world.ranks == 1, "trainer.backend",
                 f"trainer.backend=torch trains in one process: a world of 1 rank (not {world.ranks}); "
                 f"trainer.backend=megatron or deepspeed spans more")
        policy = world.ranks - d_ranks
        divides = policy >= t * p and policy % (t * p) == 0
        dp = policy // (t * p) if divides else 0
        rule(divides, "parallel.tensor",
             f"{world.ranks} ranks = tensor {t} x pipeline {p} x data {dp or '?'} + {d_ranks} draft rank(s)")
        if divides:
            if ep > 1 and etp == t:
                rule(dp % ep == 0, "parallel.expert",
                     f"parallel.expert={ep} divides the {dp} data-parallel ranks (an expert-parallel group spans "
                     f"data ranks of one tensor rank and stage)")
            elif etp != t:  # megatron-core's expert grid: expert tensor x expert x expert-data x pipeline
                rule((t * dp) % (etp * ep) == 0, "parallel.expert",
                     f"parallel.expert={ep} x parallel.expert_tensor={etp} divides the {t * dp} ranks of a stage "
                     f"(tensor {t} x data {dp}: megatron-core's expert grid, expert tensor x expert x expert-data, "
                     f"spans the tensor and data ranks of a stage)")
            rule(c.rollout.prompts_per_step >= dp, "rollout.prompts_per_step",
                 f"rollout.prompts_per_step={c.rollout.prompts_per_step} gives each of the {dp} data-parallel "
                 f"replicas at least one group")
            rule(policy % et == 0, "engine.tensor", f"engine.tensor={et} divides the {policy} policy ranks into engines")
            rule(world.per_node % et == 0, "engine.tensor",
                 f"engine.tensor={et} divides the {world.per_node} ranks of a node (an engine never spans nodes)")
            if draft == "sync" and policy % et == 0:
                engines = EngineMap(policy, et).engines
                rule(engines == 1, "draft.online",
                     f"draft.online=sync learns beside the one engine ({engines} engine(s); draft.online=async "
                     f"with parallel.draft_ranks=1 learns from many)")

    if shape is not None:
        s = shape
        rules += shape_rules(s, t, p, ep, par.expert_tensor)
        rule(c.model.max_context <= s.positions, "model.max_context",
             f"model.max_context {c.model.max_context} is within the model's {s.positions} positions "
             f"(max_position_embeddings)")
        if engine.backend == "sglang":
            rule(s.heads % et == 0, "engine.tensor",
                 f"engine.tensor={et} divides the {s.heads} attention heads (SGLang's tensor parallelism)")
    return rules


def shape_rules(s: Shape, tensor: int, pipeline: int, expert: int, expert_tensor: int = 0) -> list[Rule]:
    """What a model's shape must give a tensor x pipeline x expert split: whole heads and key/value heads
    and MLP width per tensor rank (a mixture of experts: expert width per expert-tensor rank, which at
    `expert_tensor` 1 keeps each expert whole), whole layers per stage, whole experts per expert rank of a
    mixture of experts. `expert_tensor` (`parallel.expert_tensor`; 0: the same as `tensor`) set on a
    dense model is refused: it has no experts to lay out. `layout_rules` lists them; the Megatron layout
    (`Layout.of`) and the conversion tools refuse by them."""
    t, p, ep = tensor, pipeline, expert
    etp = expert_tensor or tensor
    width, what = (s.expert_ffn, "expert MLP width") if s.moe else (s.ffn, "MLP width")
    rules = [Rule(s.heads % t == 0, "parallel.tensor", f"tensor {t} divides the {s.heads} attention heads"),
             Rule(s.kv_heads % t == 0, "parallel.tensor",
                  f"tensor {t} divides the {s.kv_heads} key/value heads (query groups)")]
    if s.moe and etp != t:
        rules.append(Rule(width % etp == 0, "parallel.expert_tensor",
                          f"expert tensor {etp} divides the {what} {width} (each expert whole on one rank)"))
    else:
        rules.append(Rule(width % t == 0, "parallel.tensor", f"tensor {t} divides the {what} {width}"))
    rules.append(Rule(s.layers % p == 0, "parallel.pipeline", f"pipeline {p} divides the {s.layers} layers"))
    if expert_tensor and not s.moe:
        rules.append(Rule(False, "parallel.expert_tensor",
                          f"parallel.expert_tensor={expert_tensor} sets the experts' tensor parallelism of a "
                          f"mixture-of-experts model ({s.family}: {s.experts} experts); leave it 0"))
    if ep > 1:
        rules.append(Rule(s.moe, "parallel.expert", f"parallel.expert={ep} splits the experts of a mixture-of-experts "
                                                    f"model ({s.family}: {s.experts} experts)"))
        if s.moe:
            rules.append(Rule(s.experts % ep == 0, "parallel.expert",
                              f"parallel.expert={ep} divides the {s.experts} experts"))
    return rules


def broken(rules: list[Rule]) -> Rule | None:
    """The first rule that does not hold, if any."""
    return next((r for r in rules if not r.ok), None)


def validate(c: Config) -> None:
    """Each section's own rules (its `check`, beside its fields), then the rules across sections."""
    _check(c.threads >= 0, "threads", "must be >= 0", c.threads)
    for section in (c.model, c.trainer, c.deepspeed, c.engine, c.parallel, c.cluster, c.task, c.rollout,
                    c.speculation, c.draft, c.grpo, c.optim, c.sft, c.tracking, c.checkpoint, c.eval):
        section.check()
    if c.trainer.backend in DISTRIBUTED_TRAINERS:
        _check(not c.optim.trainable, "optim.trainable", "is for trainer.backend=torch only", c.optim.trainable)
    enforce(layout_rules(c))
    _check(c.rollout.max_new_tokens < c.model.max_context, "rollout.max_new_tokens", "must be < model.max_context",
           c.rollout.max_new_tokens)
    _check(c.rollout.refill_rounds == 0 or c.grpo.drop_equal_reward_groups, "rollout.refill_rounds",
           "refills the informative groups of a step: it needs grpo.drop_equal_reward_groups=true",
           c.rollout.refill_rounds)
    _check(c.draft.online == "off" or c.speculation.policy != "off", "draft.online",
           "needs speculation (speculation.policy != off): the draft learns from the states rollout computes for it",
           c.draft.online)
    _check(not c.trainer.optimizer_offload or c.device != "cpu", "trainer.optimizer_offload",
           "moves the optimizer from GPU to host memory: it needs CUDA (device=cuda or auto), not device=cpu, where "
           "the optimizer is in host memory already and megatron-core's offloading optimizer cannot run "
           "(`MegatronPolicyTrainer` says why)", c.trainer.optimizer_offload)
    # both engines record routing; SGLang's record under EAGLE is not the accepted tokens' routing (the
    # adapter's ROUTING_SPECULATION, engines/sglang/requests.py, says why in full)
    _check(c.trainer.routing_replay == "off" or c.engine.backend != "sglang" or c.speculation.policy == "off",
           "trainer.routing_replay", "rollout with engine.backend=sglang needs speculation.policy=off: SGLang 0.5.23 "
           "keys its routed-experts record by KV slot, and under EAGLE it is not the accepted tokens' routing (tree "
           "drafts move the accepted path's KV but not the record: speculative/eagle_worker_common.py:772-784; the "
           "capture buffer is not sized for verify steps: state_capturer/routed_experts.py:79-83)",
           c.trainer.routing_replay)
    _check(c.speculation.drafts == "learned" or c.engine.backend == "embedded", "speculation.drafts",
           "index and hybrid trees are the embedded engine's (engine.backend=embedded)", c.speculation.drafts)


def enforce(rules: list[Rule]) -> None:
    """A ConfigError naming the key of the first layout rule the run breaks (`layout_rules`)."""
    rule = broken(rules)
    if rule is not None:
        raise ConfigError(f"{rule.key} breaks a layout rule: {rule.text}")


def to_yaml(c: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(c))


def flatten(c: Config) -> dict[str, Any]:
    """Dotted keys (`grpo.eps_low`) for MLflow params."""
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = node

    walk("", OmegaConf.to_container(OmegaConf.structured(c)))
    return out
