"""Package registries through the edge: a caching proxy per node for PyPI, npm and Debian
(:mod:`.proxy`), hiding releases newer than a sandbox's cutoff (:mod:`.cutoff`), its files
fetched upstream once however many sandboxes ask (:mod:`.store`), and the package clients'
configuration the edge writes into a sandbox holding the permission (:mod:`.clients`)."""
