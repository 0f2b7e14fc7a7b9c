"""SGLang's own functions run from the wheel's source: `sglang_function` compiles one; a model's weight
loading, `load_weights_calls`, compiles a model class's `load_weights` (and the helpers it calls) and
records which parameter each tensor is loaded into, with the loader's shard and expert ids."""

from __future__ import annotations

import ast

from tests.sglang_conformance.reading import Source

class LoaderCall:
    """One parameter SGLang's `load_weights` loaded a tensor into, with the loader's extra arguments
    (shard ids, expert ids)."""

    def __init__(self, parameter: str, args: tuple, kwargs: dict):
        self.parameter, self.args, self.kwargs = parameter, args, kwargs

    def __repr__(self) -> str:
        extra = [repr(a) for a in self.args if isinstance(a, (int, str))] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.parameter}({', '.join(extra)})"


def _compiled(node: ast.FunctionDef, filename: str, namespace: dict):
    """A function of SGLang's source (decorators dropped), defined in `namespace`."""
    fn = ast.FunctionDef(**{**{f: getattr(node, f) for f in node._fields}, "decorator_list": []})
    module = ast.fix_missing_locations(ast.Module([fn], []))
    exec(compile(module, filename, "exec"), namespace)
    return namespace[node.name]


def sglang_function(src: Source, module: str, name: str, owner: str | None = None, namespace: dict | None = None):
    """SGLang's own function `name` of `module` (a method of class `owner` if given, called with its
    `self` / `cls` passed by the caller), compiled from the wheel's source into `namespace` (the globals
    it reads: what the caller provides stands in for SGLang's imports). Decorators are dropped."""
    symbol = src.resolve(module, owner or name)
    if symbol is None:
        raise LookupError(f"{module}.{owner or name} is not in sglang's source")
    node = src.cls(symbol).method(name) if owner else symbol.node
    if node is None:
        raise LookupError(f"{module}.{owner}.{name} is not in sglang's source")
    return _compiled(node, str(symbol.module.path), dict(namespace or {}))


def load_weights_calls(src: Source, model_class: str, config, parameters: list[str],
                       named_tensors: list[tuple[str, object]]) -> dict[str, list[LoaderCall]]:
    """What `model_class.load_weights` (SGLang's own source, compiled and run here) does with each of
    `named_tensors`, for a model of `config` whose parameters are named `parameters`: the loader calls
    each tensor led to, [] for one it skipped. The helpers it calls run as SGLang wrote them
    (FusedMoE.make_expert_params_mapping, get_layer_id); only the parameters' loaders record. A global
    name the function uses that is not provided here fails the call (the source has changed)."""
    import builtins
    import logging
    import re
    import typing
    from functools import partial
    from types import SimpleNamespace

    cls = src.class_named(model_class)
    node = cls.method("load_weights")
    calls: list[LoaderCall] = []
    hints = {n: getattr(typing, n) for n in ("Any", "Dict", "Iterable", "List", "Optional", "Tuple", "Union")}

    def sglang_function(name: str, owner: str | None = None):
        symbol = src.resolve(cls.module.name, owner or name)
        fn = src.cls(symbol).method(name) if owner else symbol.node
        return _compiled(fn, str(symbol.module.path), {"re": re, **hints})

    namespace = {
        **hints, "torch": __import__("torch"), "logger": logging.getLogger("sglang-load-weights"),
        "FusedMoE": SimpleNamespace(make_expert_params_mapping=partial(
            sglang_function("make_expert_params_mapping", "FusedMoE"), None)),  # a classmethod: cls unused
        "get_layer_id": sglang_function("get_layer_id"),
        "default_weight_loader": lambda param, loaded_weight: calls.append(LoaderCall(param.name, (), {})),
        # the expert-location (EPLB) descriptor's names: that branch runs only when the model lacks
        # routed_experts_weights_of_layer, which its __init__ sets (and the model below has)
        "LazyValue": None, cls.name.replace("ForCausalLM", "SparseMoeBlock"): None,
    }
    stored = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    missing = sorted(n for n in used - stored - {a.arg for a in node.args.args} - set(namespace)
                     if not hasattr(builtins, n))
    if missing:
        raise LookupError(f"{model_class}.load_weights uses {missing}, which this harness does not provide")
    load_weights = _compiled(node, str(cls.module.path), namespace)

    def loader(name: str):
        return lambda param, loaded_weight, *args, **kwargs: calls.append(LoaderCall(name, args, kwargs))

    params = {n: SimpleNamespace(name=n, weight_loader=loader(n)) for n in parameters}
    model = SimpleNamespace(config=config, model=SimpleNamespace(start_layer=0, end_layer=config.num_hidden_layers),
                            named_parameters=lambda: list(params.items()), routed_experts_weights_of_layer=None)
    out: dict[str, list[LoaderCall]] = {}
    for name, tensor in named_tensors:
        calls.clear()
        load_weights(model, [(name, tensor)])
        out[name] = list(calls)
    return out
