"""The FnCall runner, end to end on the host: what a caller sees of each call, and that no call
can see or outlive another. Each test gets a fresh runner (``conftest.py``) running as root, whose
calls drop to an unprivileged call uid, the way they do in a pool sandbox.
"""

from __future__ import annotations

import ast
import base64
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from dsec.edge.fncall import RUNNER_PATH
from tests.fncall.client import Runner, fresh_uid, kill_leftovers, procs_of

HELLO = {
    "python": "name = input()\nprint(f'hello {name}')\n",
    "bash": 'read -r name\necho "hello $name"\n',
    "c": "#include <stdio.h>\n"
    'int main(void){char n[64]; scanf("%63s", n); printf("hello %s\\n", n); return 0;}\n',
    "cpp": "#include <iostream>\n#include <string>\n"
    'int main(){std::string n; std::cin >> n; std::cout << "hello " << n << std::endl;}\n',
}

# Lists the live processes of the call's own uid, as the call sees them.
LIST_MY_PROCESSES = """
import os
mine = []
for p in filter(str.isdigit, os.listdir('/proc')):
    try:
        status = open(f'/proc/{p}/status').read()
    except OSError:
        continue
    if status.split('Uid:')[1].split()[0] == str(os.getuid()):
        mine.append(int(p))
print(mine == [os.getpid()], mine)
"""


def assert_clean(runner: Runner, workdir: Path) -> None:
    """What every call must leave: no process of the call uid, nothing under the workdir."""
    assert procs_of(runner.uid) == []
    assert list(workdir.iterdir()) == []


@pytest.mark.parametrize("language", ["python", "bash", "c", "cpp"])
def test_each_language_says_hello_and_reads_stdin(runner: Runner, workdir: Path, language: str) -> None:
    r = runner.call(language=language, code=HELLO[language], stdin="world\n")
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("ok", 0, "hello world\n", "")
    assert r.clean
    assert (r.compile_time_s > 0) == (language in ("c", "cpp"))
    assert_clean(runner, workdir)


def test_calls_run_as_the_unprivileged_call_uid(runner: Runner) -> None:
    r = runner.call(language="bash", code="id -u; id -G; ls .")
    assert r.stdout.split("\n")[:2] == [str(runner.uid), str(runner.uid)]
    assert "main.sh" in r.stdout


def test_preloaded_modules_are_already_imported(runner: Runner) -> None:
    assert runner.ready.ready and runner.ready.preloaded == ["json", "fractions"]
    seen = "import sys\nseen = 'fractions' in sys.modules, 'wave' in sys.modules\n"
    r = runner.call(language="python", code=seen + "import fractions, wave\nprint(*seen, __name__)")
    assert r.stdout == "True False __main__\n"  # fractions came with the pool, wave did not
    # A program that may import one by name at run time forks from the warm zygote too.
    r = runner.call(language="python", code=seen + "__import__('wave')\nprint(*seen)")
    assert r.stdout == "True False\n"
    # One that imports only the standard library, and nothing preloaded, forks from the lean
    # zygote (made before the preloads): a smaller fork and exit, the same answers.
    r = runner.call(language="python", code=seen + "import os.path, wave as w\nprint(*seen, __name__)")
    assert r.stdout == "False False __main__\n" and r.clean
    # The lean zygote is a fresh interpreter, not a fork of the runner: none of the runner's
    # task handling, nor the modules only the runner needs, is in its calls' memory.
    runner_only = "import sys\nprint([m for m in sys.modules if m.endswith(('.calls', '.wire', 'json'))])"
    assert runner.call(language="python", code=runner_only).stdout == "[]\n"


