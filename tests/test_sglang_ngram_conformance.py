"""Why fastgrpo does not turn on SGLang's NGRAM speculation (docs/drafts.md, "SGLang: the NGRAM path"), pinned
against the pinned 0.5.23 wheel's own source: its Python read with ast, its ngram corpus (C++) and verify kernel
(CUDA) read as text from the wheel. Each test asserts a fact the decision rests on, so that a later SGLang pin
that changes one fails here and the decision is revisited. Skipped, with the reason, only when the wheel cannot
be downloaded (the fixture is tests/test_sglang_conformance.py's)."""

from __future__ import annotations

import ast
import inspect
import re

from fastgrpo.config import load_config
from fastgrpo.engines.sglang.adapter import SGLangEngine, server_args
from tests import sglang_conformance as conformance
from tests.test_sglang_conformance import src  # noqa: F401 (its fixture: the wheel's source)

NGRAM_WORKER = "sglang.srt.speculative.ngram_worker.NGRAMWorker"
CORPUS_CPP = "sglang/kernels/jit/csrc/ngram_corpus/"
VERIFY_KERNEL = "sglang/kernels/jit/include/sgl_kernel/speculative/sampling.cuh"


def squash(text: str) -> str:
    """C++ text with its whitespace runs made one blank, so statements compare as written."""
    return re.sub(r"\s+", " ", text)


def between(text: str, start: str, end: str) -> str:
    assert start in text, f"{start!r} is no longer in the source"
    head = text[text.index(start):]
    assert end in head, f"{end!r} no longer follows {start!r}"
    return head[:head.index(end)]


def method_text(src, dotted_class: str, name: str) -> str:
    fn = src.class_named(dotted_class).method(name)
    assert fn is not None, f"{dotted_class}.{name} is gone"
    return ast.unparse(fn)


def function_text(src, module: str, name: str) -> str:
    symbol = src.resolve(module, name)
    assert symbol is not None and symbol.node is not None, f"{module}.{name} is gone"
    return ast.unparse(symbol.node)


def test_ngram_trees_are_padded_with_token_0_children_of_the_root(src):
    """A draft tree the corpus cannot fill is padded to the verify width with nodes of token 0, each a child of
    the root: a tree short of n nodes holds up to n - 2 root children of the same token."""
    fill = squash(between(conformance.wheel_text(CORPUS_CPP + "result.cpp"), "Result fillResult(",
                          "std::vector<std::vector<int32_t>> extractLeafPaths_"))
    assert ("while (info.token.size() < static_cast<size_t>(draft_token_num)) { info.token.emplace_back(0); "
            "prevs.emplace_back(0); }") in fill
    # a node's ancestors are its parent's plus itself: a padded node (parent 0) is a child of the root
    assert "memcpy(&info.mask[i * n], &info.mask[prevs[i] * n], prevs[i] + 1);" in fill
    assert "info.mask[i * n + i] = 1;" in fill
    # every match builds its tree through fillResult at the full width: the budget is the width less the root
    trie = squash(conformance.wheel_text(CORPUS_CPP + "trie.cpp"))
    assert trie.count("return fillResult(last_token, draft_token_num + 1, tree, root);") == 2  # BFS and PROB
    get_num = squash(between(conformance.wheel_text(CORPUS_CPP + "param.h"), "size_t get_draft_token_num(",
                             "std::vector<size_t> parse("))
    assert get_num.rstrip(" }").endswith("return draft_token_num - 1;")
    ngram = squash(conformance.wheel_text(CORPUS_CPP + "ngram.cpp"))
    assert "const auto total_draft_token_num = param_.get_draft_token_num(tokens.size());" in ngram
    # the worker checks the width and sends the tree to verify as the corpus built it (no deduplication)
    assert "assert total_draft_token_num == bs * self.draft_token_num" in method_text(
        src, NGRAM_WORKER, "_prepare_draft_tokens")
    prepare = method_text(src, NGRAM_WORKER, "_prepare_for_speculative_decoding")
    assert "req_drafts, mask = self._prepare_draft_tokens(batch)" in prepare
    assert "draft_tokens.copy_(torch.from_numpy(req_drafts), non_blocking=True)" in prepare
    assert "torch.from_numpy(mask)" in prepare


