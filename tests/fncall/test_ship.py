"""The runner as shipped into pool sandboxes: one file, the same bytes from every build of the
same sources, that the sandbox's bare python3 can run (stdlib imports only)."""

from __future__ import annotations

import ast
import io
import sys
import zipfile

from dsec.edge.fncall import ship


def test_the_shipped_runner_is_the_same_bytes_from_every_build() -> None:
    first = ship.runner_zip()
    ship.runner_zip.cache_clear()
    assert ship.runner_zip() == first  # a node rewrites its copy only when the runner changed
    names = zipfile.ZipFile(io.BytesIO(first)).namelist()
    assert names[0] == "__main__.py"
    assert {n.rsplit("/", 1)[-1] for n in names[1:]} == {p.name for p in ship.PACKAGE.glob("*.py")}


def test_the_shipped_runner_imports_nothing_but_the_stdlib_and_itself() -> None:
    with zipfile.ZipFile(io.BytesIO(ship.runner_zip())) as zf:
        for name in zf.namelist():
            for node in ast.walk(ast.parse(zf.read(name), name)):
                if isinstance(node, ast.Import):
                    tops = {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
                    tops = {node.module.split(".")[0]}
                else:
                    continue
                assert tops <= {*sys.stdlib_module_names, ship.NAME_IN_ZIP}, (name, tops)
