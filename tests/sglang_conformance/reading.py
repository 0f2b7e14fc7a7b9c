"""SGLang's source read with `ast`: `Source` resolves a name as `from module import name` would
(through imports, star imports and lazy re-exports), `ClassInfo` a class's methods (through its
bases), dataclass / msgspec fields and instance attributes; `parameters`, `call_kind` and
`bind_problems` judge a call against a function's real signature."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from fastgrpo.engines.sglang.adapter import SGLANG_VERSION

_OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
              ast.LShift: lambda a, b: a << b if b < 256 else NOT_LITERAL, ast.RShift: lambda a, b: a >> b,
              ast.BitOr: lambda a, b: a | b}


def literal(node: ast.AST | None):
    """A node's value when it is a literal or integer arithmetic on literals (`1 << 30`), else the
    sentinel NOT_LITERAL."""
    if node is None:
        return NOT_LITERAL
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        a, b = literal(node.left), literal(node.right)
        if isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool) and not isinstance(b, bool):
            return _OPERATORS[type(node.op)](a, b)
        return NOT_LITERAL
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return NOT_LITERAL



NOT_LITERAL = object()


def _top_statements(body: list[ast.stmt], fallback: bool = False, flagged: bool = False):
    """A module's statements, including those under if / try (TYPE_CHECKING imports, fallbacks);
    `flagged`: (statement, whether it is an except-branch fallback) pairs."""
    for stmt in body:
        yield (stmt, fallback) if flagged else stmt
        if isinstance(stmt, ast.If):
            yield from _top_statements(stmt.body, fallback, flagged)
            yield from _top_statements(stmt.orelse, fallback, flagged)
        elif isinstance(stmt, ast.Try):
            yield from _top_statements(stmt.body, fallback, flagged)
            for handler in stmt.handlers:
                yield from _top_statements(handler.body, True, flagged)
            yield from _top_statements(stmt.orelse, fallback, flagged)
            yield from _top_statements(stmt.finalbody, fallback, flagged)


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    is_package: bool
    defs: dict[str, ast.AST] = field(default_factory=dict)  # classes, functions, assigned names
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # local -> (module, name | None)
    stars: list[str] = field(default_factory=list)
    lazy: dict[str, tuple[str, str]] = field(default_factory=dict)  # X = LazyImport("module", "name")

    @classmethod
    def parse(cls, name: str, path: Path, is_package: bool) -> Module:
        m = cls(name, path, ast.parse(path.read_text(), str(path)), is_package)
        package = name if is_package else name.rpartition(".")[0]
        for stmt, fallback in _top_statements(m.tree.body, flagged=True):
            if fallback and any(n in m.defs or n in m.imports for n in _bound_names(stmt)):
                continue  # an except branch's fallback for a name the normal path binds
            if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                m.defs[stmt.name] = stmt
            elif isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    if isinstance(target, ast.Name):
                        if isinstance(m.defs.get(target.id), ast.ClassDef) and isinstance(stmt.value, ast.Call):
                            continue  # `X = transform(X ...)` after `class X` (ServerArgs = msgspec.defstruct(...))
                        m.defs[target.id] = stmt
                        call = stmt.value
                        if (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "LazyImport"
                                and len(call.args) == 2 and all(isinstance(a, ast.Constant) for a in call.args)):
                            m.lazy[target.id] = (call.args[0].value, call.args[1].value)
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                m.defs[stmt.target.id] = stmt
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname:
                        m.imports[alias.asname] = (alias.name, None)
                    else:
                        top = alias.name.split(".")[0]
                        m.imports[top] = (top, None)
            elif isinstance(stmt, ast.ImportFrom):
                base = stmt.module or ""
                if stmt.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - stmt.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in stmt.names:
                    if alias.name == "*":
                        m.stars.append(base)
                    else:
                        m.imports[alias.asname or alias.name] = (base, alias.name)
        return m


def _bound_names(stmt: ast.AST) -> list[str]:
    if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return [stmt.name]
    if isinstance(stmt, ast.Assign):
        return [t.id for t in stmt.targets if isinstance(t, ast.Name)]
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return [stmt.target.id]
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return [a.asname or a.name.split(".")[0] for a in stmt.names]
    return []


@dataclass
class Symbol:
    """What a name resolves to in SGLang's source."""

    module: Module
    node: ast.AST | None  # None: the module itself
    name: str

    @property
    def is_module(self) -> bool:
        return self.node is None

    @property
    def qualname(self) -> str:
        return self.module.name if self.node is None else f"{self.module.name}.{self.name}"


