"""A call process: what it does between its request and the user's program.

It takes its fds (stdin, stdout, stderr, a status pipe) from the runner, its rlimits, the
unprivileged call uid and no_new_privs, then execs the program, or for Python runs main.py in
this warm interpreter (the zygote's preloads already imported) the way ``python3 main.py``
would. ``rlimits`` and ``ENV`` are what the runner puts in the request.
"""

from __future__ import annotations

import ctypes
import marshal
import math
import os
import resource
import signal
import socket
import sys
import types

from . import layout
from .libc import PR_SET_NO_NEW_PRIVS, libc

TYPE_CHECKING = False  # not typing itself: this module is in the lean zygote (zygote.py)
if TYPE_CHECKING:
    from typing import NoReturn

# Per call: processes+threads of the call uid (RLIMIT_NPROC counts threads; real programs start
# a thread pool per core, graders 100s of threads), fds, file size. The pool sandbox's pids
# cgroup is the hard bound; NPROC stays below it so the runner can always fork its killer.
NPROC, NOFILE, FSIZE = 2048, 1024, 256 << 20
COMPILE_MEMORY_MB = 1024  # compilers need more address space than most programs they build
# USER and LOGNAME: the call uid has no passwd entry, and getpass.getuser() (cache dirs of
# torch, matplotlib) asks the environment first. MPLBACKEND: a call has no display, and
# Debian's matplotlibrc names a GUI backend.
ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "USER": "sandbox",
    "LOGNAME": "sandbox",
    "MPLBACKEND": "Agg",
}


def rlimits(memory_mb: int | None, cpu_s: float) -> list[list[int]]:
    """The rlimits of one process of a call, as the request carries them: [resource, soft, hard]."""
    mem = resource.RLIM_INFINITY if memory_mb is None else memory_mb << 20
    cpu = math.ceil(cpu_s) + 1
    return [
        [resource.RLIMIT_AS, mem, mem],
        [resource.RLIMIT_CPU, cpu, cpu + 1],  # SIGXCPU first, SIGKILL a second later
        [resource.RLIMIT_NPROC, NPROC, NPROC],
        [resource.RLIMIT_FSIZE, FSIZE, FSIZE],
        [resource.RLIMIT_NOFILE, NOFILE, NOFILE],
        [resource.RLIMIT_CORE, 0, 0],
    ]


def fresh_random() -> None:
    """Seed what a fork would share with every other call of its zygote, from the OS, as a
    fresh interpreter seeds it: numpy's legacy global generator (``np.random.rand`` and the
    like), made when a preload imported ``numpy.random``. (``random`` reseeds itself in a fork
    by its own hook; ``np.random.default_rng()`` draws fresh entropy each time.)"""
    seed = getattr(sys.modules.get("numpy.random"), "seed", None)
    if seed is not None:
        seed()


def call_process(msg: bytes, fds: list[int], chan: socket.socket, early: BaseException | None) -> NoReturn:
    """Become the call: fds 0-3 from the runner, limits, the call uid; then exec or run Python.

    fd 3 is a close-on-exec status pipe: b"E<why>" when setup failed (an internal error),
    b"S" when Python user code starts, then b"M" if a MemoryError escaped it.
    """
    code = 127
    try:
        chan.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.set_inheritable(3, False)
        os.closerange(4, 1 << 20)
        if early is not None:
            raise early
        req = marshal.loads(msg)  # from the runner, through the zygote
        os.chdir(req["cwd"])
        for res, soft, hard in req["limits"]:
            resource.setrlimit(res, (soft, hard))
        if req["uid"] is not None:
            os.setgroups([])
            os.setgid(req["gid"])
            os.setuid(req["uid"])
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if layout.own_layout:  # the layout of this process stays the zygote's; what it execs is randomized
            libc.personality(0)
        if req["argv"] is not None:
            for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores them; programs expect defaults
                signal.signal(sig, signal.SIG_DFL)
            os.execvpe(req["argv"][0], req["argv"], req["env"])
        code = _run_python(req["cwd"], req["env"])
    except BaseException as exc:
        try:
            os.write(3, b"E" + f"call setup failed: {exc!r}".encode()[:4000])
        except BaseException:
            pass
    finally:
        os._exit(code)


def _run_python(cwd: str, env: dict[str, str]) -> int:
    """Run main.py in this warm process the way `python3 main.py` would; return the exit status."""
    os.environ.clear()
    os.environ.update(env)
    sys.stdin = open(0, encoding="utf-8", errors="surrogateescape", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", errors="surrogateescape", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
    sys.argv, sys.path[0] = ["main.py"], cwd
    main = types.ModuleType("__main__")
    main.__file__ = os.path.join(cwd, "main.py")
    sys.modules["__main__"] = main
    os.write(3, b"S")
    status = 0
    try:
        with open("main.py", "rb") as f:
            exec(compile(f.read(), "main.py", "exec"), main.__dict__)
    except SystemExit as exc:
        status = 0 if exc.code is None else exc.code & 0xFF if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except MemoryError as exc:
        os.write(3, b"M")  # before anything that allocates
        main.__dict__.clear()  # room to format the traceback
        _print_user_exception(exc)
        status = 1
    except BaseException as exc:
        _print_user_exception(exc)
        status = 1
    join_threads = getattr(sys.modules.get("threading"), "_shutdown", None)
    flush_original = getattr(sys.__stdout__, "flush", None)  # the zygote's, still on fd 1
    for finish in (join_threads, sys.stdout.flush, sys.stderr.flush, flush_original):  # as exit does
        try:
            if finish is not None:
                finish()
        except BaseException:
            status = status or 120
    return status


def _print_user_exception(exc: BaseException) -> None:
    tb = exc.__traceback__.tb_next if exc.__traceback__ else None  # drop the runner's own frame
    try:
        # What `python3 main.py` prints for an uncaught exception, by the same C code (the
        # traceback module would sit in the lean zygote's heap for this).
        sys.__excepthook__(type(exc), exc.with_traceback(tb), tb)  # it prints exc's own
    except BaseException:
        pass
