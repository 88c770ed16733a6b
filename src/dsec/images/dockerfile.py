"""The Dockerfile subset `dsec layer build` understands: FROM, RUN, COPY, ENV, WORKDIR.

A build runs its steps in a build sandbox on top of the FROM layers; the new layer is what the
steps changed (the sandbox's upper directory), not the whole image. ENV and WORKDIR shape the
build's own steps; they are not stored in the layer (a sandbox's environment is its `env`).
``RUN --network=none|default`` (BuildKit's flag) takes a step off the network the build was
granted, or keeps it on (the default); no other RUN flag is understood.
"""

from __future__ import annotations

import json
import posixpath
import shlex
from dataclasses import dataclass, field
from typing import Literal

from dsec.protocol.errors import InvalidRequest

Kind = Literal["RUN", "COPY", "ENV", "WORKDIR"]


@dataclass(frozen=True)
class Step:
    kind: Kind
    args: tuple[str, ...]
    line: int  # where it stands in the Dockerfile, for error messages
    network: Literal["default", "none"] = "default"  # RUN only: the build's grants, or none

    def describe(self) -> str:
        return f"{self.kind} {' '.join(self.args)}"[:200]


@dataclass
class BuildPlan:
    base: list[str]  # layer or image references, base first
    steps: list[Step] = field(default_factory=list)


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join backslash continuations, drop comments and blank lines; keep the first line number."""
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not buf:
            start = number
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        out.append((start, buf + line))
        buf = ""
    if buf:
        out.append((start, buf))
    return out


def _env_pairs(rest: str, line: int) -> tuple[str, ...]:
    words = shlex.split(rest)
    if not words:
        raise InvalidRequest(f"Dockerfile line {line}: ENV needs a name and a value")
    if "=" not in words[0]:  # legacy form: ENV NAME value with spaces
        return (f"{words[0]}={rest.split(None, 1)[1] if len(rest.split(None, 1)) > 1 else ''}",)
    for word in words:
        if "=" not in word or word.startswith("="):
            raise InvalidRequest(f"Dockerfile line {line}: ENV expects NAME=value, got {word!r}")
    return tuple(words)


def parse(text: str, *, base: list[str] | None = None) -> BuildPlan:
    """Parse a Dockerfile; ``base`` (layers) replaces or supplies the FROM line."""
    plan = BuildPlan(base=list(base or []))
    seen_from = False
    for line, content in _logical_lines(text):
        word, _, rest = content.strip().partition(" ")
        kind, rest = word.upper(), rest.strip()
        if kind == "FROM":
            if seen_from or plan.steps:
                raise InvalidRequest(f"Dockerfile line {line}: only one FROM, before any step")
            seen_from = True
            refs = rest.split()
            if not refs or any(r.upper() == "AS" for r in refs):
                raise InvalidRequest(f"Dockerfile line {line}: FROM takes layer references (no stages)")
            if base is None:
                plan.base = refs
        elif kind == "RUN":
            network, rest = _run_flags(rest, line)
            if rest.startswith("["):
                try:
                    argv = json.loads(rest)
                except ValueError as exc:
                    raise InvalidRequest(f"Dockerfile line {line}: RUN's JSON form is malformed") from exc
                rest = shlex.join(str(a) for a in argv)
            if not rest:
                raise InvalidRequest(f"Dockerfile line {line}: RUN needs a command")
            plan.steps.append(Step("RUN", (rest,), line, network))
        elif kind == "COPY":
            parts = [p for p in shlex.split(rest) if not p.startswith("--")]
            if len(parts) < 2:
                raise InvalidRequest(
                    f"Dockerfile line {line}: COPY needs at least one source and a destination"
                )
            plan.steps.append(Step("COPY", tuple(parts), line))
        elif kind == "ENV":
            plan.steps.append(Step("ENV", _env_pairs(rest, line), line))
        elif kind == "WORKDIR":
            if not rest:
                raise InvalidRequest(f"Dockerfile line {line}: WORKDIR needs a path")
            plan.steps.append(Step("WORKDIR", (rest,), line))
        else:
            raise InvalidRequest(
                f"Dockerfile line {line}: {word!r} is not supported (FROM, RUN, COPY, ENV, WORKDIR are)"
            )
    if not plan.base:
        raise InvalidRequest("the build has no base: add a FROM line or pass base layers")
    return plan


def _run_flags(rest: str, line: int) -> tuple[Literal["default", "none"], str]:
    """RUN's leading ``--flag=value`` words: ``--network`` (none or default) and nothing else."""
    network: Literal["default", "none"] = "default"
    while rest.startswith("--"):
        flag, _, rest = rest.partition(" ")
        rest = rest.strip()
        name, _, value = flag.partition("=")
        if name != "--network":
            raise InvalidRequest(f"Dockerfile line {line}: RUN {name} is not supported (--network is)")
        if value not in ("none", "default"):
            raise InvalidRequest(
                f"Dockerfile line {line}: RUN --network={value!r}: none or default (the build's own"
                " network permissions; there is no host network)"
            )
        network = "none" if value == "none" else "default"
    return network, rest


def resolve_workdir(current: str, new: str) -> str:
    return posixpath.normpath(posixpath.join(current, new))