def test_each_call_draws_its_own_random_numbers(runner: Runner, workdir: Path) -> None:
    """Every call process is a fork of a zygote: were random's state inherited unreseeded, every
    call would draw the same numbers (a grader's random tests, a sampler's seeds). From the lean
    zygote (random not preloaded: imported by the call) and from a warm one that preloaded
    random (reseeded in each fork by random's own at-fork hook)."""
    code = "import random\nprint(random.random())"
    assert len({runner.call(language="python", code=code).stdout for _ in range(4)}) == 4
    warm = Runner(workdir.with_name("warm"), preload="random")
    try:
        assert warm.ready.preloaded == ["random"]
        draws = {warm.call(language="python", code=code).stdout for _ in range(4)}
        assert len(draws) == 4, f"calls forked from a zygote holding random drew the same: {draws}"
    finally:
        assert warm.close() == 0
        assert kill_leftovers(warm.uid) == []
        shutil.rmtree(workdir.with_name("warm"), ignore_errors=True)


def test_compile_errors(runner: Runner) -> None:
    r = runner.call(language="c", code="int main( {")
    assert r.status == "compile_error" and r.exit_code == 1
    assert "main.c:1" in r.stderr and "error" in r.stderr
    assert r.run_time_s == 0.0 and r.clean
    r = runner.call(language="cpp", code="int main() { undeclared(); }")
    assert r.status == "compile_error" and "undeclared" in r.stderr


def test_python_runtime_error_has_the_user_traceback(runner: Runner) -> None:
    r = runner.call(language="python", code="def f():\n    return 1 / 0\nf()\n")
    assert (r.status, r.exit_code, r.signal) == ("runtime_error", 1, None)
    assert 'File "main.py", line 3' in r.stderr and "ZeroDivisionError" in r.stderr
    assert "runner.py" not in r.stderr  # the runner's own frames are not the user's business


@pytest.mark.parametrize(
    ("code", "exit_code", "stderr"),
    [
        ("import sys\nsys.exit(3)", 3, ""),
        ("import sys\nsys.exit('bye')", 1, "bye\n"),
        ("raise SystemExit", 0, ""),
        ("import os\nos._exit(5)", 5, ""),
    ],
)
def test_python_exit_statuses(runner: Runner, code: str, exit_code: int, stderr: str) -> None:
    r = runner.call(language="python", code=code)
    assert (r.exit_code, r.stderr) == (exit_code, stderr)
    assert r.status == ("ok" if exit_code == 0 else "runtime_error")


def test_python_calls_end_like_the_interpreter_does(runner: Runner) -> None:
    code = """
import sys, threading, time
print(len(sys.stdin.read()), end=' ')  # left in the buffer: the end of the call flushes it
def late():
    time.sleep(0.2)
    print('thread done')
threading.Thread(target=late).start()  # not a daemon: the call waits for it
"""
    r = runner.call(language="python", code=code, stdin="x" * (8 << 20))
    assert (r.status, r.stdout) == ("ok", f"{8 << 20} thread done\n")


def test_a_crash_reports_its_signal(runner: Runner) -> None:
    r = runner.call(language="c", code="int main(void){ volatile int *p = 0; *p = 1; return 0; }")
    assert (r.status, r.exit_code, r.signal) == ("runtime_error", None, 11)


@pytest.mark.parametrize(
    ("language", "code"),
    [
        ("python", "while True: pass"),
        ("python", "import time\ntime.sleep(100)"),
        ("bash", "sleep 100"),
        ("c", "int main(void){ for(;;); }"),
    ],
)
def test_a_program_that_does_not_end_times_out(
    runner: Runner, workdir: Path, language: str, code: str
) -> None:
    r = runner.call(language=language, code=code, run_timeout_s=1)
    assert r.status == "timeout" and r.signal == 9
    assert r.clean
    assert_clean(runner, workdir)


@pytest.mark.parametrize(
    ("language", "code"),
    [
        ("python", "x = bytearray(10**10)"),
        ("python", "x = []\nwhile True:\n    x.append(' ' * 10**6)"),
        (
            "cpp",
            "#include <vector>\nint main(){ std::vector<char*> v; for(;;) v.push_back(new char[1 << 20]); }",
        ),
        ("bash", "x=$(head -c 1000000000 /dev/zero | tr '\\0' x)"),
    ],
)
def test_a_memory_bomb_is_memory_exceeded(runner: Runner, workdir: Path, language: str, code: str) -> None:
    r = runner.call(language=language, code=code, memory_limit_mb=128)
    assert r.status == "memory_exceeded", r
    assert r.clean
    assert_clean(runner, workdir)


