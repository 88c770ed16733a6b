"""The package clients' configuration the edge writes into a sandbox holding a registry
permission, pointing pip, npm and apt at the node's proxy (:mod:`.proxy`) on the gateway.

System-wide files (what every user of the sandbox reads, and a user's own file still
overrides): pip's ``/etc/pip.conf``, npm's global ``/etc/npmrc`` (Debian's npm and Node's
builds built with ``--prefix=/usr``), apt's proxy in ``apt.conf.d``. Written mode 0444 and
removed when the permission goes. They are conveniences, not the fence: a sandbox that edits
them reaches nothing more (the kernel opens the upstream names only to a grant without a
cutoff, and the proxy applies the cutoff itself).
"""

from __future__ import annotations

from dsec.registry.config import Registry

PIP_CONF = "/etc/pip.conf"
NPMRC = "/etc/npmrc"
APT_CONF = "/etc/apt/apt.conf.d/90dsec-registry-proxy"
ALL = (PIP_CONF, NPMRC, APT_CONF)


def files(gateway: str, granted: list[Registry]) -> dict[str, str]:
    """Path -> content for the registries granted (every path of :data:`ALL` not in it goes)."""
    out = {}
    for r in granted:
        base = f"http://{gateway}:{r.port}"
        if r.kind == "pypi":
            # trusted-host: plain HTTP on the sandbox's own link (pip refuses it otherwise).
            out[PIP_CONF] = f"[global]\nindex-url = {base}/simple/\ntrusted-host = {gateway}\n"
        elif r.kind == "npm":
            out[NPMRC] = f"registry={base}/\n"
        elif r.kind == "debian":
            out[APT_CONF] = f'Acquire::http::Proxy "{base}/";\n'
    return out
