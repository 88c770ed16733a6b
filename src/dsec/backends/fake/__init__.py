"""The fake backend: a test double of the backend seam (host processes, no isolation)."""

from dsec.backends.fake.backend import MARKER_ENV, FakeBackend

__all__ = ["MARKER_ENV", "FakeBackend"]