@pytest.mark.parametrize(
    ("language", "code"),
    [
        ("bash", ":(){ :|:& };:\nsleep 5"),
        ("python", "import os\nwhile True:\n    os.fork()"),
        ("python", "import os\nwhile True:\n    if os.fork() == 0:\n        os.setsid()"),
    ],
)
def test_a_fork_bomb_is_contained(runner: Runner, workdir: Path, language: str, code: str) -> None:
    r = runner.call(language=language, code=code, run_timeout_s=2)
    assert r.status in ("timeout", "runtime_error")
    assert r.clean
    assert_clean(runner, workdir)
    after = runner.call(language="python", code=LIST_MY_PROCESSES)
    assert after.status == "ok" and after.stdout.startswith("True")


@pytest.mark.parametrize(
    ("language", "code", "stream"),
    [
        (
            "python",
            "import sys\nchunk = 'x' * 65535 + '\\n'\nfor _ in range(800):\n    sys.stdout.write(chunk)",
            "out",
        ),
        ("bash", "head -c 50000000 /dev/zero | tr '\\0' y >&2", "err"),
        (
            "c",
            "#include <stdio.h>\nint main(void){ for (long i = 0; i < 50000000; i++) putchar(120); }",
            "out",
        ),
    ],
)
def test_huge_output_is_capped_and_marked(runner: Runner, language: str, code: str, stream: str) -> None:
    cap = 1 << 20
    r = runner.call(language=language, code=code, max_output_bytes=cap, expected_stdout="x")
    assert r.status == "output_truncated" and r.judged is False
    kept, truncated = (r.stdout, r.stdout_truncated) if stream == "out" else (r.stderr, r.stderr_truncated)
    assert truncated and len(kept) == cap
    assert r.exit_code == 0 and r.clean


def test_files_of_one_call_are_gone_for_the_next(runner: Runner, workdir: Path) -> None:
    tmp_note = f"/tmp/fncall-note-{runner.uid}"
    first = runner.call(
        language="python",
        code=f"""
import os
open('note.txt', 'w').write('call 1')
open({tmp_note!r}, 'w').write('call 1')
os.makedirs('/dev/shm/fncall-{runner.uid}')
try:
    open('../planted', 'w')
    print('wrote the workdir')
except PermissionError:
    pass
print(os.getcwd())
""",
    )
    assert first.status == "ok", first
    cwd1 = first.stdout.strip()
    assert first.clean and not Path(cwd1).exists() and not Path(tmp_note).exists()
    assert list(workdir.iterdir()) == []  # the call dir went, and nothing was planted beside it
    second = runner.call(
        language="python",
        code=f"""
import os
print(os.getcwd() != {cwd1!r}, os.path.exists({cwd1!r}), os.path.exists({tmp_note!r}),
      os.path.exists('/dev/shm/fncall-{runner.uid}'), sorted(os.listdir('.')))
""",
    )
    assert second.stdout == "True False False False ['main.py']\n"


def test_a_background_process_does_not_survive_into_the_next_call(runner: Runner, workdir: Path) -> None:
    first = runner.call(
        language="bash",
        code="nohup sleep 1000 >/dev/null 2>&1 &\nsetsid sleep 1000 &\necho started",
    )
    assert first.status == "ok" and first.stdout == "started\n" and first.clean
    assert_clean(runner, workdir)
    second = runner.call(language="python", code=LIST_MY_PROCESSES)
    assert second.stdout.startswith("True"), second.stdout


