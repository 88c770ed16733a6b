"""Helpers of bench/vm.py (host-side reads of QEMU processes, KSM settings)."""
