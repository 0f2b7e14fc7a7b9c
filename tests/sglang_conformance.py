"""SGLang's own source as the reference the SGLang adapter and its emulation are checked against.

`source()` fetches the sglang wheel fastgrpo pins (`pip download --no-deps`, cached outside the
checkout under ~/.cache/fastgrpo, its sha256 checked) and unpacks its Python files. Nothing of it
is imported: CUDA builds, kernels and torch 2.14 stay out of this process. `Source` reads modules
with `ast` and answers what the adapter needs to know: does this module define that name (through
its imports, star imports and lazy re-exports), what are a function's parameters, a class's
methods (through its bases), dataclass / msgspec fields and instance attributes, which ServerArgs
fields exist, which keys SGLang writes into a generate output.

Three checks use it (tests/test_sglang_conformance.py runs them):
- `check_adapter(source, code)`: every SGLang import of the adapter, every attribute it reads and
  call it makes on an SGLang module, class or object (arguments bound against the real signature,
  constructor keywords against the real fields, coroutines and async generators consumed as such),
  and every string key it reads from a dict.
- `check_emulation(source, root)`: the emulated `sglang` package the tests run the adapter against
  (tests/sglang_emulation) declares only what SGLang has: the same modules and names, signatures
  whose parameters, kinds, defaults and async-ness match, fields with the same defaults, constants
  with the same values.
- `check_keys(source, kind, keys)`: ServerArgs fields, SamplingParams fields, generate output keys.
"""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from fastgrpo.engines.sglang.adapter import SGLANG_VERSION

# the one wheel read (sglang publishes one per CPython version and platform; their Python files agree)
WHEEL = f"sglang-{SGLANG_VERSION}-cp311-cp311-manylinux_2_34_x86_64.whl"
WHEEL_SHA256 = "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"
EMULATION = Path(__file__).parent / "sglang_emulation"


class SourceUnavailable(RuntimeError):
    """The pinned wheel could not be fetched (no network to PyPI)."""


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "fastgrpo" / f"sglang-{SGLANG_VERSION}"


def fetch_wheel() -> Path:
    """The pinned wheel, downloaded once into the cache; raises SourceUnavailable if pip cannot get it."""
    directory = cache_dir()
    wheel = directory / WHEEL
    if not wheel.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                   "--python-version", "3.11", "--implementation", "cp", "--platform", "manylinux_2_34_x86_64",
                   f"sglang=={SGLANG_VERSION}", "-d", tmp]
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise SourceUnavailable(f"pip download sglang=={SGLANG_VERSION} failed: {e}") from e
            got = Path(tmp) / WHEEL
            if run.returncode != 0 or not got.is_file():
                raise SourceUnavailable(f"pip download sglang=={SGLANG_VERSION} failed: "
                                        f"{(run.stderr or run.stdout).strip()[-400:]}")
            os.replace(got, wheel)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        wheel.unlink()
        raise RuntimeError(f"{WHEEL} has sha256 {digest}, not the pinned {WHEEL_SHA256}")
    return wheel


def source_root() -> Path:
    """The wheel's Python files and METADATA, unpacked once next to it."""
    wheel = fetch_wheel()
    root = wheel.parent / "src"
    if (root / ".complete").is_file():
        return root
    with tempfile.TemporaryDirectory(dir=wheel.parent) as tmp:
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                path = Path(name)
                if path.is_absolute() or ".." in path.parts:
                    continue
                if (name.startswith("sglang/") and name.endswith(".py")) or name.endswith(".dist-info/METADATA"):
                    z.extract(name, tmp)
        (Path(tmp) / ".complete").write_text(WHEEL_SHA256)
        if root.exists():
            shutil.rmtree(root, ignore_errors=True)
        try:
            os.replace(tmp, root)
        except OSError:  # another process unpacked it meanwhile
            if not (root / ".complete").is_file():
                raise
        Path(tmp).mkdir(exist_ok=True)  # for TemporaryDirectory's cleanup
    return root


_SOURCE: Source | None = None


def source() -> Source:
    global _SOURCE
    if _SOURCE is None:
        _SOURCE = Source(source_root())
    return _SOURCE


