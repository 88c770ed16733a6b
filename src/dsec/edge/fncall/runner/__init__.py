"""FnCall pool runner: serves short stateless calls inside one warm pool sandbox.

Standalone on purpose (stdlib only, Python >= 3.11, never imports dsec): it runs in the
sandbox on the image's python3, which has neither pydantic nor dsec. It is shipped there as
one file, a zip of this package (``dsec.edge.fncall.ship``), which python3 runs like a script.
So every import here is relative, and nothing here may import from outside this package but
the stdlib. The edge starts it once per sandbox, as root, through a pipe:

    python3 fncall-runner.py --workdir /tmp/fncall --preload json,math
                             [--uid 65534 --gid 65534] [--scrub /tmp,/var/tmp,/dev/shm,/run/lock,/dev/mqueue]
                             [--mergeable SEED]

and speaks newline-delimited JSON (the shapes of ``dsec.protocol.fncall``). First line out:
``{"ready": true, "preloaded": [...], "private_net": bool, "call_uid": int, "mergeable_bytes":
int, "fixed_layout": bool}``, or
``{"ready": false, "error": "..."}`` and exit status 2. Then one FnTask per line in, one
FnResult per line out, in order; EOF on stdin ends the runner.

With ``--mergeable`` (an edge that runs ksmd passes its pool's seed), the runner re-execs
itself once without address randomization and with SEED as its hash seed, and marks what its
preloads built mergeable: the runners of a pool then hold the same pages, which KSM keeps once.

Isolation of a call:
- Every process of a call is forked by a zygote that holds no task: the warm one forked from
  this runner after the preloads and before any task was read (a Python call that may use
  them starts with the modules imported), the lean one a fresh interpreter the runner execs
  at start (exec'd programs, and Python programs that import only the standard library:
  ``imports``). No call can find an earlier call's task or inputs, or its own
  ``expected_stdout``, in its memory.
- The child: its own session (one killpg reaches its tree), when the runner may create
  namespaces its own IPC namespace and a network namespace with no socket of an earlier call
  in it (shared by calls while that holds: ``netns.SharedNet``), a fresh 0700 call dir as cwd,
  rlimits, then the unprivileged call uid with no_new_privs; stdin from a memfd, output to pipes read here.
- After it: every process of the call is proven gone (``calls.py`` says how), then its files,
  the call uid's entries in the scrub dirs and its System V IPC objects are removed, and all
  of that verified: the result's ``clean``.

The call uid must belong to calls alone: every process of it is killed after each call, and
RLIMIT_NPROC counts all of its processes and threads. ``--scrub`` must name every directory,
outside the call dir, where that uid can create files (with the pool's layers read-only: the
tmpfs ones). Per process of a call: RLIMIT_AS = memory_limit_mb (compilers: at least 1 GiB),
RLIMIT_CPU = ceil(run_timeout_s) + 1 s (SIGXCPU; SIGKILL a second later), RLIMIT_NPROC 2048
(processes and threads), RLIMIT_FSIZE 256 MiB, RLIMIT_NOFILE 1024, no core files; the
wall-clock timeout is the runner's, which kills the call's session.

Modules, in the order a call meets them: ``serve`` (main loop), ``wire`` (task in, result
out), ``calls`` (the runner's side of a call), ``imports`` (which zygote), ``files``,
``zygote`` and ``netns``, ``process`` (the call process), ``capture`` (its output), ``judge``
(its status), ``cleanup``; ``layout`` and ``libc`` serve them all.
"""
