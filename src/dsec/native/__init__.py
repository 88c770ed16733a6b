"""The node's native helpers: small static C programs the node compiles (gcc) and runs on the
host, each source next to the Python module that builds and drives it.

* :mod:`.spawner` (``dsec_spawn.c``): forks the edge's children from a small fd table.
* :mod:`.enter` (``dsec_enter.c``): starts a process in a container sandbox's namespaces.
* :mod:`.rootfs` (``dsec_rootfs.c``): mounts a sandbox's root out of the host's sight and
  starts the OCI runtime on it.
* :mod:`.init` (``dsec_init.c``): PID 1 of every container sandbox.

:mod:`.build` compiles them all the same way, once per source version. The microVM guest's
agent (``backends/microvm/guest/agent.c``) is not one of them: it runs in the guest, and is
built into the guest's initramfs with the rest of the guest kit (``backends/microvm/kit.py``).
"""