def metadata_requirements() -> list[str]:
    """The wheel's Requires-Dist lines."""
    meta = next((source_root()).glob("sglang-*.dist-info/METADATA"))
    return [line.split(":", 1)[1].strip() for line in meta.read_text().splitlines() if line.startswith("Requires-Dist:")]


# -- reading modules ------------------------------------------------------------------------------------

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


_literal = literal


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
                        if (isinstance(target, ast.Subscript) and _name(target.value) == "meta_info"
                                and isinstance(target.slice, ast.Constant)):
                            keys.add(target.slice.value)
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and _name(node.func.value) == "meta_info" and node.func.attr in ("update", "setdefault")):
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


def _name(node: ast.AST) -> str | None:
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
    skip = bound and positional and not _is_staticmethod(fn)
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


def _is_staticmethod(fn) -> bool:
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
                    out[stmt.target.id] = _field_default(stmt.value)
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
                    if isinstance(t, ast.Attribute) and _name(t.value) == "self":
                        out.add(t.attr)
        return out

    @property
    def is_record(self) -> bool:
        """A dataclass or msgspec Struct: constructed from its fields (keywords)."""
        decorated = any("dataclass" in ast.unparse(d) for d in self.node.decorator_list)
        return decorated or any(
            "Struct" in ast.unparse(b) for c in self.mro for b in c.node.bases) or bool(self.fields) and not self.method("__init__")


def _field_default(value: ast.AST | None) -> ast.AST | None:
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