class Source:
    def __init__(self, root: Path, package: str = "sglang"):
        self.root = root
        self.package = package
        self._modules: dict[str, Module | None] = {}
        self._classes: dict[tuple[str, str], ClassInfo] = {}

    def module(self, name: str) -> Module | None:
        if name not in self._modules:
            found = None
            if name == self.package or name.startswith(self.package + "."):
                base = self.root / Path(*name.split("."))
                if (base / "__init__.py").is_file():
                    found = Module.parse(name, base / "__init__.py", True)
                elif base.with_suffix(".py").is_file():
                    found = Module.parse(name, base.with_suffix(".py"), False)
            self._modules[name] = found
        return self._modules[name]

    def resolve(self, module: str, name: str, _seen: frozenset = frozenset()) -> Symbol | None:
        """`name` as `from module import name` would find it (the source's own modules only)."""
        key = (module, name)
        if key in _seen:
            return None
        seen = _seen | {key}
        m = self.module(module)
        if m is None:
            return None
        if name in m.lazy:
            return self.resolve(*m.lazy[name], seen)
        if name in m.defs:
            return Symbol(m, m.defs[name], name)
        if name in m.imports:
            target, original = m.imports[name]
            if original is None:
                sub = self.module(target)
                return Symbol(sub, None, target) if sub is not None else None
            return self.resolve(target, original, seen) or self._submodule(f"{target}.{original}")
        if m.is_package and (sub := self._submodule(f"{module}.{name}")) is not None:
            return sub
        for star in m.stars:
            if not name.startswith("_") and (found := self.resolve(star, name, seen)) is not None:
                return found
        return None

    def _submodule(self, name: str) -> Symbol | None:
        m = self.module(name)
        return Symbol(m, None, name) if m is not None else None

    def resolve_dotted(self, dotted: str) -> Symbol | None:
        """`package.module.Name` (or a module)."""
        if (m := self.module(dotted)) is not None:
            return Symbol(m, None, dotted)
        module, _, name = dotted.rpartition(".")
        return self.resolve(module, name) if module else None

    def cls(self, symbol: Symbol) -> ClassInfo | None:
        if not isinstance(symbol.node, ast.ClassDef):
            return None
        key = (symbol.module.name, symbol.name)
        if key not in self._classes:
            self._classes[key] = ClassInfo(self, symbol.module, symbol.node)
        return self._classes[key]

    def class_named(self, dotted: str) -> ClassInfo:
        symbol = self.resolve_dotted(dotted)
        info = self.cls(symbol) if symbol is not None else None
        if info is None:
            raise LookupError(f"{dotted} is not a class in sglang {SGLANG_VERSION}")
        return info

    # -- what SGLang accepts and writes ----------------------------------------------------------------
    @cached_property
    def server_args_fields(self) -> dict[str, ast.AST | None]:
        """ServerArgs' fields: those of the namespace classes listed in server_args.py's _INPUT_NAMESPACES."""
        m = self.module("sglang.srt.server_args")
        listing = m.defs.get("_INPUT_NAMESPACES")
        if not isinstance(listing, ast.Assign) or not isinstance(listing.value, ast.List):
            raise LookupError("sglang.srt.server_args._INPUT_NAMESPACES is not a list literal")
        fields: dict[str, ast.AST | None] = {}
        for element in listing.value.elts:
            namespace = self.cls(self.resolve(m.name, element.id))
            if namespace is None:
                raise LookupError(f"ServerArgs namespace {element.id} not found")
            fields.update(namespace.fields)
        return fields

    @cached_property
    def output_keys(self) -> set[str]:
        """Every key the tokenizer manager writes into a generate output or its meta_info (dict
        literals holding them, meta_info[...] = ..., meta_info.update({...}), setdefault), and the
        keys of finish reasons (schedule_batch.py's to_json dicts)."""
        keys: set[str] = set()
        for module in ("sglang.srt.managers.tokenizer_manager", "sglang.srt.managers.schedule_batch"):
            for node in ast.walk(self.module(module).tree):
                if isinstance(node, ast.Dict):
                    found = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                    if found & {"meta_info", "output_ids", "finish_reason", "type", "id"}:
                        keys |= found
                elif isinstance(node, (ast.Assign, ast.AugAssign)):
                    for target in getattr(node, "targets", [getattr(node, "target", None)]):
                        if (isinstance(target, ast.Subscript) and plain_name(target.value) == "meta_info"
                                and isinstance(target.slice, ast.Constant)):
                            keys.add(target.slice.value)
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and plain_name(node.func.value) == "meta_info" and node.func.attr in ("update", "setdefault")):
                    for arg in node.args[:1]:
                        if isinstance(arg, ast.Dict):
                            keys |= {k.value for k in arg.keys if isinstance(k, ast.Constant)}
                        elif isinstance(arg, ast.Constant):
                            keys.add(arg.value)
        return keys

    @cached_property
    def finish_types(self) -> set[str]:
        types = set()
        for node in ast.walk(self.module("sglang.srt.managers.schedule_batch").tree):
            if isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values):
                    if isinstance(k, ast.Constant) and k.value == "type" and isinstance(v, ast.Constant):
                        types.add(v.value)
        return types


