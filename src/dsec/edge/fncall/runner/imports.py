"""Which zygote a Python call forks from: the lean one (no preloads) when all its program
imports is the standard library and nothing preloaded, else the warm one.

Read from the source text, without running or parsing it: an import this misses (a
continuation line, a name built at run time) still works from the lean zygote, only without
the preload's head start; anything that may import by name at run time goes warm.
"""

from __future__ import annotations

import re
import sys

_IMPORT = re.compile(r"(?:^|;)[ \t]*(?:from[ \t]+([\w.]+)[ \t]+import\b|import[ \t]+([\w.][\w., \t]*))", re.M)
_DYNAMIC = ("__import__", "importlib", "import_module", "exec(", "eval(", "compile(", "runpy")


def needs_preloads(code: str, preloaded: list[str]) -> bool:
    """Whether a Python program may use what the warm zygote preloaded: True when it imports a
    module outside the standard library or a preloaded one, or may import by name at run time."""
    if not preloaded:
        return False
    if any(word in code for word in _DYNAMIC):
        return True
    warm = {name.split(".")[0] for name in preloaded}
    for m in _IMPORT.finditer(code):
        if m.group(1) is not None:
            names = [m.group(1)]
        else:
            names = [part.split()[0] for part in m.group(2).split(",") if part.split()]
        for name in names:
            top = name.split(".")[0]
            if not top or top in warm or top not in sys.stdlib_module_names:
                return True  # a relative import, a preloaded module, or a third-party one
    return False