# clone(CLONE_PARENT): the new process is the zygote's child, not the call's (x86_64 numbers).
SIBLING_OF_THE_CALL = """
import ctypes, os, time
pid = ctypes.CDLL(None).syscall(56, 0x8000 | 17, 0, 0, 0, 0)
if pid == 0:
    time.sleep(1000)
    os._exit(0)
print(pid > 0, os.getppid() == int(open(f'/proc/{pid}/stat').read().split()[3]))
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="raw clone syscall number")
def test_a_sibling_of_the_call_is_not_taken_for_a_clean_end(runner: Runner, workdir: Path) -> None:
    # The fast proof (no child of the call left under the runner or the zygote) must see it.
    first = runner.call(language="python", code=SIBLING_OF_THE_CALL)
    assert first.stdout == "True True\n", first
    alive = [p for p in procs_of(runner.uid) if Path(f"/proc/{p}/stat").read_text().split()[2] != "Z"]
    assert alive == []
    assert not first.clean or procs_of(runner.uid) == []
    second = runner.call(language="python", code=LIST_MY_PROCESSES)
    assert second.stdout.startswith("True"), second.stdout


def test_a_call_cannot_reach_the_runner(runner: Runner) -> None:
    code = """
import os, signal
try:
    os.kill(os.getppid(), signal.SIGKILL)
except PermissionError:
    print('refused')
"""
    r = runner.call(language="python", code=code)
    assert r.stdout == "refused\n"
    assert runner.call(language="bash", code="echo still serving").stdout == "still serving\n"


def test_a_call_has_no_network(runner: Runner) -> None:
    assert runner.ready.private_net
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = f"""
import socket
try:
    socket.create_connection(('127.0.0.1', {port}), timeout=2)
    print('connected')
except OSError:
    print('unreachable')
"""
        r = runner.call(language="python", code=code)
    assert r.stdout == "unreachable\n"


NETNS = "import os\nprint(os.readlink('/proc/self/ns/net'), os.readlink('/proc/self/ns/ipc'))\n"

# Leaves a listener bound to 127.0.0.1 (loopback is down in a call: binding works, connecting
# does not) held by nothing but descriptors in flight in a cycle of unix sockets (no process
# holds it once the call ends), and prints the port.
LEAVE_A_LISTENER = """
import socket
a, b = socket.socketpair()
server = socket.socket()
server.bind(('127.0.0.1', 0))
server.listen()
socket.send_fds(a, [b'x'], [a.fileno(), server.fileno()])
socket.send_fds(b, [b'y'], [b.fileno()])
print(server.getsockname()[1])
"""


def test_calls_share_a_network_namespace_while_it_holds_nothing_of_theirs(runner: Runner) -> None:
    """Creating one per call was ~1 ms of CPU: calls reuse one while it has no socket left in it
    (System V IPC outlives processes, so that namespace stays per call)."""
    first, second = (runner.call(language="python", code=NETNS).stdout.split() for _ in range(2))
    assert first[0] == second[0] and first[1] != second[1]


def test_a_socket_left_by_a_call_is_not_in_the_next_calls_network(runner: Runner) -> None:
    before = runner.call(language="python", code=NETNS).stdout.split()[0]
    port = int(runner.call(language="python", code=LEAVE_A_LISTENER).stdout)
    probe = f"""