def test_ngram_sampled_verify_sums_sibling_tokens_without_deduplication(src):
    """At T > 0 on CUDA, NGRAM verifies with EAGLE's tree kernel and no draft probabilities: a node's children
    are accepted while one uniform falls below the running sum of their target probabilities. Two children of
    one token count its probability twice, so the padded token-0 children make token 0 m times as likely as
    the target says (lossy), which is why fastgrpo adds no NGRAM flag."""
    worker = method_text(src, NGRAM_WORKER, "forward_batch_generation")
    assert re.search(r"\beagle_sample\(verify_input, batch, logits_output, grammar_mask\b", worker)
    assert src.resolve("sglang.srt.speculative.ngram_worker", "eagle_sample").module.name == \
        "sglang.srt.speculative.eagle_utils"
    sample = function_text(src, "sglang.srt.speculative.eagle_utils", "eagle_sample")
    assert "sampling_fn = tree_speculative_sampling_target_only" in sample
    assert "verify_input.draft_probs if use_rejection_sampling else torch.zeros_like(target_probs)" in sample
    assert "top_k_renorm_prob(" in sample and "top_p_renorm_prob(" in sample  # top-k / top-p before verify
    greedy = function_text(src, "sglang.srt.speculative.eagle_utils", "_verify_uses_greedy")
    assert "return is_all_greedy or is_cpu or is_xpu or (is_hip and (not use_rejection_sampling))" in greedy
    # rejection sampling (which would take draft probabilities) is refused for NGRAM
    eagle_family = function_text(src, "sglang.srt.arg_groups.speculative_hook", "_handle_eagle_family")
    assert "if cfg.speculative_algorithm not in ('EAGLE', 'EAGLE3'):" in eagle_family
    # the op on CUDA is the JIT-compiled TreeSpeculativeSamplingTargetOnly
    ops = src.module("sglang.kernels.ops.speculative.verify_sampling")
    assert "from sglang.kernels.ops.speculative.sampling import tree_speculative_sampling_target_only" in \
        ast.unparse(ops.tree)
    jit = function_text(src, "sglang.kernels.ops.speculative.sampling", "_jit_sampling_module")
    assert "cuda_files=['speculative/sampling.cuh']" in jit and "tree_speculative_sampling_target_only<" in jit
    wrapper = squash(conformance.wheel_text("sglang/kernels/jit/csrc/speculative/sampling.cuh"))
    assert "#include <sgl_kernel/speculative/sampling.cuh>" in wrapper
    assert "speculative_sampling::TreeSpeculativeSamplingTargetOnly<" in wrapper
    kernel = squash(re.sub(r"//[^\n]*", "", conformance.wheel_text(VERIFY_KERNEL)))  # comments out
    siblings = between(kernel, "while (cur_index != -1) {", "if (cur_index == -1) break;")
    # the whole sibling loop, as read: any change to it (a deduplication among them) fails here
    assert siblings == (
        "while (cur_index != -1) { IdType2 draft_index = retrive_index[bx * num_draft_tokens + cur_index]; "
        "IdType2 draft_token_id = candidates[bx * num_draft_tokens + cur_index]; "
        "DType target_prob_single = target_probs[cur_prob_offset + draft_token_id]; "
        "prob_acc += target_prob_single; const bool has_target_mass = target_prob_single > DType(0); "
        "if (has_target_mass && (coin < prob_acc / threshold_acc || target_prob_single >= threshold_single)) { "
        "prob_acc = 0.; cur_prob_offset = (bx * num_draft_tokens + cur_index) * d; "
        "coin = uniform_samples[bx * num_draft_tokens + cur_index]; "
        "predicts[last_accepted_retrive_idx] = draft_token_id; ++num_accepted_tokens; "
        "accept_index[bx * num_speculative_tokens + num_accepted_tokens] = draft_index; "
        "last_accepted_retrive_idx = draft_index; break; } else { "
        "draft_probs[cur_prob_offset + draft_token_id] = target_probs[cur_prob_offset + draft_token_id]; "
        "cur_index = retrive_next_sibling[bx * num_draft_tokens + cur_index]; } } ")
    # the accept thresholds stay 1.0 unless set (then even a deduplicated tree would be lossy)
    fields = src.server_args_fields
    assert ast.literal_eval(fields["speculative_accept_threshold_single"]) == 1.0
    assert ast.literal_eval(fields["speculative_accept_threshold_acc"]) == 1.0


