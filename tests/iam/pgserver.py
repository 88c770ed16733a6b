"""A throwaway PostgreSQL server owned by the test run: initdb into a temp dir, serve on a
private Unix socket (no TCP at all), stop and delete everything at the end.

PostgreSQL refuses to run as root, so under root the server runs as the ``postgres`` system
user that Debian's ``postgresql`` package creates; otherwise as the current user. Durability
settings are off: the server lives for one test session, and the locking under test does not
depend on them.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

_MISSING = (
    "PostgreSQL server binaries (initdb, pg_ctl) not found: the IAM tests run against a real"
    " server. Install Debian's 'postgresql' package (./setup.sh test installs it)."
)


class PgSetupError(RuntimeError):
    pass


def find_bindir() -> Path:
    """Debian keeps the server binaries in /usr/lib/postgresql/<major>/bin; take the newest."""
    candidates = sorted(
        (p for p in Path("/usr/lib/postgresql").glob("*/bin") if (p / "pg_ctl").exists()),
        key=lambda p: int(re.sub(r"\D", "", p.parent.name) or 0),
    )
    if candidates:
        return candidates[-1]
    found = shutil.which("pg_ctl")
    if found and Path(found).with_name("initdb").exists():
        return Path(found).resolve().parent
    raise PgSetupError(_MISSING)


class PgServer:
    def __init__(self) -> None:
        self.bindir = find_bindir()
        self.user = self._run_user()
        self.root = Path(tempfile.mkdtemp(prefix="dsec-iam-pg-"))
        self.data = self.root / "data"
        self.sock = self.root / "sock"
        self.log = self.root / "server.log"
        self.port = 5432  # only names the socket file: the directory is private to this server
        self.started = False

    @staticmethod
    def _run_user() -> str | None:
        if os.geteuid() != 0:
            return None
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            raise PgSetupError(
                "running as root and there is no 'postgres' system user to run the test server as: "
                + _MISSING
            ) from None
        return "postgres"

    @property
    def dsn(self) -> str:
        return f"postgresql://dsec@/postgres?host={self.sock}&port={self.port}"

    def _run(self, *argv: str) -> None:
        cmd = [str(self.bindir / argv[0]), *argv[1:]]
        done = subprocess.run(cmd, user=self.user, capture_output=True, text=True, check=False, timeout=120)
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""
            raise PgSetupError(
                f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr or done.stdout}\n{log}"
            )

    def start(self) -> None:
        self.sock.mkdir()
        if self.user is not None:
            pw = pwd.getpwnam(self.user)
            for p in (self.root, self.sock):
                os.chown(p, pw.pw_uid, pw.pw_gid)
        self._run(
            "initdb", "-D", str(self.data), "-U", "dsec", "-A", "trust", "-E", "UTF8",
            "--locale=C", "--no-sync", "--no-instructions",
        )  # fmt: skip
        options = " ".join(
            f"-c {o}"
            for o in (
                "listen_addresses=''",
                f"unix_socket_directories='{self.sock}'",
                f"port={self.port}",
                "fsync=off",
                "synchronous_commit=off",
                "full_page_writes=off",
                "max_connections=300",
                "deadlock_timeout=100ms",
            )
        )
        self.started = True  # from here on, stop() has something to stop
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "-o", options, "start"
        )

    def stop(self) -> None:
        """Stop the server (also a half-started one) and delete its directory."""
        try:
            if self.started and (self.data / "postmaster.pid").exists():
                try:
                    self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "-t", "30", "stop")
                except (PgSetupError, subprocess.TimeoutExpired):
                    self._kill_postmaster()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def _kill_postmaster(self) -> None:
        pid_file = self.data / "postmaster.pid"
        if pid_file.exists():
            pid = int(pid_file.read_text().split()[0])
            os.kill(pid, signal.SIGKILL)  # only the postmaster this object started


@contextmanager
def running_pg_server() -> Iterator[PgServer]:
    """A started server for a test session, stopped and deleted afterwards; a setup failure
    fails the tests that need it (never skips them), with the reason."""
    try:
        server = PgServer()
    except PgSetupError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        server.start()
    except PgSetupError as exc:
        server.stop()
        pytest.fail(f"could not start the test PostgreSQL server: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()