import os, socket
socket.socket().bind(('127.0.0.1', {port}))
print(os.readlink('/proc/self/ns/net'))
"""
    r = runner.call(language="python", code=probe)
    assert r.status == "ok", r.stderr  # the port is free: the listener is not in this namespace
    assert r.stdout.strip() != before
    after = runner.call(language="python", code=NETNS).stdout.split()[0]
    assert after == r.stdout.strip()  # the fresh one is shared from then on


SYSV_WRITE = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
shm = libc.shmget(0x5EED, 4096, 0o600 | 0o1000)
ctypes.memmove(libc.shmat(shm, None, 0), b"secret of call A", 16)
print(shm, libc.semget(0x5EED, 1, 0o600 | 0o1000), libc.msgget(0x5EED, 0o600 | 0o1000))
"""
SYSV_READ = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print(libc.shmget(0x5EED, 0, 0), libc.semget(0x5EED, 0, 0), libc.msgget(0x5EED, 0))
"""


def test_system_v_ipc_of_a_call_is_gone_without_namespaces(workdir: Path) -> None:
    """In a pool sandbox (no CAP_SYS_ADMIN) calls share the sandbox's IPC namespace: a segment
    one call wrote, readable by the next (same uid), must go with the call."""
    runner = Runner(workdir, without_sys_admin=True)
    try:
        assert not runner.ready.private_net
        made = runner.call(language="python", code=SYSV_WRITE)
        assert made.status == "ok" and min(map(int, made.stdout.split())) >= 0, made.stderr
        assert made.clean
        seen = runner.call(language="python", code=SYSV_READ)
        assert seen.stdout.split() == ["-1", "-1", "-1"]
    finally:
        assert runner.close() == 0
        kill_leftovers(runner.uid)
        subprocess.run(["ipcrm", "-M", "0x5eed", "-S", "0x5eed", "-Q", "0x5eed"], capture_output=True)


def test_input_files_and_fetch_files_round_trip(runner: Runner) -> None:
    blob = bytes(range(256)) * 3
    code = """
import os
data = open('data/in.bin', 'rb').read()
os.makedirs('out')
open('out/result.bin', 'wb').write(data[::-1])
os.symlink('/etc/passwd', 'leak')
os.symlink('out/result.bin', 'alias')
os.mkfifo('pipe')
print(len(data))
"""
    r = runner.call(
        language="python",
        code=code,
        files={"data/in.bin": base64.b64encode(blob).decode()},
        fetch_files=["out/result.bin", "missing.txt", "leak", "alias", "out", "pipe"],
    )
    assert r.status == "ok" and r.stdout == f"{len(blob)}\n", r
    assert r.file_bytes("out/result.bin") == blob[::-1]
    assert list(r.files) == ["out/result.bin"]
    assert r.fetch_errors["missing.txt"] == "missing"
    assert r.fetch_errors["leak"] == "escapes the call directory"
    assert "cannot open" in r.fetch_errors["alias"]  # symlinks are never followed
    assert r.fetch_errors["out"] == r.fetch_errors["pipe"] == "not a regular file"


def test_locked_directories_are_still_wiped(runner: Runner, workdir: Path) -> None:
    code = "import os\nos.makedirs('a/b/c')\nopen('a/b/c/f', 'w').write('x')\n"
    code += "os.chmod('a/b', 0)\nos.chmod('a', 0)"
    r = runner.call(language="python", code=code)
    assert r.status == "ok" and r.clean
    assert_clean(runner, workdir)


@pytest.mark.parametrize(
    ("language", "code", "status"),
    [
        ("python", "print(6 * 7)", "ok"),
        ("python", "print('42   ')\nprint()\n", "ok"),  # trailing spaces and blank lines do not count
        ("c", '#include <stdio.h>\nint main(void){ printf("42"); return 0; }', "ok"),
        ("python", "print(41)", "wrong_answer"),
        ("python", "print('garbage')\nprint(42)\nimport sys\nsys.exit(0)", "wrong_answer"),
        ("python", "import os\nos._exit(0)\nprint(42)", "wrong_answer"),
        ("bash", "echo 42; exit 0; echo more", "ok"),
        ("bash", "echo 4; echo 2; exit 0", "wrong_answer"),
        ("python", "print(42)\nraise ValueError", "runtime_error"),
    ],
)
def test_the_runner_judges_stdout_not_the_exit_status(
    runner: Runner, language: str, code: str, status: str
) -> None:
    r = runner.call(language=language, code=code, expected_stdout="42\n")
    assert r.status == status, r
    assert r.judged is (status == "ok")


def test_a_call_cannot_find_the_expected_answer_or_earlier_inputs_in_memory(runner: Runner) -> None:
    earlier, own, expected = secrets.token_hex(16), secrets.token_hex(16), secrets.token_hex(16)
    runner.call(language="python", code="print(input())", stdin=f"ZQXJUDGE:{earlier}\n")
    # Scans all of its own memory for ZQXJUDGE:<32 hex>. It must find what it was given (its
    # stdin) and made (the decoy), so the scan works; the runner's secrets must be absent.
    code = r"""