def plain_name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


# -- classes and functions ------------------------------------------------------------------------------

@dataclass
class Param:
    name: str
    kind: str  # "posonly", "pos", "kw", "*", "**"
    default: ast.AST | None
    index: int | None  # position among positional parameters (self excluded)


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef, bound: bool) -> list[Param]:
    a = fn.args
    positional = [("posonly", x) for x in a.posonlyargs] + [("pos", x) for x in a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = []
    skip = bound and positional and not is_staticmethod(fn)
    for i, ((kind, arg), default) in enumerate(zip(positional, defaults)):
        if skip and i == 0:
            continue
        out.append(Param(arg.arg, kind, default, i - (1 if skip else 0)))
    if a.vararg:
        out.append(Param(a.vararg.arg, "*", None, None))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append(Param(arg.arg, "kw", default, None))
    if a.kwarg:
        out.append(Param(a.kwarg.arg, "**", None, None))
    return out


def is_staticmethod(fn) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)


def call_kind(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """"sync", "coroutine" (async def) or "async generator" (async def with a yield)."""
    if isinstance(fn, ast.FunctionDef):
        return "sync"
    body = ast.Module(body=fn.body, type_ignores=[])
    nested = {id(n) for n in ast.walk(body) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))}
    for node in ast.walk(body):
        if isinstance(node, (ast.Yield, ast.YieldFrom)) and not _inside(node, body, nested):
            return "async generator"
    return "coroutine"


def _inside(target: ast.AST, root: ast.AST, nested_ids: set[int]) -> bool:
    """Whether `target` sits inside a nested function of `root`."""
    def walk(node, depth):
        if node is target:
            return depth > 0
        for child in ast.iter_child_nodes(node):
            found = walk(child, depth + (1 if id(child) in nested_ids else 0))
            if found is not None:
                return found
        return None
    return bool(walk(root, 0))


