"""``/sandboxfusion/<key>/run_code`` against SandboxFusion's documented behaviour (issue 29).

Every field of the request and of the answer, as SandboxFusion's server (``sandbox_api.py``,
``runners/base.py``) produces them, on what RL graders send: statuses, return codes, a signal
as a negative code, compile results, files both ways (absolute paths too), stdin, unicode.
Where DSec answers differently on purpose (invalid UTF-8, truncated output) the test says
what DSec answers and README says why. The last tests use SandboxFusion's own client library
(``sandbox-fusion`` from PyPI) unchanged. One real node with two pools serves the module.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from sandbox_fusion import RunCodeRequest, RunStatus, SummaryMapping, summary_run_code_result
from sandbox_fusion.async_client import run_code as sf_run_code

from dsec.apiserver.sandboxfusion import OUTPUT_CAP
from dsec.edge.fncall.pool import PoolConfig
from dsec.images.base import TOOLCHAIN_PACKAGES, TOOLCHAIN_REF, ensure_base_layer
from dsec.images.store import LayerStore
from dsec.node.embedded import EmbeddedNode, NodeConfig
from tests.conftest import DATA_DIR

pytestmark = pytest.mark.slow


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
async def sf_node(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EmbeddedNode]:
    with LayerStore(DATA_DIR / "layers") as store:
        ensure_base_layer(store, TOOLCHAIN_REF, packages=TOOLCHAIN_PACKAGES)
    tmp = tmp_path_factory.mktemp("sandboxfusion")
    pools = [
        PoolConfig(name="py", size=2, image=TOOLCHAIN_REF, languages=["python"]),
        PoolConfig(name="default", size=1, image=TOOLCHAIN_REF, languages=["bash", "c", "cpp"]),
    ]
    cfg = NodeConfig(
        data_dir=DATA_DIR / "sandboxfusion-node",
        layer_dir=DATA_DIR / "layers",
        port=0,
        node="sf",
        config_file=tmp / "config.json",
        edge={"reap_interval_s": 0.1, "fncall_pools": pools},
    )
    node = EmbeddedNode(cfg)
    await node.start()
    try:
        yield node
    finally:
        await node.close(stop_sandboxes=True)


@pytest.fixture
async def run_code(sf_node: EmbeddedNode) -> AsyncIterator[Any]:
    url = f"{sf_node.url}/sandboxfusion/{sf_node.api_key}/run_code"
    async with aiohttp.ClientSession() as http:

        async def call(**body: Any) -> dict[str, Any]:
            async with http.post(url, json=body) as resp:
                assert resp.status == 200, await resp.text()
                answer: dict[str, Any] = await resp.json()
                return answer

        yield call


# -- statuses and return codes -----------------------------------------------------------------


async def test_success_has_every_field_sandboxfusion_answers(run_code: Any) -> None:
    r = await run_code(
        code="import sys; print(sys.stdin.read()[::-1]); print('e', file=sys.stderr)",
        language="python",
        stdin="abc",
    )
    assert set(r) == {"status", "message", "compile_result", "run_result", "executor_pod_name", "files"}
    assert (r["status"], r["message"], r["compile_result"], r["files"]) == ("Success", "", None, {})
    run = r["run_result"]
    assert set(run) == {"status", "execution_time", "return_code", "stdout", "stderr"}
    assert (run["status"], run["return_code"], run["stdout"], run["stderr"]) == (
        "Finished",
        0,
        "cba\n",
        "e\n",
    )
    assert isinstance(run["execution_time"], float) and run["execution_time"] > 0


@pytest.mark.parametrize(
    ("language", "code", "return_code"),
    [
        ("python", "import sys; sys.exit(3)", 3),
        ("python", "raise ValueError('boom')", 1),
        ("python", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -15),  # signals: negative
        ("bash", "exit 7", 7),
        ("bash", "kill -SEGV $$", -11),
        ("cpp", "#include <cstdlib>\nint main(){ std::abort(); }", -6),
        ("c", "int main(void){ return 42; }", 42),
    ],
)
async def test_a_failing_program_is_failed_with_its_return_code(
    run_code: Any, language: str, code: str, return_code: int
) -> None:
    r = await run_code(code=code, language=language)
    assert (r["status"], r["message"]) == ("Failed", "")
    assert (r["run_result"]["status"], r["run_result"]["return_code"]) == ("Finished", return_code)
    if return_code == 1:
        assert "ValueError: boom" in r["run_result"]["stderr"]


async def test_a_timeout_is_failed_with_time_limit_exceeded_and_no_return_code(run_code: Any) -> None:
    r = await run_code(
        code="print('partial', flush=True)\nwhile True: pass", language="python", run_timeout=1
    )
    assert r["status"] == "Failed"
    run = r["run_result"]
    assert (run["status"], run["return_code"], run["stdout"]) == ("TimeLimitExceeded", None, "partial\n")


async def test_compile_results(run_code: Any) -> None:
    bad = await run_code(code="int main( {", language="cpp")
    assert (bad["status"], bad["run_result"]) == ("Failed", None)
    comp = bad["compile_result"]
    assert comp["status"] == "Finished" and comp["return_code"] != 0 and "error" in comp["stderr"]
    good = await run_code(code='#include <cstdio>\nint main(){ puts("ok"); }', language="cpp")
    assert good["status"] == "Success"
    assert (good["compile_result"]["status"], good["compile_result"]["return_code"]) == ("Finished", 0)
    assert (good["run_result"]["stdout"], good["run_result"]["return_code"]) == ("ok\n", 0)


# -- input and output ------------------------------------------------------------------------


async def test_files_go_in_and_come_back_relative_and_absolute(run_code: Any) -> None:
    code = (
        "data = open('in/a.txt').read()\n"
        "open('out.bin', 'wb').write(bytes(range(256)))\n"
        "open('/mnt/b', 'w').write('sauce')\n"  # SandboxFusion's own fetch_files test
        "open('/data/given.txt', 'a').write('+')\n"
        "print(data, open('/data/given.txt').read())\n"
    )
    files = {"in/a.txt": b64("héllo".encode()), "/data/given.txt": b64(b"abs"), "IGNORED": None}
    r = await run_code(
        code=code,
        language="python",
        files=files,
        fetch_files=["out.bin", "/mnt/b", "/data/given.txt", "nope"],
    )
    assert r["status"] == "Success", r
    assert r["run_result"]["stdout"] == "héllo abs+\n"
    fetched = {k: base64.b64decode(v) for k, v in r["files"].items()}
    assert fetched == {
        "out.bin": bytes(range(256)),
        "/mnt/b": b"sauce",
        "/data/given.txt": b"abs+",
    }  # missing: absent
    # The next call in that sandbox sees none of it.
    after = await run_code(
        code="import os; print(os.path.exists('/mnt/b'), os.path.exists('/data'))", language="python"
    )
    assert after["run_result"]["stdout"] == "False False\n"


async def test_a_path_in_the_sandboxs_system_is_refused_and_says_why(run_code: Any) -> None:
    r = await run_code(code="print(1)", language="python", fetch_files=["/etc/passwd"])
    assert r["status"] == "SandboxError" and "system directories" in r["message"]


async def test_unicode_round_trips_and_invalid_utf8_is_replaced_not_lost(run_code: Any) -> None:
    r = await run_code(code="print(input()[::-1], '✓')", language="python", stdin="żółw 🐢")
    assert (r["status"], r["run_result"]["stdout"]) == ("Success", "🐢 włóż ✓\n")
    # SandboxFusion answers "[DecodeError] ..." for the whole stream; DSec keeps the valid part.
    raw = await run_code(code="import sys; sys.stdout.buffer.write(b'ok \\xff\\xfe end')", language="python")
    assert (raw["status"], raw["run_result"]["stdout"]) == ("Success", "ok \ufffd\ufffd end")


async def test_large_outputs_of_graded_programs_come_back_whole(run_code: Any) -> None:
    py = await run_code(code="import sys; sys.stdout.write('7 ' * 1_500_000)", language="python")  # 3 MB
    assert py["status"] == "Success" and len(py["run_result"]["stdout"]) == 3_000_000
    cpp = '#include <cstdio>\nint main(){ for (int i = 0; i < 1000000; i++) printf("%03d\\n", i % 1000); }'
    big = await run_code(code=cpp, language="cpp")  # 4 MB
    assert big["status"] == "Success" and len(big["run_result"]["stdout"]) == 4_000_000


async def test_truncated_output_is_never_a_success(run_code: Any) -> None:
    code = f"import sys; sys.stdout.write('x' * {OUTPUT_CAP + 1})"
    r = await run_code(code=code, language="python")
    assert r["status"] == "SandboxError" and "truncated" in r["message"] and "not judged" in r["message"]
    assert r["run_result"]["status"] == "Error"  # what SandboxFusion itself pairs with SandboxError


# -- what RL programs do -----------------------------------------------------------------------


async def test_memory_limit_minus_one_means_the_pool_sandboxs_memory(run_code: Any) -> None:
    code = "b = bytearray(400 << 20); print(len(b) >> 20)"
    r = await run_code(code=code, language="python", memory_limit_MB=-1)
    assert (r["status"], r["run_result"]["stdout"]) == ("Success", "400\n"), r
    limited = await run_code(code=code, language="python", memory_limit_MB=128)
    assert (limited["status"], limited["run_result"]["return_code"]) == ("Failed", 1)
    assert "MemoryError" in limited["run_result"]["stderr"]


async def test_threads_processes_and_shared_memory_work(run_code: Any) -> None:
    code = (
        "import threading, multiprocessing as mp\n"
        "b = threading.Barrier(1025)\n"
        "ts = [threading.Thread(target=b.wait) for _ in range(1024)]\n"
        "[t.start() for t in ts]; b.wait(); [t.join() for t in ts]\n"
        "with mp.Pool(4) as p:\n"
        "    print(len(ts), sum(p.map(abs, range(-10, 0))))\n"
    )
    r = await run_code(code=code, language="python", run_timeout=60)
    assert (r["status"], r["run_result"]["stdout"]) == ("Success", "1024 55\n"), r["run_result"]["stderr"][
        -2000:
    ]
    leftover = await run_code(code="import os; print(os.listdir('/dev/shm'))", language="python")
    assert leftover["run_result"]["stdout"] == "[]\n"


async def test_sandboxfusion_limits_on_files_and_timeouts_are_met(run_code: Any) -> None:
    files = {f"t/{i}.in": b64(str(i).encode()) for i in range(100)}
    code = "import os; print(sum(int(open(f't/{n}').read()) for n in os.listdir('t')))"
    r = await run_code(code=code, language="python", files=files, run_timeout=600, compile_timeout=600)
    assert (r["status"], r["run_result"]["stdout"]) == ("Success", "4950\n"), r


# -- SandboxFusion's own client, unchanged ---------------------------------------------------


async def test_sandboxfusions_client_library_works_unchanged(sf_node: EmbeddedNode) -> None:
    endpoint = f"{sf_node.url}/sandboxfusion/{sf_node.api_key}"
    ok = await sf_run_code(
        RunCodeRequest(code="print(input())", language="python", stdin="hi"), endpoint=endpoint
    )
    assert ok.status == RunStatus.Success and ok.run_result is not None and ok.run_result.stdout == "hi\n"
    mapping = SummaryMapping(
        Success="pass", Failed="fail", CompileFailed="ce", RunTimeout="tle", RunFailed="re"
    )
    assert summary_run_code_result(ok, mapping) == "pass"
    ce = await sf_run_code(RunCodeRequest(code="int main( {", language="cpp"), endpoint=endpoint)
    assert summary_run_code_result(ce, mapping) == "ce"
    tle = await sf_run_code(
        RunCodeRequest(code="while True: pass", language="python", run_timeout=1), endpoint=endpoint
    )
    assert summary_run_code_result(tle, mapping) == "tle"
    re_ = await sf_run_code(RunCodeRequest(code="1/0", language="python"), endpoint=endpoint)
    assert summary_run_code_result(re_, mapping) == "re"
    # A truncated output is a sandbox error to the client: it raises rather than score it.
    big = RunCodeRequest(code=f"print('x' * {OUTPUT_CAP + 1})", language="python")
    with pytest.raises(Exception, match="truncated"):
        await sf_run_code(big, endpoint=endpoint, max_attempts=1)


def test_the_conformance_suite_covers_every_field_of_run_code() -> None:
    """A field added to the request or the answer needs a test here."""
    from dsec.apiserver.sandboxfusion import CommandRunResult, RunCodeResponse
    from dsec.apiserver.sandboxfusion import RunCodeRequest as Ours

    assert set(Ours.model_fields) == {
        "code",
        "language",
        "compile_timeout",
        "run_timeout",
        "memory_limit_MB",
        "stdin",
        "files",
        "fetch_files",
    }
    assert set(RunCodeResponse.model_fields) == {
        "status",
        "message",
        "compile_result",
        "run_result",
        "executor_pod_name",
        "files",
    }
    assert set(CommandRunResult.model_fields) == {
        "status",
        "execution_time",
        "return_code",
        "stdout",
        "stderr",
    }
