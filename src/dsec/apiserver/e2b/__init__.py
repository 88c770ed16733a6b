"""E2B-compatible front: the official ``e2b`` SDK drives DSec sandboxes unchanged."""

from dsec.apiserver.e2b.front import E2BFront, E2BOptions

__all__ = ["E2BFront", "E2BOptions"]
