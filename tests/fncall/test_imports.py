"""Which zygote a Python call forks from (``runner/imports.py``): the lean one only when the
program cannot use what the warm one preloaded."""

from __future__ import annotations

import pytest

from dsec.edge.fncall.runner.imports import needs_preloads

NUMPY = ["numpy"]


@pytest.mark.parametrize(
    ("code", "warm"),
    [
        ("print(1)", False),
        ("import os, sys\nfrom collections import abc\nimport json as j\nprint(1)", False),
        ("import numpy as np", True),
        ("from numpy.linalg import inv", True),
        ("import os,numpy", True),
        ("import os; import numpy", True),  # a second statement on the line
        ("def f():\n    import numpy\n    return numpy", True),  # an import inside a function
        ("import pandas", True),  # outside the standard library: it may import a preload
        ("import solution\nsolution.main()", True),  # a module among the call's files
        ("from . import x", True),
        ("m = __import__('numpy')", True),  # by name at run time
        ("import importlib\nimportlib.import_module('numpy')", True),
        ("exec(open('gen.py').read())", True),
        ("s = 'numpy'\nprint(s)", False),  # a name in a string is no import
    ],
)
def test_a_program_forks_warm_only_when_it_may_use_the_preloads(code: str, warm: bool) -> None:
    assert needs_preloads(code, NUMPY) is warm


def test_without_preloads_every_program_forks_from_the_one_zygote() -> None:
    assert needs_preloads("import numpy", []) is False


def test_a_preloaded_module_of_the_standard_library_counts_as_preloaded() -> None:
    assert needs_preloads("import fractions", ["json", "fractions"]) is True
    assert needs_preloads("import decimal", ["json", "fractions"]) is False
    assert needs_preloads("import numpy.linalg", ["numpy.linalg"]) is True
