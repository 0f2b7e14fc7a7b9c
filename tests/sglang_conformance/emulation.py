"""The emulated `sglang` package the tests run the adapter against (tests/sglang_emulation) checked
against SGLang's source: it declares only what SGLang has, the same modules and names, signatures
whose parameters, kinds, defaults and async-ness match, fields with the same defaults, constants
with the same values (`check_emulation`)."""

from __future__ import annotations

import ast
from pathlib import Path

from fastgrpo.engines.sglang.adapter import SGLANG_VERSION
from tests.sglang_conformance.reading import (NOT_LITERAL, Source, Symbol, call_kind, field_default,
                                              is_staticmethod, literal, parameters, plain_name)

EMULATION = Path(__file__).resolve().parents[1] / "sglang_emulation"


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
    mine = literal(stmt.value)
    if mine is NOT_LITERAL:
        return []
    real = literal(getattr(sym.node, "value", None))
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
        mine, theirs = field_default(s.value), real_fields[fname]
        if mine is None and theirs is not None:
            continue  # stricter than sglang: fine
        if mine is not None and theirs is None:
            problems.append(f"{where}.{fname} has a default here; sglang requires it")
            continue
        a, b = literal(mine), literal(theirs)
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
            problems += compare_signature(stmt, theirs, f"{where}.{stmt.name}", bound=not is_staticmethod(stmt))
    # instance attributes the emulation sets must be ones sglang sets
    for sub in ast.walk(node):
        targets = sub.targets if isinstance(sub, ast.Assign) else ([sub.target] if isinstance(sub, ast.AnnAssign) else [])
        for t in targets:
            if isinstance(t, ast.Attribute) and plain_name(t.value) == "self" and not t.attr.startswith("_"):
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
            a, b = literal(p.default), literal(q.default)
            if a is not NOT_LITERAL and b is not NOT_LITERAL and a != b:
                problems.append(f"{where}: {p.name!r} defaults to {a!r} here, {b!r} in sglang")
    names = {p.name for p in emulated}
    for q in real.values():
        if q.kind in ("pos", "posonly", "kw") and q.default is None and q.name not in names:
            problems.append(f"{where}: sglang requires {q.name!r}, the emulation does not take it")
    return problems
