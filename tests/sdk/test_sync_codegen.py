"""The sync SDK is checked-in source generated from the async one, and type checkers see it."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsec.sdk import DSec, DSecClient, Pty, Sandbox, SyncPty, SyncSandbox
from dsec.sdk._sync import codegen

REPO = Path(__file__).resolve().parents[2]
PAIRS = [(DSec, DSecClient), (SyncSandbox, Sandbox), (SyncPty, Pty)]


def test_the_checked_in_facade_is_what_the_generator_writes() -> None:
    assert codegen.TARGET.read_text() == codegen.generate(), (
        "src/dsec/sdk/_generated_sync.py is stale: run .venv/bin/python -m dsec.sdk._sync.codegen"
    )


def test_the_check_command_fails_on_a_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "_generated_sync.py"
    stale.write_text(codegen.TARGET.read_text().replace("def refresh(", "def refreshed(", 1))
    monkeypatch.setattr(codegen, "TARGET", stale)
    assert codegen.main(["--check"]) == 1
    assert codegen.main([]) == 0  # rewrites it
    assert codegen.main(["--check"]) == 0


@pytest.mark.parametrize(("sync_cls", "async_cls"), PAIRS, ids=lambda c: c.__name__)
def test_every_public_method_has_a_sync_twin_with_its_parameters(sync_cls: type, async_cls: type) -> None:
    public = {n for n in dir(async_cls) if not n.startswith("_") and callable(getattr(async_cls, n))}
    for name in public:
        ours = sync_cls.__dict__.get(name)
        assert ours is not None, f"{sync_cls.__name__}.{name} is not written out"
        want = inspect.signature(getattr(async_cls, name)).parameters
        got = inspect.signature(ours).parameters
        assert [(p.name, p.kind, p.default) for p in got.values()] == [
            (p.name, p.kind, p.default) for p in want.values()
        ], name


def test_a_type_checker_sees_the_sync_methods(tmp_path: Path) -> None:
    # What the generated source is for: a typo or a wrong argument in sync code is a type error
    # (it used to be Any through __getattr__), and results carry their real types.
    script = tmp_path / "user.py"
    script.write_text(
        textwrap.dedent(
            """
            from dsec import DSec, DSecContainerRunArgs

            with DSec() as client:
                sb = client.run_container(DSecContainerRunArgs(container_image="debian:bookworm"))
                code: int | None = sb.exec(["true"]).exit_code
                sb.exce(["true"])
                sb.run_shell("true", timeout="soon")
                reveal_type(client.list())
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--follow-imports=silent", script],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    out = done.stdout
    assert '"SyncSandbox" has no attribute "exce"' in out, out
    assert 'Argument "timeout" to "run_shell" of "SyncSandbox" has incompatible type "str"' in out, out
    assert 'Revealed type is "list[dsec.sdk._generated_sync.SyncSandbox]"' in out, out
    assert out.count("error:") == 2, out
