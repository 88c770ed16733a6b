"""Parts of bench/controlplane.py: simulated edges, the placement simulation, the apiserver
process, the load generator and the memory probe."""