def bind_problems(fn, qualname: str, n_positional: int, keywords: list[str], bound: bool,
                  open_ended: bool = False) -> list[str]:
    """What is wrong with calling `fn` with `n_positional` positional arguments and `keywords`
    (`open_ended`: the call also passes *args / **kwargs, so missing arguments cannot be told)."""
    params = parameters(fn, bound)
    positional = [p for p in params if p.kind in ("posonly", "pos")]
    has_var = any(p.kind == "*" for p in params)
    has_kwargs = any(p.kind == "**" for p in params)
    problems = []
    if n_positional > len(positional) and not has_var:
        problems.append(f"{qualname} takes at most {len(positional)} positional arguments, the call passes {n_positional}")
    by_name = {p.name: p for p in params if p.kind in ("pos", "kw")}
    for k in keywords:
        p = by_name.get(k)
        if p is None and not has_kwargs:
            problems.append(f"{qualname} has no parameter {k!r}")
        elif p is not None and p.index is not None and p.index < n_positional:
            problems.append(f"{qualname} gets {k!r} twice")
    if not open_ended:
        for p in positional[n_positional:]:
            if p.default is None and p.name not in keywords:
                problems.append(f"{qualname} requires {p.name!r}")
        for p in params:
            if p.kind == "kw" and p.default is None and p.name not in keywords:
                problems.append(f"{qualname} requires keyword {p.name!r}")
    return problems


class ClassInfo:
    def __init__(self, src: Source, module: Module, node: ast.ClassDef):
        self.src, self.module, self.node = src, module, node
        self.name = node.name

    @property
    def qualname(self) -> str:
        return f"{self.module.name}.{self.name}"

    @cached_property
    def bases(self) -> list[ClassInfo]:
        out = []
        for base in self.node.bases:
            symbol = None
            if isinstance(base, ast.Name):
                symbol = self.src.resolve(self.module.name, base.id)
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                mod = self.src.resolve(self.module.name, base.value.id)
                if mod is not None and mod.is_module:
                    symbol = self.src.resolve(mod.module.name, base.attr)
            if symbol is not None and (info := self.src.cls(symbol)) is not None:
                out.append(info)
        return out

    @cached_property
    def mro(self) -> list[ClassInfo]:
        out: list[ClassInfo] = []
        for c in [self] + [m for b in self.bases for m in b.mro]:
            if all(c is not seen for seen in out):
                out.append(c)
        return out

    def method(self, name: str):
        for c in self.mro:
            for stmt in _top_statements(c.node.body):
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                    return stmt
        return None

    @cached_property
    def fields(self) -> dict[str, ast.AST | None]:
        """Dataclass / msgspec fields (annotated class attributes, bases first; ClassVar left out)."""
        if self.qualname == "sglang.srt.server_args.ServerArgs" and "_INPUT_NAMESPACES" in self.module.defs:
            return self.src.server_args_fields
        out: dict[str, ast.AST | None] = {}
        for c in reversed(self.mro):
            for stmt in c.node.body:
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and "ClassVar" not in ast.unparse(stmt.annotation)):
                    out[stmt.target.id] = field_default(stmt.value)
        return out

    @cached_property
    def attributes(self) -> set[str]:
        """Class-level names and every `self.<name> = ...` in its methods (bases included)."""
        out: set[str] = set()
        for c in self.mro:
            for stmt in _top_statements(c.node.body):
                if isinstance(stmt, ast.Assign):
                    out |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
                elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    out.add(stmt.target.id)
            for node in ast.walk(c.node):
                targets = node.targets if isinstance(node, ast.Assign) else (
                    [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
                for t in targets:
                    if isinstance(t, ast.Attribute) and plain_name(t.value) == "self":
                        out.add(t.attr)
        return out

    @property
    def is_record(self) -> bool:
        """A dataclass or msgspec Struct: constructed from its fields (keywords)."""
        decorated = any("dataclass" in ast.unparse(d) for d in self.node.decorator_list)
        return decorated or any(
            "Struct" in ast.unparse(b) for c in self.mro for b in c.node.bases) or bool(self.fields) and not self.method("__init__")


def field_default(value: ast.AST | None) -> ast.AST | None:
    """A field's default expression (`field(default=...)` unwrapped); None: required."""
    if value is None:
        return None
    if isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] == "field":
        for kw in value.keywords:
            if kw.arg == "default":
                return kw.value
            if kw.arg == "default_factory":
                return kw.value
        return None
    return value
