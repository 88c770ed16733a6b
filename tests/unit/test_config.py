"""Where the SDK finds DSec: config file by default, environment variables over it."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec import InvalidRequest
from dsec.sdk.config import load_client_config, write_client_config


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for var in ("DSEC_URL", "DSEC_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "dsec" / "config.json"
    monkeypatch.setenv("DSEC_CONFIG", str(path))
    return path


def test_config_file_is_the_default(clean_env: Path) -> None:
    write_client_config("http://127.0.0.1:9/", "dsec_file")
    cfg = load_client_config()
    assert (cfg.url, cfg.api_key) == ("http://127.0.0.1:9", "dsec_file")
    assert clean_env.stat().st_mode & 0o777 == 0o600  # it holds an admin key


def test_environment_overrides_the_file(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_client_config("http://127.0.0.1:9", "dsec_file")
    monkeypatch.setenv("DSEC_URL", "http://10.1.2.3:8642")
    monkeypatch.setenv("DSEC_API_KEY", "dsec_env")
    cfg = load_client_config()
    assert (cfg.url, cfg.api_key) == ("http://10.1.2.3:8642", "dsec_env")
    assert load_client_config(api_key="dsec_arg").api_key == "dsec_arg"


def test_nothing_to_connect_to_says_how_to_fix_it(clean_env: Path) -> None:
    with pytest.raises(InvalidRequest, match="dsec up"):
        load_client_config()
    clean_env.parent.mkdir(parents=True)
    clean_env.write_text("{not json")
    with pytest.raises(InvalidRequest, match="cannot read DSec config"):
        load_client_config()
