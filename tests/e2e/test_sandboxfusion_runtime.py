"""SandboxFusion's dataset graders, pointed at DSec: the FnCall base's python libraries (numpy,
pandas, sympy, ...: ``FNCALL_PYTHON_PACKAGES``), a pool on it with the heavy modules preloaded,
and requests shaped like what each grader sends to ``/run_code``. The harness code is ours,
written from reading how each grader wraps a solution (which imports it prepends, how it calls
and checks); no SandboxFusion runs."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from dsec.edge.fncall.pool import PoolConfig
from dsec.images.base import TOOLCHAIN_PACKAGES, TOOLCHAIN_REF, ensure_base_layer
from dsec.images.store import LayerStore
from dsec.node.embedded import EmbeddedNode, NodeConfig
from tests.conftest import DATA_DIR

pytestmark = pytest.mark.slow

# What HumanEval-style graders put before every python solution (numpy among them).
PRELUDE = "\n".join(
    [
        *(f"import {m}" for m in ("math", "re", "sys", "copy", "datetime", "itertools", "collections")),
        *(f"import {m}" for m in ("heapq", "statistics", "functools", "hashlib", "numpy", "string")),
        "import numpy as np",
        "from typing import *",
        "from collections import *",
    ]
)


def node_config(name: str, tmp: Any, pools: list[PoolConfig]) -> NodeConfig:
    return NodeConfig(
        data_dir=DATA_DIR / f"{name}-node",
        layer_dir=DATA_DIR / "layers",
        port=0,
        node=name,
        config_file=tmp / f"{name}.json",
        edge={"reap_interval_s": 0.1, "fncall_pools": pools},
    )


@pytest.fixture(scope="module")
async def runtime_node(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EmbeddedNode]:
    with LayerStore(DATA_DIR / "layers") as store:
        ensure_base_layer(store, TOOLCHAIN_REF, packages=TOOLCHAIN_PACKAGES)
    tmp = tmp_path_factory.mktemp("sf-runtime")
    pool = PoolConfig(name="py", size=2, languages=["python"], preload=["numpy", "pandas", "sympy"])
    node = EmbeddedNode(node_config("sfrt", tmp, [pool]))
    await node.start()
    try:
        yield node
    finally:
        await node.close(stop_sandboxes=True)


@pytest.fixture
async def run_code(runtime_node: EmbeddedNode) -> AsyncIterator[Any]:
    url = f"{runtime_node.url}/sandboxfusion/{runtime_node.api_key}/run_code"
    async with aiohttp.ClientSession() as http:

        async def call(code: str, **body: Any) -> dict[str, Any]:
            async with http.post(url, json={"code": code, "language": "python", **body}) as resp:
                assert resp.status == 200
                answer: dict[str, Any] = await resp.json()
                return answer

        yield call


def passed(r: dict[str, Any]) -> bool:
    return bool(r["status"] == "Success" and r["run_result"]["return_code"] == 0)


def why(r: dict[str, Any]) -> str:
    return str(r["run_result"]["stderr"]) if r["run_result"] else str(r["message"])


async def test_the_runtime_has_the_graders_modules(run_code: Any) -> None:
    code = (
        "import numpy, scipy.optimize, pandas, sympy, sklearn, networkx, bs4, lxml\n"
        "import matplotlib.pyplot as plt\n"
        "x = sympy.symbols('x'); print(sympy.solve(x**2 - 4, x))\n"
        "root = scipy.optimize.brentq(lambda t: t - 1, 0, 2)\n"
        "print(pandas.DataFrame({'a': [1, 2]}).a.sum(), round(root))\n"
        "plt.plot([1, 2]); plt.savefig('p.png'); print(numpy.arange(3).sum())\n"
    )
    r = await run_code(code)
    assert passed(r), why(r)
    assert r["run_result"]["stdout"] == "[-2, 2]\n3 1\n3\n"


async def test_each_call_draws_its_own_random_numbers_with_numpy_preloaded(run_code: Any) -> None:
    """numpy's global generator is made when the pool preloads numpy: every call forks from that
    process, and as a fresh `python3` each must draw its own numbers (a grader's random tests,
    a simulation's seeds), as python's random module does."""
    code = "import numpy as np, random\nprint(np.random.rand(), np.random.randint(1 << 30), random.random())"
    draws = []
    for _ in range(4):
        r = await run_code(code)
        assert passed(r), why(r)
        draws.append(r["run_result"]["stdout"].split())
    for column in zip(*draws, strict=True):
        assert len(set(column)) == 4, f"calls drew the same numbers: {draws}"


SOLUTION = "def add_all(xs: List[int]) -> int:\n    return int(np.sum(xs))\n"
WRONG = "def add_all(xs: List[int]) -> int:\n    return 0\n"
CHECK = "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n"


@pytest.mark.parametrize(("solution", "ok"), [(SOLUTION, True), (WRONG, False)])
async def test_humaneval_and_mhpp_shape(run_code: Any, solution: str, ok: bool) -> None:
    r = await run_code(f"{PRELUDE}\n{solution}\n{CHECK}\ncheck(add_all)\n", run_timeout=20)
    assert passed(r) is ok, why(r)
    if not ok:
        assert "AssertionError" in r["run_result"]["stderr"]


async def test_mbpp_shape(run_code: Any) -> None:
    tests = ["assert min_cost([3, 1, 2]) == 1", "assert min_cost([5]) == 5"]
    r = await run_code("def min_cost(xs):\n    return min(xs)\n\n" + "\n".join(tests))
    assert passed(r), why(r)


async def test_code_contests_shape_stdin_to_stdout(run_code: Any) -> None:
    solution = "n = int(input())\nprint(' '.join(str(i * i) for i in range(n)))\n"
    r = await run_code(solution, stdin="5\n", run_timeout=10)
    assert passed(r) and r["run_result"]["stdout"].strip() == "0 1 4 9 16"


async def test_live_code_bench_functional_shape(run_code: Any) -> None:
    """LiveCodeBench's harness imports numpy, calls a method of class Solution per test with
    JSON-encoded arguments and compares the JSON-decoded answers."""
    solution = "class Solution:\n    def twice(self, nums: List[int]) -> List[int]:\n"
    solution += "        return [2 * n for n in nums]\n"
    cases = [{"input": "[1, 2]", "output": "[2, 4]"}, {"input": "[]", "output": "[]"}]
    harness = (
        f"{PRELUDE}\nimport json\n{solution}\n"
        f"cases = json.loads({json.dumps(json.dumps(cases))})\n"
        "for case in cases:\n"
        "    got = Solution().twice(*[json.loads(line) for line in case['input'].split('\\n')])\n"
        "    assert got == json.loads(case['output']), (got, case)\n"
        "print('all', len(cases))\n"
    )
    r = await run_code(harness)
    assert passed(r) and r["run_result"]["stdout"] == "all 2\n", why(r)


async def test_cruxeval_shape(run_code: Any) -> None:
    code = "def f(text):\n    return text[::-1].upper()\n\nassert f('abc') == 'CBA'\n"
    assert passed(await run_code(code))
    wrong = await run_code(code.replace("'CBA'", "'ABC'"))
    assert wrong["status"] == "Failed" and wrong["run_result"]["return_code"] == 1


async def test_palmath_shape_sympy_and_multiprocessing(run_code: Any) -> None:
    """PAL-math compares a solution's answer to the reference symbolically (sympy), in a child
    process with a timeout (multiprocessing), reading the reference from a file."""
    code = (
        "import json, multiprocessing\nfrom sympy import simplify\n"
        "from sympy.parsing.sympy_parser import parse_expr\n"
        "def solution():\n    return '2*(x+1)'\n"
        "def equal(a, b, q):\n    q.put(simplify(parse_expr(a) - parse_expr(b)) == 0)\n"
        "gt = json.loads(open('answer.json').read())['gt']\n"
        "q = multiprocessing.Queue()\n"
        "p = multiprocessing.Process(target=equal, args=(solution(), gt, q)); p.start(); p.join(20)\n"
        "assert q.get()\n"
    )
    files = {"answer.json": base64.b64encode(b'{"gt": "2*x + 2"}').decode()}
    r = await run_code(code, files=files, run_timeout=30)
    assert passed(r), why(r)
