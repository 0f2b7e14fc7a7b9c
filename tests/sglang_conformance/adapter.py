"""The adapter's uses of SGLang checked against its source: every SGLang import, every attribute
read and call made on an SGLang module, class or object (arguments bound against the real
signature, constructor keywords against the real fields, coroutines and async generators consumed
as such), every string key read from a dict (`check_adapter`), and keys against SGLang's own
(`check_keys`)."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from fastgrpo.engines.sglang.adapter import SGLANG_VERSION
from tests.sglang_conformance.reading import (ClassInfo, Source, Symbol, bind_problems, call_kind, is_staticmethod,
                                              plain_name)

# SGLang attributes holding objects of a known SGLang class (facts about sglang, each checked in
# the conformance test: the class assigns the attribute)
ATTRIBUTE_TYPES = {
    ("sglang.srt.entrypoints.engine.Engine", "tokenizer_manager"): "sglang.srt.managers.tokenizer_manager.TokenizerManager",
    ("sglang.srt.entrypoints.engine.Engine", "server_args"): "sglang.srt.server_args.ServerArgs",
}


@dataclass
class _Typed:
    kind: str  # "module", "class", "instance", "function", "value", "coroutine", "async generator", "unknown"
    symbol: Symbol | None = None
    cls: ClassInfo | None = None
    fn: ast.AST | None = None
    bound: bool = False
    qualname: str = ""


UNKNOWN = _Typed("unknown")


class AdapterScan:
    """Walks the adapter's code and checks every use of SGLang in it against the source."""

    def __init__(self, src: Source, tree: ast.Module, filename: str):
        self.src, self.tree, self.filename = src, tree, filename
        self.problems: list[str] = []
        self.uses: list[str] = []  # what was checked, for the report
        self.string_keys: list[tuple[str, int]] = []

    def report(self, node: ast.AST, message: str) -> None:
        self.problems.append(f"{self.filename}:{getattr(node, 'lineno', '?')}: {message}")

    # environments: names bound to SGLang things, per scope
    def run(self) -> AdapterScan:
        module_env = self._imports(self.tree.body, {})
        self._scope(self.tree, module_env, self_attrs={})
        return self

    def _imports(self, body, env: dict[str, _Typed]) -> dict[str, _Typed]:
        env = dict(env)
        for node in body:
            for stmt in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else [node]:
                if isinstance(stmt, ast.Import):
                    for alias in stmt.names:
                        if alias.name.split(".")[0] == self.src.package:
                            sym = self.src.resolve_dotted(alias.name)
                            if sym is None:
                                self.report(stmt, f"import {alias.name}: no such module in sglang {SGLANG_VERSION}")
                                continue
                            self.uses.append(f"import {alias.name}")
                            local = alias.asname or alias.name.split(".")[0]
                            env[local] = self._typed(self.src.resolve_dotted(local) if not alias.asname else sym)
                elif isinstance(stmt, ast.ImportFrom) and (stmt.module or "").split(".")[0] == self.src.package:
                    for alias in stmt.names:
                        sym = self.src.resolve(stmt.module, alias.name)
                        if sym is None:
                            self.report(stmt, f"from {stmt.module} import {alias.name}: sglang {SGLANG_VERSION} has no "
                                              f"such name there")
                            continue
                        self.uses.append(f"from {stmt.module} import {alias.name}")
                        env[alias.asname or alias.name] = self._typed(sym)
        return env

    def _typed(self, sym: Symbol | None) -> _Typed:
        if sym is None:
            return UNKNOWN
        if sym.is_module:
            return _Typed("module", sym, qualname=sym.qualname)
        if isinstance(sym.node, ast.ClassDef):
            return _Typed("class", sym, cls=self.src.cls(sym), qualname=sym.qualname)
        if isinstance(sym.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return _Typed("function", sym, fn=sym.node, qualname=sym.qualname)
        return _Typed("value", sym, qualname=sym.qualname)

    def _scope(self, node: ast.AST, env: dict[str, _Typed], self_attrs: dict[str, _Typed]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                attrs = self._self_attributes(child, env)
                for stmt in child.body:
                    self._scope_stmt(stmt, env, attrs)
            else:
                self._scope_stmt(child, env, self_attrs)

    def _scope_stmt(self, stmt: ast.AST, env, self_attrs) -> None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local = self._imports(stmt.body, env)
            local.update(self._annotated_params(stmt, local))
            local.update(self._local_assignments(stmt, local, self_attrs))
            self._check_body(stmt, local, self_attrs)
        elif isinstance(stmt, ast.ClassDef):
            self._scope(ast.Module(body=[stmt], type_ignores=[]), env, self_attrs)
        else:
            self._check_body(stmt, env, self_attrs)

    def _annotated_params(self, fn, env) -> dict[str, _Typed]:
        """Parameters annotated with an SGLang class (a string annotation "sglang.Engine" included)."""
        out = {}
        for arg in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs:
            if arg.annotation is None:
                continue
            text = _optional_stripped(arg.annotation)
            if isinstance(text, str) and text.split(".")[0] == self.src.package:
                sym = self.src.resolve_dotted(text)
                cls = self.src.cls(sym) if sym is not None else None
                if cls is None:
                    self.report(arg, f"annotation {text}: not a class in sglang {SGLANG_VERSION}")
                    continue
                out[arg.arg] = _Typed("instance", sym, cls=cls, qualname=cls.qualname)
        return out

    def _self_attributes(self, cls_node: ast.ClassDef, env) -> dict[str, _Typed]:
        """`self.<attr> = <name>` in __init__ where <name> is a parameter annotated with an SGLang class."""
        out = {}
        for stmt in cls_node.body:
            if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
                params = self._annotated_params(stmt, env)
                for node in ast.walk(stmt):
                    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id in params:
                        for t in node.targets:
                            if isinstance(t, ast.Attribute) and plain_name(t.value) == "self":
                                out[t.attr] = params[node.value.id]
        return out

    def _local_assignments(self, fn, env, self_attrs) -> dict[str, _Typed]:
        out: dict[str, _Typed] = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                typed = self._type(node.value, {**env, **out}, self_attrs, report=False)
                if typed.kind in ("instance", "async generator", "coroutine"):
                    out[node.targets[0].id] = typed
        return out

    def _check_body(self, node, env, self_attrs) -> None:
        statements_exprs = {id(s.value) for s in ast.walk(node) if isinstance(s, ast.Expr)}
        for sub in ast.walk(node):
            if isinstance(sub, (ast.Attribute, ast.Call)):
                typed = self._type(sub, env, self_attrs, report=True)
                if isinstance(sub, ast.Call) and typed.kind == "coroutine" and id(sub) in statements_exprs:
                    self.report(sub, f"{typed.qualname}(...) is a coroutine and is never run")
            if isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant) and isinstance(sub.slice.value, str):
                self.string_keys.append((sub.slice.value, sub.lineno))
            if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "get"
                    and sub.args and isinstance(sub.args[0], ast.Constant) and isinstance(sub.args[0].value, str)):
                self.string_keys.append((sub.args[0].value, sub.lineno))

    def _type(self, node: ast.AST, env, self_attrs, report: bool) -> _Typed:
        """The SGLang thing `node` evaluates to (UNKNOWN when it is none); reports misuse once."""
        key = (id(node), report)
        memo = self.__dict__.setdefault("_memo", {})
        if key in memo:
            return memo[key]
        memo[key] = UNKNOWN
        typed = self._type_uncached(node, env, self_attrs, report)
        memo[key] = typed
        return typed

    def _type_uncached(self, node, env, self_attrs, report) -> _Typed:
        if isinstance(node, ast.Name):
            return env.get(node.id, UNKNOWN)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                return self_attrs.get(node.attr, UNKNOWN)
            base = self._type(node.value, env, self_attrs, report=False)
            return self._attribute(node, base, report)
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute) and node.func.attr in ("__anext__", "__aiter__"):
                base = self._type(node.func.value, env, self_attrs, report=False)
                if base.kind not in ("async generator", "unknown") and report:
                    self.report(node, f"{base.qualname}(...) is a {base.kind}, not an async generator: "
                                      f"it has no {node.func.attr}")
                return UNKNOWN
            f = self._type(node.func, env, self_attrs, report=False)
            return self._call(node, f, report)
        return UNKNOWN

    def _attribute(self, node: ast.Attribute, base: _Typed, report: bool) -> _Typed:
        name = node.attr
        if base.kind == "module":
            sym = self.src.resolve(base.symbol.module.name, name)
            if sym is None:
                if report:
                    self.report(node, f"{base.qualname}.{name}: sglang {SGLANG_VERSION} has no such name")
                return UNKNOWN
            if report:
                self.uses.append(f"{base.qualname}.{name}")
            return self._typed(sym)
        if base.kind in ("class", "instance"):
            cls = base.cls
            fn = cls.method(name)
            if fn is not None:
                if report:
                    self.uses.append(f"{cls.qualname}.{name}")
                return _Typed("function", base.symbol, cls=cls, fn=fn, bound=base.kind == "instance" or is_staticmethod(fn),
                              qualname=f"{cls.qualname}.{name}")
            if base.kind == "instance" and (name in cls.attributes or name in cls.fields):
                if report:
                    self.uses.append(f"{cls.qualname}.{name}")
                typed_as = ATTRIBUTE_TYPES.get((cls.qualname, name))
                if typed_as is not None:
                    sym = self.src.resolve_dotted(typed_as)
                    return _Typed("instance", sym, cls=self.src.cls(sym), qualname=typed_as)
                return UNKNOWN
            if report:
                self.report(node, f"{cls.qualname} has no attribute {name!r} in sglang {SGLANG_VERSION}")
        return UNKNOWN

    def _call(self, node: ast.Call, f: _Typed, report: bool) -> _Typed:
        n_positional = sum(1 for a in node.args if not isinstance(a, ast.Starred))
        open_ended = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
        keywords = [k.arg for k in node.keywords if k.arg is not None]
        if f.kind == "class":
            cls = f.cls
            if cls.is_record:
                problems = []
                if n_positional:
                    problems.append(f"{cls.qualname} is built from keywords; the call passes {n_positional} "
                                    f"positional arguments")
                fields = cls.fields
                problems += [f"{cls.qualname} has no field {k!r}" for k in keywords if k not in fields]
                if not open_ended:
                    problems += [f"{cls.qualname} requires {k!r}" for k, default in fields.items()
                                 if default is None and k not in keywords and not k.startswith("_")]
            else:
                init = cls.method("__init__")
                problems = bind_problems(init, f"{cls.qualname}()", n_positional, keywords, bound=True,
                                         open_ended=open_ended) if init is not None else []
            if report:
                for p in problems:
                    self.report(node, p)
                self.uses.append(f"{cls.qualname}({', '.join(keywords)})")
            return _Typed("instance", f.symbol, cls=cls, qualname=cls.qualname)
        if f.kind == "function":
            if report:
                for p in bind_problems(f.fn, f.qualname, n_positional, keywords, bound=f.bound, open_ended=open_ended):
                    self.report(node, p)
                self.uses.append(f"{f.qualname}({', '.join(keywords)})")
            kind = call_kind(f.fn)
            return _Typed(kind, f.symbol, fn=f.fn, qualname=f.qualname) if kind != "sync" else UNKNOWN
        return UNKNOWN


