"""Network rules as a command line writes them: ``pypi,debian`` grants both, ``pypi@2025-06-01``
grants pypi with releases before that day only."""

from __future__ import annotations

import datetime

from pydantic import ValidationError

from dsec.protocol.errors import InvalidRequest
from dsec.protocol.models import Grant, GrantOptions, NetworkRules


def parse(text: str) -> NetworkRules:
    rules: NetworkRules = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        name, _, day = item.partition("@")
        if not day:
            rules[name] = True
            continue
        try:
            rules[name] = GrantOptions.model_validate({"before": day})
        except ValidationError as exc:
            why = exc.errors()[0].get("msg", "not a date")
            raise InvalidRequest(
                f"network permission {item!r}: the cutoff must be a day, YYYY-MM-DD ({why})"
            ) from exc
    return rules


def describe(rules: NetworkRules) -> list[str]:
    """The granted permissions as ``parse`` reads them (what a layer records)."""
    out = []
    for name, grant in sorted(rules.items()):
        if isinstance(grant, GrantOptions):
            out.append(f"{name}@{grant.before.isoformat()}" if grant.before else name)
        elif grant:
            out.append(name)
    return out


def cutoff_of(grant: Grant | None) -> datetime.date | None:
    """The day a grant's registry releases must predate (None: no cutoff, or not granted)."""
    return grant.before if isinstance(grant, GrantOptions) else None


def to_wire(rules: NetworkRules) -> dict[str, bool | dict[str, str | None]]:
    """``rules`` as JSON values (what the request record and its answer hold)."""
    return {
        name: grant.model_dump(mode="json") if isinstance(grant, GrantOptions) else grant
        for name, grant in rules.items()
    }