import ctypes, re
given = input()
decoy = 'ZQXJUDGE:' + 'ab' * 16
found = set()
for line in open('/proc/self/maps'):
    fields = line.split()
    if not fields[1].startswith('r') or (len(fields) > 5 and fields[5].startswith('[v')):
        continue  # unreadable, or kernel pages ([vvar], [vsyscall]) that fault when read
    lo, hi = (int(x, 16) for x in fields[0].split('-'))
    data = ctypes.string_at(lo, hi - lo)
    found.update(m.decode() for m in re.findall(rb'ZQXJUDGE:([0-9a-f]{32})', data))
print(sorted(found))
"""
    r = runner.call(
        language="python", code=code, stdin=f"ZQXJUDGE:{own}\n", expected_stdout=f"ZQXJUDGE:{expected}\n"
    )
    assert r.status == "wrong_answer", r
    found = ast.literal_eval(r.stdout)
    assert "ab" * 16 in found and own in found
    assert expected not in found and earlier not in found


@pytest.mark.parametrize(
    "line",
    [
        b"not json\n",
        b"[]\n",
        b'{"language": "cobol", "code": ""}\n',
        b'{"language": "python", "code": "", "files": {"../escape": ""}}\n',
        b'{"language": "python", "code": "", "fetch_files": ["/etc/shadow"]}\n',
        b'{"language": "python", "code": "", "run_timeout_s": 1e9}\n',
        b'{"language": "python", "code": "", "surprise": 1}\n',
        b"\xff\xfe\n",
    ],
)
def test_an_invalid_task_line_is_an_internal_error_and_the_runner_keeps_serving(
    runner: Runner, line: bytes
) -> None:
    r = runner.send_line(line)
    assert r.status == "internal_error" and r.stderr.startswith("invalid task")
    assert runner.call(language="python", code="print('next')").stdout == "next\n"


def test_the_runner_ends_cleanly_when_its_input_ends(workdir: Path) -> None:
    r = Runner(workdir)
    try:
        assert r.call(language="bash", code="sleep 1000 &").status == "ok"
    finally:
        rc = r.close()
        leftovers = kill_leftovers(r.uid)
    assert rc == 0 and leftovers == []
    assert os.listdir(workdir) == []


def test_a_missing_preload_module_fails_the_start(workdir: Path) -> None:
    r = Runner(workdir, preload="json,no_such_module_here")
    rc = r.close()
    assert r.ready.ready is False and "no_such_module_here" in (r.ready.error or "")
    assert rc == 2


def test_without_root_calls_still_run_but_never_count_as_clean() -> None:
    uid = fresh_uid()
    home = Path(tempfile.mkdtemp(prefix="fncall-non-root-"))  # under /tmp: reachable for that uid
    try:
        os.chmod(home, 0o755)
        shutil.copy(RUNNER_PATH, home / "runner.py")
        os.chown(home, uid, uid)
        r = Runner(home / "work", preload="json", non_root_uid=uid, runner_path=home / "runner.py")
        try:
            assert (r.ready.ready, r.ready.call_uid, r.ready.private_net) == (True, uid, False)
            res = r.call(language="python", code="import os\nprint(os.getuid())")
            assert (res.status, res.stdout) == ("ok", f"{uid}\n")
            assert res.clean is False  # a call could have tampered with its own-uid runner
            assert r.call(language="bash", code="sleep 100", run_timeout_s=1).status == "timeout"
        finally:
            rc = r.close()
        assert rc == 0
    finally:
        kill_leftovers(uid)
        shutil.rmtree(home)
