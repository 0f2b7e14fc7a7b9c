"""`fastgrpo bench <name> ...`: the benchmarks' sub-parsers. Each benchmark module registers its own flags:
its `add_arguments(parser)` adds them to its sub-parser and sets `run` (called with the parsed arguments
and the config) and, where it differs from a policy with its draft, `needs` (what `fastgrpo bench` builds
first). The table below names each benchmark and its module, which is imported only when that benchmark
runs or its help is asked (the benchmarks import torch and the engines: `fastgrpo bench --help` does not).

Every benchmark has --quick, --output, --config and key=value overrides; an argument its parser does not
know is refused with the benchmark named (`BenchUsageError`, exit status 1 from `fastgrpo`)."""

from __future__ import annotations

import argparse
import importlib

# name -> (its module, what it measures); in `fastgrpo bench --help`'s order
BENCHES: dict[str, tuple[str, str]] = {
    "rollout": ("fastgrpo.bench.rollout", "speculation modes compared in one process"),
    "e2e": ("fastgrpo.bench.e2e", "the same GRPO run without speculation, with a frozen draft, with online draft "
                                  "learning"),
    "forward": ("fastgrpo.bench.forward", "the policy forward by batch, tokens per sequence and matmul kernel"),
    "shapes": ("fastgrpo.bench.shapes", "draft and target costs for deeper, narrower policies of the same size"),
    "draft": ("fastgrpo.bench.draft_fit", "how well drafts fit a policy, on its own samples, with fixed trees"),
    "drafts": ("fastgrpo.bench.drafts", "learned, index and hybrid draft trees at equal node budget over epochs of "
                                        "the same prompts"),
    "learning": ("fastgrpo.bench.learning", "held-out accuracy curves of GRPO over seeds, with and without "
                                            "speculation"),
    "noise": ("fastgrpo.bench.noise", "how much of one GRPO update is signal: the gradient noise scale"),
    "trainer": ("fastgrpo.bench.trainer", "one GRPO step of the torch and Megatron trainers at world 1, 2 and 4"),
    "replay": ("fastgrpo.bench.replay", "routing replay of a mixture of experts on each trainer: the engine/"
                                        "trainer mismatch it removes, what it costs"),
    "engines": ("fastgrpo.bench.engines", "a GRPO batch's rollout in a world of two ranks on one engine or two"),
    "guarantee": ("fastgrpo.bench.guarantee", "aware against plain decoding, paired, over runs and thread counts"),
    "simulate": ("fastgrpo.bench.simulate.command", "rollout at GPU scale, simulated, validated against this CPU's "
                                                    "engine"),
    "sglang-tiers": ("fastgrpo.bench.sglang_speculation", "aware on SGLang's adaptive EAGLE against SGLang's own "
                                                    "speculation, simulated"),
    "gpu-check": ("fastgrpo.bench.gpu_check.driver", "the GPU path in one run: SFT and draft of a ~308M policy, "
                  "Megatron against torch, the weight push, the decode step against its bandwidth bound, rollout "
                  "(--output is its directory, --quick its toy size, device=cpu runs it without a GPU)"),
}
# A benchmark's `needs`, what `fastgrpo bench` builds before it runs: "draft" (the default) the config, the
# policy (`fastgrpo sft`) and its draft (`fastgrpo draft-pretrain`) where missing; "policy" without the
# draft; "config" the config alone; None nothing (the benchmark makes its own config: gpu-check)


class BenchUsageError(ValueError):
    """A benchmark's arguments refused, with the benchmark named."""


class BenchParser(argparse.ArgumentParser):
    """One benchmark's sub-parser: the flags every benchmark has, then its module's own, added the first
    time it parses or prints its help (so that only the benchmark run is imported)."""

    def __init__(self, *args, module: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._module = module
        if module is None:
            return
        self.add_argument("--quick", action="store_true", help="smaller workloads (minutes, not tens of minutes)")
        self.add_argument("--output", help="JSON results, default bench/<name>.json (a PNG plot is written beside it)")
        self.add_argument("--config", help="YAML config (default: configs/tiny_cpu.yaml if present)")
        self.add_argument("overrides", nargs="*", help="key=value overrides, e.g. grpo.steps=4")
        self.set_defaults(needs="draft")

    def load(self) -> BenchParser:
        if self._module is not None:
            module, self._module = self._module, None
            importlib.import_module(module).add_arguments(self)
        return self

    def parse_known_args(self, args=None, namespace=None):
        self.load()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self.load()
        return super().format_help()

    def error(self, message: str):
        raise BenchUsageError(f"`{self.prog.removeprefix('fastgrpo ')}`: {message} (see `{self.prog} --help`)")


def add_bench_parsers(bench: argparse.ArgumentParser) -> None:
    """`fastgrpo bench`'s sub-commands, one per benchmark, each with its own parser."""
    sub = bench.add_subparsers(dest="what", required=True, metavar="BENCH", parser_class=BenchParser,
                               title="benchmarks", help="each with its own flags: fastgrpo bench BENCH --help")
    for name, (module, help) in BENCHES.items():
        sub.add_parser(name, module=module, help=help, description=help)


def unknown_arguments(what: str, stray: list[str]) -> BenchUsageError:
    """The error for arguments that `bench <what>`'s parser left (flags it does not have)."""
    return BenchUsageError(f"`bench {what}` has no argument {' '.join(stray)} (see `fastgrpo bench {what} --help`)")


def thread_counts(text: str) -> list[int]:
    """An argparse type: comma-separated thread counts, each >= 1."""
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated thread counts such as 1,2, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"thread counts must be >= 1, got {text!r}")
    return counts


def at_least_one(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
