"""E2B-compatible front: the official ``e2b`` SDK drives DSec sandboxes unchanged."""
