"""Write the sync facade's source from the async SDK: ``python -m dsec.sdk._sync.codegen``.

The blocking classes (``DSec``, ``SyncSandbox``, ``SyncPty``) are derived mechanically from the
async ones, as before; what this adds is that the derivation is written out as checked-in source
(``dsec/sdk/_generated_sync.py``), so a type checker sees every method with its real signature
instead of ``__getattr__ -> Any``. Run with ``--check`` to fail when the checked-in file is stale
(CI does, through ``tests/sdk/test_sync_codegen.py``).

Each generated method forwards to the same runtime machinery as :class:`SyncWrapper`'s own
(``_dsec_call``, ``_dsec_get``...), so the facade's behaviour is exactly the mechanical one;
only the text is new. Anything the generator does not know how to write (a classmethod, a
default that is not a plain expression) stops it with an error rather than guessing.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib
import inspect
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from dsec.sdk._sync.signatures import _sync_signature

TARGET: Final = Path(__file__).resolve().parents[1] / "_generated_sync.py"


@dataclass(frozen=True)
class ClassSpec:
    sync_name: str
    module: str
    async_name: str
    wrap: tuple[str, ...]
    doc: str


SPECS: Final = (
    ClassSpec(
        "SyncPty",
        "dsec.sdk._pty",
        "Pty",
        (),
        "Blocking handle on a program on a terminal: the methods of :class:`Pty`, without ``await``.",
    ),
    ClassSpec(
        "SyncSandbox",
        "dsec.sdk.client",
        "Sandbox",
        ("SyncPty",),
        "Blocking handle on one sandbox: the methods of :class:`Sandbox`, without ``await``.",
    ),
    ClassSpec(
        "DSec",
        "dsec.sdk.client",
        "DSecClient",
        ("SyncSandbox",),
        "Blocking DSec client: the methods of :class:`DSecClient`, without ``await``.",
    ),
)
# Names the translation introduces, and where they come from.
_INTRODUCED: Final = {"Iterator": "collections.abc", "AbstractContextManager": "contextlib"}


class CodegenError(Exception):
    """The async SDK has something the generator does not know how to write."""


class _Imports:
    """Where each name used in an annotation or default comes from, read off the defining
    module's own import statements (``TYPE_CHECKING`` blocks included)."""

    def __init__(self) -> None:
        self._origins: dict[str, dict[str, tuple[str, str | None]]] = {}
        self.needed: dict[str, tuple[str, str | None]] = {}

    def _module_map(self, module: str) -> dict[str, tuple[str, str | None]]:
        if module not in self._origins:
            tree = ast.parse(Path(_source_file(module)).read_text())
            found: dict[str, tuple[str, str | None]] = {}
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    for alias in node.names:
                        found[alias.asname or alias.name] = (node.module, alias.name)
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        found[alias.asname or alias.name] = (alias.name, None)
            for node in tree.body:
                if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    found.setdefault(node.name, (module, node.name))
                elif isinstance(node, ast.Assign | ast.AnnAssign):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        if isinstance(t, ast.Name):
                            found.setdefault(t.id, (module, t.id))
            self._origins[module] = found
        return self._origins[module]

    def use(self, text: str, module: str, local: set[str]) -> None:
        names = sorted({n.id for n in ast.walk(ast.parse(text, mode="eval")) if isinstance(n, ast.Name)})
        for name in names:
            if name in local or name in self.needed or hasattr(builtins, name):
                continue
            origin = _INTRODUCED.get(name)
            where = (origin, name) if origin else self._module_map(module).get(name)
            if where is None:
                raise CodegenError(f"{name!r} (in {text!r}) is not imported by {module}")
            self.needed[name] = where

    def render(self) -> list[str]:
        lines = []
        for name, (module, attr) in sorted(self.needed.items(), key=lambda kv: (kv[1][0], kv[0])):
            if attr is None:
                lines.append(f"import {module}" if module == name else f"import {module} as {name}")
            elif attr == name:
                lines.append(f"from {module} import {name}")
            else:
                lines.append(f"from {module} import {attr} as {name}")
        return lines


def _source_file(module: str) -> str:
    path = inspect.getsourcefile(importlib.import_module(module))
    if path is None:
        raise CodegenError(f"no source for {module}")
    return path


def _default_sources(func: Callable[..., Any]) -> dict[str, str]:
    """Each parameter's default as written in the source (``0o644``, not ``420``)."""
    source = textwrap.dedent(inspect.getsource(func))
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    args = node.args
    out: dict[str, str] = {}
    positional = args.posonlyargs + args.args
    for arg, default in zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True):
        out[arg.arg] = ast.get_source_segment(source, default) or ast.unparse(default)
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        if kw_default is not None:
            out[arg.arg] = ast.get_source_segment(source, kw_default) or ast.unparse(kw_default)
    return out


