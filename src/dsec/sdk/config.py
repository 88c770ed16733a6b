"""Where the SDK and CLI find the DSec they talk to.

``dsec up`` writes ``{"url": ..., "api_key": ...}`` to the config file; ``DSEC_URL`` and
``DSEC_API_KEY`` override it, and ``DSEC_CONFIG`` moves the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from dsec.protocol.errors import InvalidRequest


def config_path() -> Path:
    env = os.environ.get("DSEC_CONFIG")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "dsec" / "config.json"


@dataclass(frozen=True)
class ClientConfig:
    url: str
    api_key: str


def read_config_file(path: Path | None = None) -> dict[str, str]:
    path = path or config_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"cannot read DSec config {path}: {exc}") from exc
    return {k: str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def load_client_config(url: str | None = None, api_key: str | None = None) -> ClientConfig:
    url = url or os.environ.get("DSEC_URL")
    api_key = api_key or os.environ.get("DSEC_API_KEY")
    if url is None or api_key is None:
        data = read_config_file()
        url = url or data.get("url")
        api_key = api_key or data.get("api_key")
    if not url or not api_key:
        raise InvalidRequest(
            f"no DSec to connect to: start one with `dsec up` (it writes {config_path()}),"
            " or set DSEC_URL and DSEC_API_KEY"
        )
    return ClientConfig(url.rstrip("/"), api_key)


def write_client_config(url: str, api_key: str, path: Path | None = None) -> Path:
    path = path or config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds an admin key
    with os.fdopen(fd, "w") as fh:
        json.dump({"url": url, "api_key": api_key}, fh)
    tmp.replace(path)
    return path