def test_one_speculative_algorithm_per_server(src):
    """NGRAM replaces EAGLE (fastgrpo's learned draft) in a server: it cannot be combined with it."""
    spec = src.class_named("sglang.srt.arg_groups.fields.spec.Spec").node
    annotation = next(ast.unparse(s.annotation) for s in spec.body
                      if isinstance(s, ast.AnnAssign) and getattr(s.target, "id", None) == "speculative_algorithm")
    assert annotation.startswith("A[Optional[str],")
    members = src.class_named("sglang.srt.speculative.spec_info.SpeculativeAlgorithm").node
    names = {t.id for s in members.body if isinstance(s, ast.Assign) for t in s.targets if isinstance(t, ast.Name)}
    assert {"EAGLE", "NGRAM"} <= names and not {"LOOKAHEAD", "HYBRID"} & names
    is_eagle = method_text(src, "sglang.srt.speculative.spec_info.SpeculativeAlgorithm", "is_eagle")
    assert "NGRAM" not in is_eagle
    init = method_text(src, "sglang.srt.managers.scheduler.Scheduler", "maybe_init_draft_worker")
    assert "DraftWorkerClass = self.spec_algorithm.create_worker(self.server_args)" in init
    assert "self.draft_worker = DraftWorkerClass(**draft_worker_kwargs)" in init
    assert "return None" in method_text(src, NGRAM_WORKER, "draft_worker")  # no draft model to push ours into
    assert {f for f in src.server_args_fields if f.startswith("speculative_ngram_")} == {
        "speculative_ngram_min_bfs_breadth", "speculative_ngram_max_bfs_breadth", "speculative_ngram_match_type",
        "speculative_ngram_max_trie_depth", "speculative_ngram_capacity", "speculative_ngram_external_corpus_path",
        "speculative_ngram_external_sam_budget", "speculative_ngram_external_corpus_max_tokens"}


def test_the_ngram_corpus_is_shared_and_flushed_with_the_cache(src):
    """One corpus per worker takes every request's tokens (a GRPO group's siblings share it), and every
    flush_cache, which the adapter calls at each weight commit, empties it: a prompt's earlier responses do
    not survive into the next step; external corpora do."""
    init = method_text(src, NGRAM_WORKER, "__init__")
    assert "self.ngram_corpus = NgramCorpus(" in init
    update = method_text(src, NGRAM_WORKER, "_update_ngram_corpus")
    assert "for req in batch.reqs:" in update and "self.ngram_corpus.batch_put(batch_tokens)" in update
    ngram = squash(conformance.wheel_text(CORPUS_CPP + "ngram.cpp"))
    assert "(trie_.get()->*trie_result_build_fn)(" in ngram  # one trie for every request in the batch
    assert "self.ngram_corpus.reset()" in method_text(src, NGRAM_WORKER, "clear_cache_pool")
    assert "self.draft_worker.clear_cache_pool()" in method_text(src, "sglang.srt.managers.scheduler.Scheduler",
                                                                   "flush_cache")
    reset = squash(between(conformance.wheel_text(CORPUS_CPP + "ngram.h"), "void reset() {", "const Param& param()"))
    assert "trie_->reset();" in reset and "sams_" not in reset
    assert "self._engine.flush_cache()" in inspect.getsource(SGLangEngine._end)
    assert "self._end()" in inspect.getsource(SGLangEngine.commit_weights)


def test_external_corpora_take_text_which_a_token_id_engine_cannot_tokenize(src):
    """Runtime corpora come as text or a file, tokenized by the tokenizer manager, whose tokenizer is None
    under skip_tokenizer_init (fastgrpo's engine runs on token ids); the offline Engine has no method for them."""
    add = method_text(src, "sglang.srt.managers.tokenizer_manager.TokenizerManager", "add_external_corpus")
    assert "if obj.file_path is not None:" in add and "elif obj.documents is not None:" in add
    assert "'Either file_path or documents must be provided.'" in add
    assert "self.tokenizer.encode(doc, add_special_tokens=False)" in add
    assert "obj.token_chunks = token_chunks" in add  # token_chunks are overwritten, never taken from the caller
    assert src.class_named("sglang.srt.entrypoints.engine.Engine").method("add_external_corpus") is None
    tokenizer = method_text(src, "sglang.srt.managers.tokenizer_manager.TokenizerManager",
                            "init_tokenizer_and_processor")
    assert "if get_serving().skip_tokenizer_init:\n            self.tokenizer = None" in tokenizer
    cfg = load_config(None, ["engine.backend=sglang", "speculation.policy=static"])
    assert server_args(cfg, "static", None, None, 0)["skip_tokenizer_init"] is True