def _docstring(doc: str | None, indent: str) -> list[str]:
    if not doc:
        return []
    text = inspect.cleandoc(doc)
    if '"""' in text:
        raise CodegenError(f"docstring with triple quotes: {text[:40]!r}")
    prefix = 'r"""' if "\\" in text else '"""'
    body = textwrap.indent(text, indent).lstrip()
    if "\n" in text:
        return [f'{indent}{prefix}{body}\n{indent}"""']
    return [f'{indent}{prefix}{body}"""']


class _Writer:
    def __init__(self) -> None:
        self.imports = _Imports()
        self.names = {s.async_name: s.sync_name for s in SPECS}
        self.local = {s.sync_name for s in SPECS}

    shadowed: set[str] = set()

    def unshadow(self, text: str) -> str:
        for name in self.shadowed:
            text = re.sub(rf"(?<![\w.]){name}\b", f"builtins.{name}", text)
        return text

    def signature(self, func: Callable[..., Any], *, is_init: bool = False) -> tuple[str, str, str]:
        """(parameter list, return annotation, call arguments) of the sync method."""
        sig = _sync_signature(func, {}, self.names, is_init=is_init, drop_first=False)
        if sig is None:
            raise CodegenError(f"no signature for {func.__qualname__}")
        module = func.__module__
        defaults = _default_sources(func)
        params, call = [], []
        star_done = False
        seen_posonly = False
        for i, p in enumerate(sig.parameters.values()):
            if i == 0:
                params.append(p.name)  # self
                continue
            ann = ""
            if p.annotation is not p.empty:
                text = self.unshadow(_annotation_text(p.annotation))
                self.imports.use(text, module, self.local)
                ann = f": {text}"
            default = ""
            if p.default is not p.empty:
                src = defaults[p.name]
                self.imports.use(src, module, self.local)
                default = f" = {src}" if ann else f"={src}"
            if p.kind is p.POSITIONAL_ONLY:
                seen_posonly = True
            elif seen_posonly:
                params.append("/")
                seen_posonly = False
            if p.kind is p.VAR_POSITIONAL:
                params.append(f"*{p.name}{ann}")
                call.append(f"*{p.name}")
                star_done = True
            elif p.kind is p.VAR_KEYWORD:
                params.append(f"**{p.name}{ann}")
                call.append(f"**{p.name}")
            elif p.kind is p.KEYWORD_ONLY:
                if not star_done:
                    params.append("*")
                    star_done = True
                params.append(f"{p.name}{ann}{default}")
                call.append(f"{p.name}={p.name}")
            else:
                params.append(f"{p.name}{ann}{default}")
                call.append(p.name)
        if seen_posonly:
            params.append("/")
        ret = sig.return_annotation
        ret_text = "None" if ret is sig.empty else self.unshadow(_annotation_text(ret))
        self.imports.use(ret_text, module, self.local)
        return ", ".join(params), ret_text, ", ".join(call)

    def method(self, name: str, func: Callable[..., Any]) -> list[str]:
        if inspect.isasyncgenfunction(inspect.unwrap(func)) and not inspect.isasyncgenfunction(func):
            raise CodegenError(f"{func.__qualname__}: async context manager factories are not supported")
        params, ret, call = self.signature(func)
        args = f'"{name}", {call}' if call else f'"{name}"'
        invoke = f"self._dsec_call({args})"
        lines = [f"    def {name}({params}) -> {ret}:", *_docstring(func.__doc__, "        ")]
        lines.append(f"        {invoke}" if ret == "None" else f'        return cast("{ret}", {invoke})')
        return lines

    def attribute(self, name: str, ann: str, module: str, *, settable: bool, doc: str | None) -> list[str]:
        ann = self.unshadow(_translate(ann, self.names))
        self.imports.use(ann, module, self.local)
        lines = ["    @property", f"    def {name}(self) -> {ann}:", *_docstring(doc, "        ")]
        lines.append(f'        return cast("{ann}", self._dsec_get("{name}"))')
        if settable:
            lines += ["", f"    @{name}.setter", f"    def {name}(self, value: {ann}) -> None:"]
            lines.append(f'        self._dsec_set("{name}", value)')
        return lines

    def klass(self, spec: ClassSpec) -> list[str]:
        cls = getattr(importlib.import_module(spec.module), spec.async_name)
        # A method named like a builtin (``list``) hides it in the class body: annotations
        # there name the builtin through ``builtins.``, as the async source already does.
        self.shadowed = {n for n in dir(cls) if not n.startswith("_") and hasattr(builtins, n)}
        alias = _module_alias(spec.module)
        self.imports.needed[alias] = (spec.module, None)
        wrap = f", wrap=[{', '.join(spec.wrap)}]" if spec.wrap else ""
        out = [f"class {spec.sync_name}(SyncWrapper, async_cls={alias}.{spec.async_name}{wrap}):"]
        out += _docstring(spec.doc, "    ")
        out += ["", *self.init(cls)]
        seen: set[str] = set()
        for klass in cls.__mro__:
            if klass is object:
                continue
            for name, ann in vars(klass).get("__annotations__", {}).items():
                if name.startswith("_") or name in seen:
                    continue
                seen.add(name)
                out += ["", *self.attribute(name, ann, klass.__module__, settable=True, doc=None)]
            for name, raw in vars(klass).items():
                if name.startswith("_") or name in seen:
                    continue
                seen.add(name)
                if isinstance(raw, property):
                    ann = raw.fget.__annotations__.get("return", "Any") if raw.fget else "Any"
                    out += ["", *self.attribute(name, ann, klass.__module__, settable=False, doc=raw.__doc__)]
                elif inspect.isfunction(raw):
                    out += ["", *self.method(name, raw)]
                else:
                    raise CodegenError(f"{klass.__name__}.{name}: {type(raw).__name__} is not supported")
        out += self.dunders(cls)
        return out

    def init(self, cls: type) -> list[str]:
        params, _, call = self.signature(cls.__init__, is_init=True)  # type: ignore[misc]
        return [
            f"    def __init__({params}) -> None:",
            f"        self._dsec_construct({call})",
        ]

    def dunders(self, cls: type) -> list[str]:
        out: list[str] = []
        if hasattr(cls, "__aenter__"):
            _, ret, _ = self.signature(cls.__aenter__)
            call = 'self._dsec_call("__aenter__")'
            out += ["", f"    def __enter__(self) -> {ret}:", f'        return cast("{ret}", {call})']
        if hasattr(cls, "__aexit__"):
            params, ret, call = self.signature(cls.__aexit__)
            out += [
                "",
                f"    def __exit__({params}) -> {ret}:",
                f'        self._dsec_call("__aexit__", {call})',
            ]
        for name in ("__aiter__", "__anext__"):
            if hasattr(cls, name):
                raise CodegenError(f"{cls.__name__}.{name}: iterating the object itself is not supported")
        return out


