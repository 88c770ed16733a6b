"""Network policy: every sandbox in its own network namespace, reaching only what the named
permissions it holds allow (enforced by nftables in the node's kernel), with a name server that
answers only for allowed names.

- :mod:`.config`: the operator's permission names -> endpoints (``EgressConfig``);
- :mod:`.links`: a sandbox's veth link to the host;
- :mod:`.nft`: the edge's nftables table;
- :mod:`.dns`: the sandboxes' name server;
- :mod:`.policy`: ``EgressPolicy``, what the edge calls.
"""

from dsec.netpolicy.config import EgressConfig, Endpoint

__all__ = ["EgressConfig", "Endpoint"]
