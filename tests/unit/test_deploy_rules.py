"""deploy/'s Prometheus rules and Grafana dashboard: valid for Prometheus's own tool, and naming
only metrics DSec exports (a renamed metric must not leave a silent dashboard or alert).

``promtool`` comes with Debian's ``prometheus`` package (``./setup.sh test`` installs it).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "dsec-alerts.yml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "dsec-alerts.test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "dsec-dashboard.json"
OBSERVE = REPO / "src" / "dsec" / "observe"
_NAME = re.compile(r"\bdsec_[a-z_]+")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    assert tool is not None, "promtool is missing: ./setup.sh test installs Debian's prometheus"
    return subprocess.run([tool, *args], capture_output=True, text=True, cwd=cwd, check=False)


def exported_names() -> set[str]:
    text = "\n".join(p.read_text() for p in OBSERVE.glob("*metrics.py"))
    return set(re.findall(r'"(dsec_[a-z_]+)"', text)) | set(re.findall(r'f"dsec_\{part\}(_[a-z_]+)"', text))


def base(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def known(name: str, exported: set[str]) -> bool:
    b = base(name)
    return b in exported or any(b == f"dsec_{part}{rest}" for part in ("api", "edge") for rest in exported)


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_alert_rules_pass_promtool() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_dashboard_queries_are_promql(tmp_path: Path) -> None:
    """Each panel's query as a recording rule: promtool parses it as Prometheus would."""
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:q{i}", "expr": e} for i, e in enumerate(exprs)
    ]}]}  # fmt: skip
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    checked = promtool("check", "rules", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_rules_and_dashboard_name_only_exported_metrics() -> None:
    exported = exported_names()
    assert {"dsec_sandboxes", "dsec_creates", "dsec_node_up"} <= exported
    used = set(_NAME.findall(RULES.read_text())) | {n for e in dashboard_exprs() for n in _NAME.findall(e)}
    unknown = sorted(n for n in used if not known(n, exported))
    assert unknown == [], f"not exported by src/dsec/observe: {unknown}"
