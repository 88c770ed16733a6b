"""The permissions DSec ships, on in ``dsec up`` and ``dsec edge`` with no configuration.

Each names the domains its service is served from (registries and code hosts sit behind CDNs
whose addresses change, so they are resolved when a sandbox asks, never written down) and the
ports their clients use. ``internet`` is every public address. An operator's permission of the
same name replaces one of these whole; ``catalogue = false`` in the operator's file drops them.
"""

from __future__ import annotations

from dsec.netpolicy.config import Permission, Rule

_HTTPS = [443]
_WEB = [80, 443]  # apt fetches over plain HTTP by default (its archives are signed)

CATALOGUE: dict[str, Permission] = {
    "pypi": [Rule(domains=["pypi.org", "files.pythonhosted.org"], ports=_HTTPS)],
    "npm": [Rule(domains=["registry.npmjs.org", "registry.yarnpkg.com"], ports=_HTTPS)],
    "debian": [
        Rule(
            domains=["deb.debian.org", "security.debian.org", "ftp.debian.org", "cdn-fastly.deb.debian.org"],
            ports=_WEB,
        )
    ],
    "github": [
        Rule(
            domains=["github.com", "api.github.com", "codeload.github.com", "*.githubusercontent.com"],
            ports=_HTTPS,
        )
    ],
    "huggingface": [Rule(domains=["huggingface.co", "*.huggingface.co", "*.hf.co"], ports=_HTTPS)],
    "crates": [Rule(domains=["crates.io", "index.crates.io", "static.crates.io"], ports=_HTTPS)],
    "go": [
        Rule(
            domains=["proxy.golang.org", "sum.golang.org", "index.golang.org", "go.dev", "dl.google.com"],
            ports=_HTTPS,
        )
    ],
    "internet": [Rule(public=True)],
}
