"""``dsec key ...``: API keys, each belonging to a project and seeing only its subtree."""

from __future__ import annotations

from typing import Annotated, Literal

import typer
from rich.table import Table

from dsec.cli._common import _client_call, console

key_app = typer.Typer(
    help="API keys: each belongs to a project and sees only its subtree.", no_args_is_help=True
)


@key_app.command("issue")
def key_issue(project: str, admin: bool = False, name: str = "", e2b: bool = False) -> None:
    """Issue an API key for PROJECT (printed once: only its digest is kept); --e2b: an e2b_<hex>
    key for E2B's SDKs."""
    fmt: Literal["dsec", "e2b"] = "e2b" if e2b else "dsec"
    print(_client_call(lambda c: c.issue_key(project, admin=admin, name=name, format=fmt)))


@key_app.command("ls")
def key_ls(project: Annotated[str | None, typer.Argument()] = None) -> None:
    """Keys of PROJECT (their IDs, never the keys)."""
    keys = _client_call(lambda c: c.list_keys(project))
    table = Table("key id", "project", "admin", "name", "revoked")
    for k in keys:
        table.add_row(k["key_id"], k["project"], str(k["admin"]), k["name"], str(k["revoked"]))
    console.print(table)


@key_app.command("revoke")
def key_revoke(key_id: str) -> None:
    """Revoke a key by its ID."""
    revoked = _client_call(lambda c: c.revoke_key(key_id))
    console.print("revoked" if revoked else "no such key")