# -- the adapter's uses -----------------------------------------------------------------------------------

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
            text = arg.annotation.value if isinstance(arg.annotation, ast.Constant) else ast.unparse(arg.annotation)
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
                            if isinstance(t, ast.Attribute) and _name(t.value) == "self":
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
                return _Typed("function", base.symbol, cls=cls, fn=fn, bound=base.kind == "instance" or _is_staticmethod(fn),
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


# -- the emulation's interface ----------------------------------------------------------------------------

def emulated_modules(root: Path = EMULATION) -> list[tuple[str, Path]]:
    package = root / "sglang"
    out = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def check_emulation(src: Source, root: Path = EMULATION) -> tuple[list[str], list[str]]:
    """(problems, what was checked) for every public name of the emulated sglang package."""
    problems: list[str] = []
    checked: list[str] = []
    for name, path in emulated_modules(root):
        if src.module(name) is None:
            problems.append(f"{name}: sglang {SGLANG_VERSION} has no such module")
            continue
        tree = ast.parse(path.read_text(), str(path))
        for stmt in tree.body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.Expr)):
                continue
            names = ([stmt.name] if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else
                     [t.id for t in getattr(stmt, "targets", [getattr(stmt, "target", None)]) if isinstance(t, ast.Name)])
            for local in names:
                if local.startswith("_") and local != "__version__":
                    continue
                sym = src.resolve(name, local)
                where = f"{name}.{local}"
                if sym is None:
                    problems.append(f"{where}: sglang {SGLANG_VERSION} has no such name")
                    continue
                checked.append(where)
                if isinstance(stmt, ast.ClassDef):
                    problems += _compare_class(src, stmt, sym, where)
                elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if not isinstance(sym.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        problems.append(f"{where}: a function here, not in sglang")
                    else:
                        problems += compare_signature(stmt, sym.node, where, bound=False)
                else:
                    problems += _compare_value(stmt, sym, where)
    return problems, checked


def _compare_value(stmt, sym: Symbol, where: str) -> list[str]:
    mine = _literal(stmt.value)
    if mine is NOT_LITERAL:
        return []
    real = _literal(getattr(sym.node, "value", None))
    if real is NOT_LITERAL:
        if isinstance(sym.node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or sym.is_module:
            return [f"{where}: a constant here, a {type(sym.node).__name__ if sym.node else 'module'} in sglang"]
        return []
    return [] if mine == real else [f"{where} = {mine!r} here, {real!r} in sglang"]


def _compare_class(src: Source, node: ast.ClassDef, sym: Symbol, where: str) -> list[str]:
    real = src.cls(sym)
    if real is None:
        return [f"{where}: a class here, not in sglang"]
    problems = []
    emulated_fields = {s.target.id: s for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    real_fields = real.fields
    for fname, s in emulated_fields.items():
        if fname.startswith("_"):
            continue
        if fname not in real_fields:
            if not (fname in real.attributes):
                problems.append(f"{where}.{fname}: no such field in sglang")
            continue
        mine, theirs = _field_default(s.value), real_fields[fname]
        if mine is None and theirs is not None:
            continue  # stricter than sglang: fine
        if mine is not None and theirs is None:
            problems.append(f"{where}.{fname} has a default here; sglang requires it")
            continue
        a, b = _literal(mine), _literal(theirs)
        if a is not NOT_LITERAL and b is not NOT_LITERAL and a != b:
            problems.append(f"{where}.{fname} defaults to {a!r} here, {b!r} in sglang")
    if emulated_fields:
        missing = [f for f, d in real_fields.items() if d is None and f not in emulated_fields and not f.startswith("_")]
        problems += [f"{where}: sglang requires field {f!r}, which the emulation lacks" for f in missing]
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if stmt.name.startswith("_") and stmt.name != "__init__":
                continue
            if stmt.name == "__init__" and real.is_record:
                problems.append(f"{where}.__init__: sglang builds {real.name} from its fields; declare them instead")
                continue
            theirs = real.method(stmt.name)
            if theirs is None:
                problems.append(f"{where}.{stmt.name}: no such method in sglang")
                continue
            problems += compare_signature(stmt, theirs, f"{where}.{stmt.name}", bound=not _is_staticmethod(stmt))
    # instance attributes the emulation sets must be ones sglang sets
    for sub in ast.walk(node):
        targets = sub.targets if isinstance(sub, ast.Assign) else ([sub.target] if isinstance(sub, ast.AnnAssign) else [])
        for t in targets:
            if isinstance(t, ast.Attribute) and _name(t.value) == "self" and not t.attr.startswith("_"):
                if t.attr not in real.attributes and t.attr not in real_fields:
                    problems.append(f"{where}.{t.attr}: sglang's {real.name} has no such attribute")
    return sorted(set(problems))


def compare_signature(mine, theirs, where: str, bound: bool) -> list[str]:
    """The emulated function accepts only calls sglang's accepts, the same way."""
    problems = []
    kind_mine, kind_theirs = call_kind(mine), call_kind(theirs)
    if kind_mine != kind_theirs:
        problems.append(f"{where} is a {kind_mine} here, a {kind_theirs} in sglang")
    real = {p.name: p for p in parameters(theirs, bound)}
    real_var = {p.kind for p in real.values()}
    emulated = parameters(mine, bound)
    for p in emulated:
        if p.kind in ("*", "**"):
            if p.kind not in real_var:
                problems.append(f"{where} takes {'*' if p.kind == '*' else '**'}{p.name} here, not in sglang")
            continue
        q = real.get(p.name)
        if q is None:
            if "**" in real_var and p.kind == "kw":
                continue
            problems.append(f"{where}: parameter {p.name!r} is not sglang's")
            continue
        if p.kind in ("pos", "posonly") and (q.kind not in ("pos", "posonly") or q.index != p.index):
            problems.append(f"{where}: {p.name!r} is positional #{p.index} here, not in sglang")
        if p.kind == "kw" and q.kind == "posonly":
            problems.append(f"{where}: {p.name!r} is keyword here, positional-only in sglang")
        if p.default is not None and q.default is None:
            problems.append(f"{where}: {p.name!r} is optional here, required in sglang")
        elif p.default is not None:
            a, b = _literal(p.default), _literal(q.default)
            if a is not NOT_LITERAL and b is not NOT_LITERAL and a != b:
                problems.append(f"{where}: {p.name!r} defaults to {a!r} here, {b!r} in sglang")
    names = {p.name for p in emulated}
    for q in real.values():
        if q.kind in ("pos", "posonly", "kw") and q.default is None and q.name not in names:
            problems.append(f"{where}: sglang requires {q.name!r}, the emulation does not take it")
    return problems


# -- a model's weight loading, run from SGLang's own source -------------------------------------------
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
