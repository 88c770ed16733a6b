"""The zygote: the one process that forks every call process, from a runner holding no task.

Two kinds. The warm one is forked by the runner after the preloads and before any task was
read, so a Python call starts with the modules imported but cannot find an earlier call's
task or inputs, or its own ``expected_stdout``, in its memory. The lean one is a fresh
interpreter the runner execs (``main``) that imports this module and what a call process
needs, nothing of the runner: every fork copies the zygote's page tables and every call's
exit unmaps them, so its size is paid per call (8.7 -> 4.5 MiB anonymous, fork and exit
1.15 -> 0.93 ms CPU, docs/decisions.md).

A zygote forks the next call's process ahead (a "spare": new session, namespaces, done off
the call's path), hands it the request when the call starts, and reports its pid, then its
wait status and rusage, back to the runner over a socket. Messages both ways are
``marshal``'d: the runner and the zygote are the same interpreter, and the json module (and
the re module under it) would be a megabyte of the lean zygote's heap.
"""

from __future__ import annotations

import ctypes
import gc
import marshal
import os
import select
import signal
import socket
import sys

from . import layout
from .libc import CLONE_NEWIPC, CLONE_NEWNET, libc
from .netns import SharedNet
from .process import call_process, fresh_random

TYPE_CHECKING = False  # typing itself is not imported: its heap would be the lean zygote's
if TYPE_CHECKING:
    from typing import NoReturn

_shared_net: SharedNet | None = None  # the zygote's; its spares enter it
# What the runner execs for the lean zygote: its package from where the runner's came (the
# zip), then ``main`` with the socket's fd and the flags.
BOOT = "import sys; sys.path[0] = sys.argv[1]; __import__(sys.argv[2] + '.zygote', fromlist=['main']).main()"


def main() -> NoReturn:
    """The lean zygote's start: ``BOOT <root> <package> <fd> <netns> <root> <own layout> <mergeable>``
    (flags as 0/1). Says ``{"ready": True}`` once it can fork, then serves as ``zygote``."""
    fd, netns, root, own_layout, mergeable = (int(a) for a in sys.argv[3:8])
    sock = socket.socket(fileno=fd)
    os.set_inheritable(fd, False)
    layout.own_layout = bool(own_layout)  # exec'd with the runner's personality and hash seed
    if mergeable:
        layout.mark_mergeable()  # an exec starts unmarked: mark as the runner marked itself
    sock.send(marshal.dumps({"ready": True}))
    zygote(sock, bool(netns), bool(root))


def zygote(sock: socket.socket, netns: bool, root: bool) -> NoReturn:
    """Fork one call process per request; report its pid, then its wait status and rusage.

    The process for the next call is forked ahead (``_spare``), right after the last one was
    reaped, while the runner cleans up and the edge answers: the fork, the new session and
    namespaces are then off the next call's path. It is forked from this zygote, which holds
    no task, and learns its request only when the call starts."""
    global _shared_net
    spare: tuple[int, socket.socket | None, str] = (-1, None, "")
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDWR)  # calls must never reach the edge's pipe
        os.dup2(null, 0)
        os.dup2(null, 1)
        # A call's collections then skip the preloads' objects instead of writing to (and so
        # copying) every page that holds one.
        gc.freeze()
        _shared_net = SharedNet.create() if netns else None
        # A process the call made with clone(CLONE_PARENT) is this zygote's child: reaped as soon
        # as it ends (the runner's cleanup kills it), or it would stay a zombie of the call uid.
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        spare = _fork_spare(sock, netns, root)
        while True:
            ready = select.select([sock.fileno(), wake_r], [], [])[0]
            if wake_r in ready:
                os.read(wake_r, 4096)
                spare = _reap_strays(spare)
                if sock.fileno() not in ready:
                    continue
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 4)
            if not msg:
                code = 0
                break
            if _shared_net is not None and not _shared_net.empty():
                # The last call left a socket (a cycle of descriptors in flight, TIME_WAIT): the
                # calls from here on share a fresh namespace, this one included.
                spare = _drop(spare)
                _shared_net = _shared_net.renew()
            if spare[0] < 0:
                spare = _fork_spare(sock, netns, root)
            (pid, chan, error), spare = spare, (-1, None, "")
            if chan is not None:
                try:
                    socket.send_fds(chan, [msg], fds)
                except OSError as exc:  # it died waiting: nothing of this call ran
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    pid, error = -1, f"fork: the waiting call process is gone ({exc})"
                chan.close()
            for fd in fds:
                os.close(fd)
            if pid < 0:
                sock.send(marshal.dumps({"error": error}))
            else:
                sock.send(marshal.dumps({"pid": pid}))
                _, status, ru = os.wait4(pid, 0)
                cpu = ru.ru_utime + ru.ru_stime
                sock.send(marshal.dumps({"status": status, "maxrss": ru.ru_maxrss, "cpu": cpu}))
            spare = _fork_spare(sock, netns, root)
    finally:
        try:
            _drop(spare)
        finally:
            os._exit(code)


def _drop(spare: tuple[int, socket.socket | None, str]) -> tuple[int, socket.socket | None, str]:
    """Kill and reap a spare that will serve no call."""
    if spare[0] > 0:
        os.kill(spare[0], signal.SIGKILL)
        os.waitpid(spare[0], 0)
    if spare[1] is not None:
        spare[1].close()
    return -1, None, ""


def _reap_strays(spare: tuple[int, socket.socket | None, str]) -> tuple[int, socket.socket | None, str]:
    """Reap every ended child of the zygote; the spare, if it is one of them, is forked anew later."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return spare
        if pid == 0:
            return spare
        if pid == spare[0]:
            if spare[1] is not None:
                spare[1].close()
            spare = (-1, None, "")


def _fork_spare(sock: socket.socket, netns: bool, root: bool) -> tuple[int, socket.socket | None, str]:
    """The next call's process, waiting for its request: (pid, channel to it, why not)."""
    chan, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        pid = os.fork()
    except OSError as exc:
        chan.close()
        theirs.close()
        return -1, None, f"fork: {exc}"
    if pid == 0:
        sock.close()
        chan.close()
        _spare(theirs, netns, root)
    theirs.close()
    return pid, chan, ""


def _spare(chan: socket.socket, netns: bool, root: bool) -> NoReturn:
    """What a call process does before it has a request: nothing of any task is known yet."""
    early: BaseException | None = None
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        if netns and _shared_net is not None:
            if libc.setns(_shared_net.ns, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns(CLONE_NEWNET)")
            for fd in (_shared_net.ns, *_shared_net.stats):
                os.close(fd)
            if libc.unshare(CLONE_NEWIPC) != 0:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWIPC)")
        elif netns and libc.unshare(CLONE_NEWNET | CLONE_NEWIPC) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET|CLONE_NEWIPC)")
        if root:
            try:
                with open("/proc/self/oom_score_adj", "w") as f:  # an OOM kill takes a call, not the runner
                    f.write("1000")
            except OSError:
                pass  # no /proc: a preference, not a requirement
        fresh_random()
    except BaseException as exc:
        early = exc
    try:
        msg, fds, _, _ = socket.recv_fds(chan, 1 << 16, 4)
    except BaseException:
        os._exit(1)
    if not msg:
        os._exit(0)  # the zygote ended
    call_process(msg, fds, chan, early)