def check_adapter(src: Source, code: str, filename: str = "<adapter>") -> AdapterScan:
    """Scan adapter code (its text) against the source; `.problems` lists what SGLang would refuse."""
    return AdapterScan(src, ast.parse(code, filename), filename).run()


def check_keys(src: Source, what: str, keys, owner: str = "") -> list[str]:
    """`keys` against SGLang's: "server_args" (ServerArgs fields), "sampling_params" (SamplingParams
    fields), "output" (generate output, meta_info and finish-reason keys)."""
    if what == "server_args":
        known = set(src.server_args_fields)
    elif what == "sampling_params":
        known = set(src.class_named("sglang.srt.sampling.sampling_params.SamplingParams").fields)
    elif what == "output":
        known = src.output_keys
    else:
        raise ValueError(what)
    return [f"{owner}{k!r} is not a {what} key of sglang {SGLANG_VERSION}" for k in sorted(set(keys)) if k not in known]


def _optional_stripped(annotation: ast.expr) -> str | None:
    """An annotation's text with an optional `| None` (either side) dropped: `sglang.Engine | None` reads
    as `sglang.Engine`, a string annotation as the expression it holds; None for what is not a name."""
    node = annotation
    if isinstance(node, ast.Constant):
        if not isinstance(node.value, str):
            return None
        node = ast.parse(node.value, mode="eval").body
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        sides = [s for s in (node.left, node.right) if not (isinstance(s, ast.Constant) and s.value is None)]
        if len(sides) == 1:
            node = sides[0]
    return ast.unparse(node)
