"""FnCall end to end: warm pools of real container sandboxes behind the API, the SDK and the
SandboxFusion-compatible route. One node with a pool of two sandboxes serves the module."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from dsec import DSecClient
from dsec.backends.container import cgroups
from dsec.edge.fncall.pool import POOL_LABEL, PoolConfig
from dsec.images.base import TOOLCHAIN_PACKAGES, TOOLCHAIN_REF, ensure_base_layer
from dsec.images.store import LayerStore
from dsec.node.embedded import EmbeddedNode, NodeConfig
from dsec.protocol.errors import CapacityExhausted, InvalidRequest
from dsec.protocol.fncall import FnResult, FnTask
from tests.conftest import DATA_DIR
from tests.support import eventually

pytestmark = pytest.mark.slow
POOL_SIZE = 2


@pytest.fixture(scope="module")
async def fn_node(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EmbeddedNode]:
    with LayerStore(DATA_DIR / "layers") as store:
        ensure_base_layer(store, TOOLCHAIN_REF, packages=TOOLCHAIN_PACKAGES)
    tmp = tmp_path_factory.mktemp("fncall")
    # Python calls go to "py" (listed first); everything else to "default", which has all four.
    py_pool = PoolConfig(name="py", size=1, image=TOOLCHAIN_REF, preload=["json"], languages=["python"])
    pool = PoolConfig(size=POOL_SIZE, image=TOOLCHAIN_REF, max_calls=40)
    cfg = NodeConfig(
        data_dir=DATA_DIR / "fncall-node",
        layer_dir=DATA_DIR / "layers",
        port=0,
        node="fn",
        config_file=tmp / "config.json",
        edge={"reap_interval_s": 0.1, "fncall_pools": [py_pool, pool]},
    )
    node = EmbeddedNode(cfg)
    await node.start()
    try:
        yield node
    finally:
        await node.close(stop_sandboxes=True)


@pytest.fixture
async def fn(fn_node: EmbeddedNode) -> AsyncIterator[DSecClient]:
    async with DSecClient(fn_node.url, fn_node.api_key) as c:
        yield c


def py(code: str, **kw: object) -> FnTask:
    return FnTask.model_validate({"language": "python", "code": code, **kw})


@pytest.mark.parametrize(
    ("language", "code"),
    [
        ("python", "import sys; print('hi', sys.stdin.read().strip())"),
        ("bash", 'read x; echo "hi $x"'),
        ("c", '#include <stdio.h>\nint main(){char b[64]; scanf("%63s", b); printf("hi %s\\n", b);}'),
        ("cpp", '#include <iostream>\nint main(){std::string s; std::cin >> s; std::cout << "hi " << s;}'),
    ],
)
async def test_each_language_runs(fn: DSecClient, language: str, code: str) -> None:
    result = await fn.fncall({"language": language, "code": code, "stdin": "there\n"})
    assert (result.status, result.stdout.strip(), result.exit_code) == ("ok", "hi there", 0), result.stderr
    if language in ("c", "cpp"):
        assert result.compile_time_s > 0


async def test_failures_of_the_program_are_statuses(fn: DSecClient) -> None:
    results = await fn.fncall_many(
        [
            {"language": "c", "code": "int main( {"},
            py("raise ValueError('boom')"),
            py("while True: pass", run_timeout_s=1),
            py("x = bytearray(10**10)", memory_limit_mb=256),
            {"language": "bash", "code": "yes | head -c 50000000", "max_output_bytes": 10000},
        ]
    )
    statuses = [r.status if isinstance(r, FnResult) else repr(r) for r in results]
    assert statuses == ["compile_error", "runtime_error", "timeout", "memory_exceeded", "output_truncated"]
    assert isinstance(results[1], FnResult) and "ValueError: boom" in results[1].stderr
    assert isinstance(results[4], FnResult) and len(results[4].stdout) == 10000


async def test_a_batch_keeps_its_order_and_one_bad_call_does_not_sink_it(fn: DSecClient) -> None:
    tasks: list[FnTask | dict[str, object]] = [py(f"print({i} * {i})") for i in range(12)]
    tasks.insert(5, {"language": "cobol", "code": "DISPLAY 'HI'."})
    results = await fn.fncall_many(tasks, concurrency=8)
    assert isinstance(results[5], InvalidRequest)
    squares = [r.stdout for r in results[:5] + results[6:] if isinstance(r, FnResult)]
    assert squares == [f"{i * i}\n" for i in range(12)]


async def test_a_call_sees_nothing_of_the_calls_before_it(fn: DSecClient) -> None:
    # Enough calls to land on every pool sandbox more than once.
    leave = "echo x > /tmp/left; echo x > left; (sleep 1000 &); nohup sleep 999 >/dev/null 2>&1 &"
    look = (
        "import os\n"
        "me = os.getuid()\n"
        "others = [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()\n"
        "          and os.stat(f'/proc/{p}').st_uid == me]\n"
        "print(os.path.exists('/tmp/left'), os.path.exists('left'), others)\n"
    )
    for _ in range(2 * POOL_SIZE):
        left = await fn.fncall({"language": "bash", "code": leave}, pool="default")
        assert left.status == "ok" and left.clean
    for _ in range(2 * POOL_SIZE):
        seen = await fn.fncall(py(look), pool="default")
        assert seen.stdout == "False False []\n", seen  # no file, no process of the calls uid


async def test_a_fork_bomb_is_contained_and_the_pool_serves_on(fn: DSecClient) -> None:
    bomb = await fn.fncall({"language": "bash", "code": ":(){ :|:& };:", "run_timeout_s": 2})
    # Whatever the bomb's own status, the sweep after it proves the sandbox clean again.
    assert bomb.status in ("timeout", "runtime_error", "ok") and bomb.clean
    after = await fn.fncall_many([py("print('alive')") for _ in range(2 * POOL_SIZE)])
    assert all(isinstance(r, FnResult) and r.stdout == "alive\n" for r in after)


async def test_calls_have_no_network(fn: DSecClient) -> None:
    code = (
        "import socket\n"
        "print(sorted(n for _, n in socket.if_nameindex()))\n"
        "try:\n"
        "    socket.create_connection(('1.1.1.1', 53), timeout=2)\n"
        "except OSError as exc:\n"
        "    print('refused', type(exc).__name__)\n"
    )
    result = await fn.fncall(py(code))
    assert result.stdout == "['lo']\nrefused OSError\n"  # a namespace of its own, loopback only


async def test_the_judge_is_the_runner_not_the_program(fn: DSecClient) -> None:
    honest = await fn.fncall(py("print(42)", expected_stdout="42\n"))
    assert (honest.status, honest.judged) == ("ok", True)
    cheat = "import sys\nprint('garbage')\nprint(42)\nsys.exit(0)"
    cheated = await fn.fncall(py(cheat, expected_stdout="42\n"))
    assert (cheated.status, cheated.judged) == ("wrong_answer", False)


async def test_files_go_in_and_come_back(fn: DSecClient) -> None:
    task = FnTask.with_files(
        {"data/in.bin": b"\x00\x01binary"},
        language="python",
        code="d = open('data/in.bin','rb').read(); open('out.txt','w').write(str(len(d)))",
        fetch_files=["out.txt", "missing.txt"],
    )
    result = await fn.fncall(task)
    assert result.status == "ok" and result.file_bytes("out.txt") == b"8"
    assert "missing.txt" in result.fetch_errors


async def test_a_crashed_pool_sandbox_is_replaced_without_failing_other_calls(
    fn: DSecClient, fn_node: EmbeddedNode
) -> None:
    pool = fn_node.edge.pools["default"]
    victim = next(iter(pool._workers))
    record = fn_node.edge.journal.get(victim)
    assert record is not None
    os.kill(record.handle.pid, signal.SIGKILL)  # the sandbox's init: everything in it dies
    calls = [py("print('ok')") for _ in range(4 * POOL_SIZE)]
    results = await fn.fncall_many(calls, concurrency=4, pool="default")
    assert all(isinstance(r, FnResult) and r.stdout == "ok\n" for r in results), results
    await eventually(lambda: victim not in pool._workers and len(pool._workers) == POOL_SIZE, "a new sandbox")
    assert pool.recycled >= 1


async def test_pool_sandboxes_are_the_edges_own(fn: DSecClient, fn_node: EmbeddedNode) -> None:
    assert await fn.list() == []
    pools = {sid for sid, live in fn_node.edge._live.items() if POOL_LABEL in live.record.spec.labels}
    assert len(pools) == POOL_SIZE + 1
    assert "fncall" in fn_node.edge.stats()["backends"]


async def test_calls_work_in_a_memory_backed_directory(fn: DSecClient) -> None:
    mounts = "print([m.split()[2] for m in open('/proc/self/mounts') if m.split()[1] == '/tmp/fncall'])"
    assert (await fn.fncall(py(mounts))).stdout == "['tmpfs']\n"


async def test_calls_go_to_the_pool_of_their_language(fn: DSecClient, fn_node: EmbeddedNode) -> None:
    pools = fn_node.edge.pools

    def served(name: str) -> int:
        return sum(w.calls for w in pools[name]._workers.values())

    before = {name: served(name) for name in pools}
    # It imports json, so it forks from the warm zygote: only the "py" pool's has json loaded.
    preloaded = "import sys\nseen = 'json' in sys.modules\nimport json\nprint(seen)"
    assert (await fn.fncall(py(preloaded))).stdout == "True\n"
    assert (await fn.fncall({"language": "bash", "code": "echo b"})).stdout == "b\n"
    assert served("py") == before["py"] + 1, "python: the preloading pool"
    assert served("default") == before["default"] + 1, "bash: the general pool"
    assert (await fn.fncall(py("print(1)"), pool="default")).stdout == "1\n"  # or by name
    with pytest.raises(CapacityExhausted, match="no node"):
        await fn.fncall(py("print(1)"), pool="nosuchpool")


async def test_sandboxfusion_clients_only_change_their_url(fn_node: EmbeddedNode, tmp_path: Path) -> None:
    base = f"{fn_node.url}/sandboxfusion/{fn_node.api_key}"
    async with aiohttp.ClientSession() as http:

        async def run_code(body: dict[str, object], url: str = base) -> tuple[int, dict[str, object]]:
            async with http.post(f"{url}/run_code", json=body) as resp:
                return resp.status, await resp.json()

        status, ok = await run_code({"code": "print(input()[::-1])", "language": "python", "stdin": "abc"})
        assert status == 200 and ok["status"] == "Success"
        assert ok["run_result"] == {
            **ok["run_result"],
            "status": "Finished",
            "return_code": 0,
            "stdout": "cba\n",
        }
        _, failed = await run_code({"code": "int main( {", "language": "cpp", "compile_timeout": 20})
        assert failed["status"] == "Failed" and failed["run_result"] is None
        assert failed["compile_result"]["return_code"] != 0  # type: ignore[index]
        _, slow = await run_code(
            {"code": "import time; time.sleep(30)", "language": "python", "run_timeout": 1}
        )
        assert slow["run_result"]["status"] == "TimeLimitExceeded"  # type: ignore[index]
        _, odd = await run_code({"code": "x", "language": "fortran"})
        assert odd["status"] == "SandboxError" and "fortran" in str(odd["message"])
        status, _ = await run_code(
            {"code": "print(1)", "language": "python"}, url=f"{fn_node.url}/sandboxfusion/nope"
        )
        assert status == 401


def runner_pids(sandbox_id: str) -> list[int]:
    """The pool runner of a sandbox and its zygote (a fork of it: the same command line); not
    the zygote's own fork waiting for the next call, whose pages are the zygote's until it runs."""
    procs = (cgroups.sandbox_dir("memory", sandbox_id) / "cgroup.procs").read_text().split()
    runners = {int(p) for p in procs if b"runner.py" in Path(f"/proc/{p}/cmdline").read_bytes()}
    parent = {p: int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) for p in runners}
    return sorted(p for p in runners if parent[p] not in runners or parent[parent[p]] not in runners)


def ksm_merging_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/ksm_stat").read_text().splitlines():
        if line.startswith("ksm_merging_pages"):
            return int(line.split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return 0


async def test_the_runners_of_a_pool_are_merged_by_ksm(fn_node: EmbeddedNode) -> None:
    # The edge started ksmd (or found it running), so every runner came up --mergeable, laid out
    # as the others of its pool: their identical pages are kept once.
    assert fn_node.edge.stats()["ksm"]["running"]
    workers = list(fn_node.edge.pools["default"]._workers)
    pids = [pid for sid in workers for pid in runner_pids(sid)]
    assert len(pids) == 2 * POOL_SIZE, pids

    def merged() -> list[int] | None:
        each = [ksm_merging_bytes(pid) for pid in pids]
        return each if min(each) >= 4 << 20 else None

    await eventually(merged, "KSM to merge the pool's runners", timeout=180)
    assert fn_node.edge.stats()["ksm"]["saved_bytes"] >= 4 << 20
