"""Several files in one multipart upload, each part named by its path (``write_files``).

The SDKs name a part by the file's path (``filename="/tmp/a"``); envd takes it whole. aiohttp's
own ``part.filename`` strips the leading ``/``, which put ``/tmp/a`` at ``~/tmp/a``: found with
the JS SDK (``tests/e2b/test_js_sdk.py``), and the Python SDKs did the same.
"""

from __future__ import annotations

from tests.e2b.conftest import E2B


async def test_write_files_keeps_absolute_and_home_relative_paths(e2b: E2B) -> None:
    out = await e2b.run(
        """
        sbx = Sandbox.create(timeout=60)
        infos = sbx.files.write_files([
            {"path": "/tmp/m/a.txt", "data": "a"},
            {"path": "rel/b.txt", "data": "b"},
        ])
        shown = sbx.commands.run("cat /tmp/m/a.txt ~/rel/b.txt; test -e ~/tmp || echo no-home-tmp")
        print(json.dumps({"paths": [i.path for i in infos], "stdout": shown.stdout}))
        """
    )
    assert out["paths"][0] == "/tmp/m/a.txt" and out["paths"][1].endswith("/rel/b.txt")
    assert out["stdout"] == "abno-home-tmp\n"