def _annotation_text(ann: Any) -> str:
    return ann if isinstance(ann, str) else inspect.formatannotation(ann)


def _translate(ann: str, names: dict[str, str]) -> str:
    for old, new in names.items():
        ann = re.sub(rf"(?<![\w.]){re.escape(old)}\b", new, ann)
    return ann


def _module_alias(module: str) -> str:
    return "_" + module.rsplit(".", 1)[-1].lstrip("_")


HEADER: Final = '''"""The blocking SDK, generated from the async one by ``python -m dsec.sdk._sync.codegen``.

Do not edit: change the async classes and run the command again (a test fails while this file
is stale). Each method forwards to the async method of the same name through the sync facade's
portal (:mod:`dsec.sdk._sync`); the file exists so that type checkers see real signatures.
"""
'''


def generate() -> str:
    writer = _Writer()
    bodies = [writer.klass(spec) for spec in SPECS]
    writer.imports.needed.setdefault("cast", ("typing", "cast"))
    writer.imports.needed.setdefault("SyncWrapper", ("dsec.sdk._sync", "SyncWrapper"))
    lines = [HEADER, "from __future__ import annotations", "", *writer.imports.render(), ""]
    for body in bodies:
        lines += ["", "", *body]
    lines += ["", "", f"__all__ = {sorted(s.sync_name for s in SPECS)!r}".replace("'", '"'), ""]
    return _format("\n".join(lines))


def _format(source: str) -> str:
    """The project's formatter over the text, so the checked-in file is exactly what it makes."""
    ruff = Path(sys.executable).with_name("ruff")
    cmd = [str(ruff)] if ruff.exists() else [sys.executable, "-m", "ruff"]
    root = Path(__file__).resolve().parents[4]
    done = subprocess.run(
        [*cmd, "format", "--stdin-filename", str(TARGET), "-"],
        input=source, capture_output=True, text=True, cwd=root, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise CodegenError(f"ruff format failed: {done.stderr.strip()}")
    fixed = subprocess.run(
        [*cmd, "check", "--fix", "--quiet", "--stdin-filename", str(TARGET), "-"],
        input=done.stdout, capture_output=True, text=True, cwd=root, check=False,
    )  # fmt: skip
    return fixed.stdout if fixed.stdout else done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dsec.sdk._sync.codegen", description="Write the sync SDK."
    )
    parser.add_argument("--check", action="store_true", help="fail if the checked-in file is not current")
    opts = parser.parse_args(argv)
    source = generate()
    current = TARGET.read_text() if TARGET.exists() else ""
    if opts.check:
        if source != current:
            print(f"{TARGET} is stale: run python -m dsec.sdk._sync.codegen", file=sys.stderr)
            return 1
        return 0
    if source != current:
        TARGET.write_text(source)
        print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
