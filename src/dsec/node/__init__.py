"""Node assembly: wiring the parts (apiserver, placement, IAM, layer store, edge, backends) into
a running node.

``embedded.py`` builds the single-process node ``dsec up`` runs (one edge reached by a function
call); ``cluster.py`` builds the two halves of a cluster as separate processes (``dsec edge``,
``dsec apiserver``). Neither part imports this package: assembly depends on the parts, never
the other way round.
"""
