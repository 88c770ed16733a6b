"""Code in a submission that reaches for the machinery that judges it.

The code under test runs inside the test runner's process: it can patch pytest's report objects,
register an ``atexit`` handler, end the process before a failing test runs, replace builtins or
entries of ``sys.modules``, or find the grader's channel and write to it. No sandboxing inside
one process stops that, so the grader looks at the source it is about to apply: each changed
Python file is parsed (an AST, so comments, strings and formatting do not matter and an
``import os as o; o._exit`` is still seen) and every reference to such a thing is reported with
its location. Native code (an extension module) cannot be read this way and is reported as such.

This is a tripwire, not a proof: code can always reach the same things in ways no static check
sees (a decoded string passed to ``exec`` is flagged as dynamic code, but not what it does). A
flag is a reason for a human to look, and in strict grading a reason to score 0.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

__all__ = ["Finding", "scan_change", "scan_python"]

# Modules whose import alone means the code under test talks to the runner or the process.
_MODULES = {
    "pytest": "test framework",
    "_pytest": "test framework internals",
    "pluggy": "test framework plugin machinery",
    "unittest": "test framework",
    "atexit": "exit handler",
    "builtins": "builtins patching",
    "gc": "object graph walking (finds the runner's objects)",
    "ctypes": "raw memory access",
    "faulthandler": "process-level hook",
    "signal": "signal handling",
}
# (module, attribute) pairs, matched through any alias of the module.
_ATTRS = {
    ("os", "_exit"): "process exit",
    ("os", "abort"): "process exit",
    ("os", "kill"): "signals a process",
    ("os", "killpg"): "signals a process",
    ("os", "write"): "raw write to a file descriptor",
    ("os", "dup2"): "file descriptor redirection",
    ("os", "fork"): "forks the runner",
    ("sys", "modules"): "sys.modules patching",
    ("sys", "_getframe"): "stack frame walking",
    ("sys", "settrace"): "tracing hook",
    ("sys", "setprofile"): "profiling hook",
    ("sys", "addaudithook"): "audit hook",
    ("sys", "excepthook"): "exception hook",
    ("sys", "meta_path"): "import system patching",
    ("sys", "path_hooks"): "import system patching",
    ("importlib", "import_module"): "dynamic import",
}
# Bare names (builtins), and attribute names that mean the same on any object.
_NAMES = {
    "__builtins__": "builtins patching",
    "__import__": "dynamic import",
    "exec": "dynamic code",
    "eval": "dynamic code",
    "compile": "dynamic code",
}
_ANY_ATTRS = {
    "__builtins__": "builtins patching",
    "f_back": "stack frame walking",
    "f_globals": "stack frame walking",
    "f_locals": "stack frame walking",
    "gi_frame": "stack frame walking",
    "__closure__": "reads another function's closed-over state",
    "cell_contents": "reads another function's closed-over state",
}
# A private internal's name as a string: getattr(os, "_exit") reaches what os._exit does.
_NAME_STRINGS = frozenset(
    {"_exit", "_getframe", "__builtins__", "__import__", "f_globals", "f_back", "excepthook"}
    | {"settrace", "setprofile", "meta_path", "path_hooks", "addaudithook", "import_module"}
)
_NATIVE_SUFFIXES = (".so", ".pyd")
_STRINGS = ("/proc/self/fd", "/dev/fd/", "/proc/self/mem")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    col: int
    what: str  # the reference, e.g. "os._exit"
    why: str


def scan_python(source: bytes, path: str) -> list[Finding]:
    """Findings in one Python source file; a file that does not parse is itself a finding
    (the grader cannot see what it does, and the interpreter would not run it either)."""
    try:
        tree = ast.parse(source, filename=path)
    except (SyntaxError, ValueError) as exc:
        return [Finding(path, getattr(exc, "lineno", 0) or 0, 0, "<unparsable>", f"not Python: {exc}")]
    aliases: dict[str, str] = {}  # local name -> module it stands for
    found: list[Finding] = []

    def add(node: ast.AST, what: str, why: str) -> None:
        found.append(Finding(path, getattr(node, "lineno", 0), getattr(node, "col_offset", 0), what, why))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                aliases[alias.asname or top] = alias.name if alias.asname else top
                if top in _MODULES:
                    add(node, f"import {alias.name}", _MODULES[top])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            top = node.module.split(".")[0]
            if top in _MODULES:
                add(node, f"from {node.module} import ...", _MODULES[top])
            for alias in node.names:
                why = _ATTRS.get((node.module, alias.name))
                if why:
                    add(node, f"{node.module}.{alias.name}", why)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("pytest_"):
            # A hook implementation: pytest calls it if the module is ever loaded as a plugin.
            add(node, f"def {node.name}", "test framework hook implementation")
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name):
                module = aliases.get(node.value.id, node.value.id)
                why = _ATTRS.get((module, node.attr))
                if why:
                    add(node, f"{module}.{node.attr}", why)
            if node.attr in _ANY_ATTRS:
                add(node, f".{node.attr}", _ANY_ATTRS[node.attr])
        elif isinstance(node, ast.Name) and node.id in _NAMES:
            add(node, node.id, _NAMES[node.id])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for needle in _STRINGS:
                if needle in node.value:
                    add(node, repr(needle), "reaches the process's file descriptors or memory")
            if node.value in _NAME_STRINGS:
                add(node, repr(node.value), "an internal's name as a string (getattr/setattr)")
    return sorted(found, key=lambda f: (f.line, f.col, f.what))


def scan_change(path: str, content: bytes) -> list[Finding]:
    """Findings for one applied file: Python source is parsed, native modules are reported."""
    if path.endswith((".py", ".pyw")):
        return scan_python(content, path)
    if path.endswith(_NATIVE_SUFFIXES):
        return [Finding(path, 0, 0, "<native code>", "compiled code the grader cannot read")]
    return []
