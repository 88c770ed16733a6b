"""Issue 30's E2B mappings without a node: E2B's egress settings onto DSec permissions, what
``base`` means, and E2B's ``user`` account written into a debootstrapped tree."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dsec.apiserver.e2b.lifecycle import FALLBACK_TEMPLATE, LifecycleRoutes
from dsec.apiserver.e2b.models import NetworkUpdate
from dsec.apiserver.e2b.network import ALL_TRAFFIC, INTERNET, to_info, to_rules
from dsec.images.base import E2B_BASE_REF, add_e2b_user
from dsec.protocol.errors import InvalidRequest


def test_internet_is_the_default_where_it_is_offered() -> None:
    default = NetworkUpdate()
    assert to_rules(default, internet_offered=True) == {INTERNET: True}
    assert to_rules(default, internet_offered=False) == {}
    closed = NetworkUpdate.model_validate({"allow_internet_access": False, "allowOut": ["pypi"]})
    assert to_rules(closed, internet_offered=True) == {"pypi": True}
    denied = NetworkUpdate.model_validate({"denyOut": [ALL_TRAFFIC], "allowOut": [ALL_TRAFFIC, "github"]})
    assert to_rules(denied, internet_offered=False) == {INTERNET: True, "github": True}
    for rules in ({INTERNET: True, "pypi": True}, {"pypi": True}, {}):
        info = to_info(rules).wire()
        back = NetworkUpdate.model_validate(info)
        assert to_rules(back, internet_offered=INTERNET in rules) == rules
    for bad in (
        {"egressProxy": {"address": "p:1080"}},
        {"dnsServers": ["1.1.1.1"]},
    ):
        with pytest.raises(InvalidRequest):
            to_rules(NetworkUpdate.model_validate(bad), internet_offered=True)


class _Store:
    def __init__(self, tags: set[str]) -> None:
        self.tags = tags

    def has_tag(self, ref: str) -> bool:
        return ref in self.tags


async def test_base_means_e2b_base_once_built() -> None:
    def routes(default: str, tags: set[str]) -> LifecycleRoutes:
        return LifecycleRoutes(None, _Store(tags), None, default)  # type: ignore[arg-type]

    assert await routes(E2B_BASE_REF, {E2B_BASE_REF})._default() == E2B_BASE_REF
    assert await routes(E2B_BASE_REF, set())._default() == FALLBACK_TEMPLATE
    assert await routes("mine:1", {E2B_BASE_REF})._default() == "mine:1"  # the operator's choice


def test_add_e2b_user_writes_the_account_as_useradd_would(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    (etc / "skel").mkdir(parents=True)
    (etc / "skel" / ".bashrc").write_text("# skel\n")
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (etc / "group").write_text("root:x:0:\nsudo:x:27:\n")
    (etc / "shadow").write_text("root:*:19000:0:99999:7:::\n")
    (etc / "gshadow").write_text("root:*::\nsudo:*::\n")
    os.chmod(etc / "shadow", 0o640)
    add_e2b_user(tmp_path)
    assert (etc / "passwd").read_text().splitlines()[-1] == "user:x:1000:1000::/home/user:/bin/bash"
    assert "sudo:x:27:user" in (etc / "group").read_text().splitlines()
    assert "sudo:*::user" in (etc / "gshadow").read_text().splitlines()
    assert stat.S_IMODE((etc / "shadow").stat().st_mode) == 0o640  # not made world-readable
    rule = etc / "sudoers.d" / "user"
    assert rule.read_text() == "Defaults !log_allowed\nuser ALL=(ALL:ALL) NOPASSWD: ALL\n"
    assert "127.0.1.1\tsandbox" in (etc / "hosts").read_text().splitlines()  # sudo resolves it
    assert stat.S_IMODE(rule.stat().st_mode) == 0o440
    home = tmp_path / "home" / "user"
    assert (home / ".bashrc").read_text() == "# skel\n"
    assert {(p.stat().st_uid, p.stat().st_gid) for p in (home, home / ".bashrc")} == {(1000, 1000)}
