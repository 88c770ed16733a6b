"""E2B's template build API (issue 30): the SDK's v2 ``Template()`` builder builds DSec layers.

Each test runs once per SDK version (2.63 and 2.34 have the same builder and routes). Builds
start from DSec's own base layer (``debian:bookworm``, no registry pull) and are kept to one or
two steps: each runs a build sandbox.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import aiohttp
import pytest

from dsec.node.embedded import EmbeddedNode
from dsec.protocol.errors import LayerNotFound
from tests.e2b.conftest import E2B, OTHER_PROJECT, PROJECT

_CONTEXT = """
        import asyncio, pathlib, tempfile
        from e2b import AsyncSandbox, AsyncTemplate, Template
        ctx = tempfile.mkdtemp()
        pathlib.Path(ctx, "app").mkdir()
        pathlib.Path(ctx, "app", "hello.txt").write_text("hello from copy\\n")
        PROBE = ("cat /srv/app/hello.txt; cat /srv/app/built.txt; cat /tmp/started; echo $GREETING;"
                 " stat -c %U /srv/app/hello.txt; whoami; stat -c %U /tmp/started; pwd")
        def template(cls):
            # skip_cache: every run builds (an identical build, of an earlier run too, is reused)
            return (cls(file_context_path=ctx).skip_cache().from_debian_image("bookworm")
                    .set_envs({"GREETING": "hi there"})
                    .run_cmd("useradd -m -u 1500 app")
                    .set_user("app")
                    .set_workdir("/srv/app")
                    .copy("app/hello.txt", "/srv/app/")
                    .run_cmd('echo "built as $(whoami) in $(pwd) with $GREETING" > built.txt')
                    .set_start_cmd("pwd > /tmp/started; exec sleep 3600", "test -s /tmp/started"))
"""


def _name(e2b: E2B, what: str) -> str:
    return f"t-{e2b.version.replace('.', '')}-{what}-{uuid.uuid4().hex[:6]}"


async def test_build_then_a_sandbox_sees_files_env_workdir_and_start_command(e2b: E2B) -> None:
    sync_name, async_name = _name(e2b, "sync"), _name(e2b, "async")
    out = await e2b.run(
        _CONTEXT
        + f"""
        def sync():
            logs = []
            keep = lambda e: logs.append(e.message)
            info = Template.build(template(Template), {sync_name!r}, on_build_logs=keep)
            sbx = Sandbox.create({sync_name!r}, timeout=120)
            got = sbx.commands.run(PROBE).stdout.splitlines()
            return [info.template_id, info.build_id, got, logs, Template.exists({sync_name!r})]
        async def main():
            info = await AsyncTemplate.build_in_background(template(AsyncTemplate), {async_name!r})
            statuses = []
            while not statuses or statuses[-1] in ("building", "waiting"):
                status = await AsyncTemplate.get_build_status(info, logs_offset=0)
                statuses.append(status.status.value)
                await asyncio.sleep(0.2)
            sbx = await AsyncSandbox.create({async_name!r}, timeout=120)
            got = (await sbx.commands.run(PROBE)).stdout.splitlines()
            return [info.template_id, statuses[-1], got, [e.message for e in status.log_entries]]
        print(json.dumps({{"sync": sync(), "async": asyncio.run(main())}}))
        """,
        timeout=600,
    )
    # USER app: the later steps, the start command and the sandbox's commands run as app.
    want = ["hello from copy", "built as app in /srv/app with hi there", "/srv/app", "hi there"]
    want += ["app", "app", "app", "/srv/app"]  # and commands start in its WORKDIR, as envd's
    template_id, build_id, got, logs, exists = out["sync"]
    assert got == want, out
    assert exists is True
    assert template_id and build_id, out
    assert any(m.startswith("[6/6] RUN") for m in logs), logs  # the steps' progress streamed
    template_id, status, got, logs = out["async"]
    assert status == "ready" and got == want, out
    assert any("commit e2b/" in m for m in logs), logs


async def test_a_template_from_a_template_keeps_its_layers_env_and_user(e2b: E2B) -> None:
    parent, child = _name(e2b, "parent"), _name(e2b, "child")
    out = await e2b.run(
        f"""
        from e2b import Template
        Template.build(Template().from_template("debian:bookworm").set_envs({{"LEVEL": "parent"}})
                       .run_cmd("useradd -m -u 1600 dev && echo parent > /etc/parent.txt")
                       .set_user("dev").set_workdir("/home/dev/w"), {parent!r})
        step = 'echo "$LEVEL $(whoami) $(pwd)" > child.txt'
        Template.build(Template().from_template({parent!r}).run_cmd(step), {child!r})
        sbx = Sandbox.create({child!r}, timeout=60)
        probe = "cat /etc/parent.txt /home/dev/w/child.txt; whoami; echo $LEVEL; pwd"
        print(json.dumps(sbx.commands.run(probe).stdout))
        """,
        timeout=300,
    )
    assert out.split() == ["parent", "parent", "dev", "/home/dev/w", "dev", "parent", "/home/dev/w"], out


async def test_a_failing_step_is_an_error_status_with_its_logs(e2b: E2B) -> None:
    name = _name(e2b, "fail")
    out = await e2b.run(
        f"""
        from e2b import Template, BuildException
        t = Template().from_debian_image("bookworm").run_cmd("echo about to fail; exit 3")
        logs = []
        try:
            Template.build(t, {name!r}, on_build_logs=lambda e: logs.append(e.message))
            failed = None
        except BuildException as e:
            failed = str(e)
        info = Template.build_in_background(t, {name!r})
        while (status := Template.get_build_status(info)).status.value in ("building", "waiting"):
            time.sleep(0.2)
        reason = status.reason
        try:
            Sandbox.create({name!r}, timeout=30)
            created = True
        except Exception as e:
            created = f"{{type(e).__name__}}: {{e}}"
        print(json.dumps([failed, logs, status.status.value, reason.message, reason.step,
                          [e.message for e in reason.log_entries], created]))
        """,
        timeout=300,
    )
    failed, logs, status, message, step, reason_logs, created = out
    assert failed and "exited with code 3" in failed, out
    assert "about to fail" in logs, out
    assert status == "error" and "exited with code 3" in message and step == "1", out
    assert "about to fail" in reason_logs, out
    assert "404" in created and "no ready build" in created, out  # nothing to create from


async def test_a_missing_base_is_a_build_error_not_a_500(e2b: E2B) -> None:
    out = await e2b.run(
        f"""
        from e2b import Template, BuildException
        try:
            Template.build(Template().from_image("no-such-registry.example/img:1").run_cmd("true"),
                           {_name(e2b, "nobase")!r})
            print(json.dumps(None))
        except BuildException as e:
            print(json.dumps(str(e)))
        """,
        timeout=120,
    )
    assert out and "nor a layer on this node" in out and "dsec image import" in out, out


async def test_another_project_neither_sees_nor_uses_the_template(e2b: E2B, node: EmbeddedNode) -> None:
    name = _name(e2b, "private")
    info = await e2b.run(
        f"""
        from e2b import Template
        # skip_cache: the template gets a layer of its own (a hit would reuse an earlier one's)
        t = Template().skip_cache().from_debian_image("bookworm").run_cmd("echo secret > /s")
        info = Template.build(t, {name!r})
        print(json.dumps([info.template_id, info.build_id]))
        """,
        timeout=300,
    )
    template_id, build_id = info
    layer = f"e2b/{template_id}:1"
    node.store.resolve_image(layer, viewer=lambda owner: owner == PROJECT)  # the project's layer
    with pytest.raises(LayerNotFound):
        node.store.resolve_image(layer, viewer=lambda owner: owner == OTHER_PROJECT)
    out = await e2b.run(
        f"""
        from e2b import Template
        from e2b.template.types import BuildInfo
        seen = []
        for template in ({name!r}, {template_id!r}, {layer!r}):
            try:
                Sandbox.create(template, timeout=30)
                seen.append("created")
            except Exception as e:
                seen.append(f"{{type(e).__name__}}: {{e}}")
        try:
            Template.get_build_status(BuildInfo(template_id={template_id!r}, build_id={build_id!r},
                                                alias={name!r}, name={name!r}, tags=[]))
            seen.append("status")
        except Exception as e:
            seen.append(f"{{type(e).__name__}}: {{e}}")
        seen.append(Template.exists({name!r}))
        print(json.dumps(seen))
        """,
        key=e2b.other_key,
    )
    assert all(seen.startswith("SandboxException: 404") for seen in out[:3]), out
    assert out[3].startswith("BuildException: 404") and out[4] is False, out
    async with aiohttp.ClientSession(headers={"X-API-Key": e2b.other_key}) as http:
        async with http.get(f"{e2b.url}/templates") as resp:
            assert resp.status == 200
            assert template_id not in {t["templateID"] for t in await resp.json()}
        async with http.delete(f"{e2b.url}/templates/{template_id}") as resp:
            assert resp.status == 404
    async with aiohttp.ClientSession(headers={"X-API-Key": e2b.key}) as http:
        async with http.get(f"{e2b.url}/templates/{template_id}") as resp:
            assert resp.status == 200, await resp.text()
            body = await resp.json()
            assert body["names"] == [name] and body["buildStatus"] == "ready", body
        async with http.delete(f"{e2b.url}/templates/{template_id}") as resp:
            assert resp.status == 204
        async with http.get(f"{e2b.url}/templates/aliases/{name}") as resp:
            assert resp.status == 404


_BAD_REQUESTS = [
    ("POST", "/v3/templates", {}, "name is required"),
    ("POST", "/v3/templates", {"name": "Bad Name!"}, "template name"),
    ("POST", "/v3/templates", {"name": "ok", "cpuCount": 1000}, "cpuCount"),
    ("POST", "/v3/templates", {"name": "x" * 300}, "name"),
    ("POST", "/v3/templates", {"name": "ok", "tags": ["t"] * 17}, "tags"),
]
_BAD_STEPS = [
    ({"steps": [{"type": "RUN", "args": ["a", "root", "extra"]}]}, "step 1 (RUN)"),
    ({"steps": [{"type": "ENV", "args": ["ONLY_NAME"]}]}, "name, value pairs"),
    ({"steps": [{"type": "ENV", "args": ["1BAD", "v"]}]}, "environment variable name"),
    ({"steps": [{"type": "COPY", "args": ["a", "/b"]}]}, "filesHash"),
    ({"steps": [{"type": "COPY", "args": ["../a", "/b"], "filesHash": "ab"}]}, "relative"),
    ({"steps": [{"type": "USER", "args": ["Root; rm"]}]}, "user name"),
    ({"steps": [{"type": "FROM", "args": ["x"]}]}, "steps.0.type"),
    ({"steps": [{"type": "RUN", "args": ["x" * 70000]}]}, "longer than"),
    ({"fromImage": "a", "fromTemplate": "b"}, "not both"),
    ({"fromImageRegistry": {"type": "registry"}}, "registry"),
    ({"steps": [{"type": "COPY", "args": ["a", "/b"], "filesHash": "ab"}]}, "were not uploaded"),
]


@pytest.mark.parametrize("e2b", ["2.63.0"], indirect=True)
async def test_bad_input_is_a_400_with_a_reason(e2b: E2B) -> None:
    async with aiohttp.ClientSession(headers={"X-API-Key": e2b.key}) as http:
        for method, path, body, why in _BAD_REQUESTS:
            async with http.request(method, e2b.url + path, json=body) as resp:
                text = await resp.text()
                assert resp.status == 400 and why in text, (body, resp.status, text)
        async with http.post(f"{e2b.url}/v3/templates", json={"name": _name(e2b, "bad")}) as resp:
            assert resp.status == 202
            made = await resp.json()
        tid, bid = made["templateID"], made["buildID"]
        for body, why in _BAD_STEPS:
            async with http.post(f"{e2b.url}/v2/templates/{tid}/builds/{bid}", json=body) as resp:
                text = await resp.text()
                assert resp.status == 400 and why in text, (body, resp.status, text)
        for query in ("logsOffset=-1", "logsOffset=x", "limit=1000"):
            async with http.get(f"{e2b.url}/templates/{tid}/builds/{bid}/status?{query}") as resp:
                assert resp.status == 400, query
        async with http.get(f"{e2b.url}/templates/{tid}/files/{'!' * 10}") as resp:
            assert resp.status == 400
        async with http.get(f"{e2b.url}/templates/{tid}/builds/{uuid.uuid4()}/status") as resp:
            assert resp.status == 404
        async with http.get(f"{e2b.url}/templates/nope/builds/{bid}/status") as resp:
            assert resp.status == 404
        async with http.put(f"{e2b.url}/templates/uploads/not-a-token", data=b"x") as resp:
            assert resp.status == 404
        async with http.delete(f"{e2b.url}/templates/{tid}") as resp:
            assert resp.status == 204


async def test_an_identical_build_reuses_the_layers_unless_the_cache_is_skipped(e2b: E2B) -> None:
    first, again, forced = _name(e2b, "c1"), _name(e2b, "c2"), _name(e2b, "c3")
    step = f"cat /proc/sys/kernel/random/uuid > /stamp  # {first}"  # no earlier run built it
    out = await e2b.run(
        f"""
        import asyncio
        from e2b import AsyncSandbox, AsyncTemplate, Template
        def template(cls):
            return cls().from_template("debian:bookworm").run_cmd({step!r})
        def stamp(name):
            return Sandbox.create(name, timeout=60).commands.run("cat /stamp").stdout
        built, logs = [], []
        Template.build(template(Template), {first!r}, on_build_logs=lambda e: built.append(e.message))
        Template.build(template(Template), {again!r}, on_build_logs=lambda e: logs.append(e.message))
        async def skipped():
            msgs = []
            await AsyncTemplate.build(template(AsyncTemplate), {forced!r}, skip_cache=True,
                                      on_build_logs=lambda e: msgs.append(e.message))
            sbx = await AsyncSandbox.create({forced!r}, timeout=60)
            return msgs, (await sbx.commands.run("cat /stamp")).stdout
        forced_logs, forced_stamp = asyncio.run(skipped())
        print(json.dumps([stamp({first!r}), stamp({again!r}), forced_stamp, built, logs, forced_logs]))
        """,
        timeout=600,
    )
    first_stamp, again_stamp, forced_stamp, built, logs, forced_logs = out
    assert any(m.startswith("[1/1] RUN") for m in built), built
    assert first_stamp == again_stamp and len(first_stamp) == 37, "the same layer: the step did not run again"
    assert any(m.startswith("CACHED [1/1] RUN") for m in logs), logs
    assert forced_stamp != first_stamp, "skip_cache() runs every step"
    assert not any(m.startswith("CACHED") for m in forced_logs), forced_logs


async def test_a_dockerfile_builds_through_the_v2_builder(e2b: E2B, node: EmbeddedNode) -> None:
    """What E2B's v1 flow took (a Dockerfile, pushed to its registry by a local Docker), the
    SDK's ``from_dockerfile`` sends as v2 steps: DSec builds it with no registry."""
    name = _name(e2b, "dockerfile")
    out = await e2b.run(
        f"""
        from e2b import Template
        dockerfile = '''FROM debian:bookworm
        ENV GREETING=hello
        RUN echo built > /built.txt
        WORKDIR /srv
        RUN pwd > here.txt
        '''
        Template.build(Template().skip_cache().from_dockerfile(dockerfile), {name!r})
        sbx = Sandbox.create({name!r}, timeout=120)
        print(json.dumps(sbx.commands.run("cat /built.txt /srv/here.txt; echo $GREETING; pwd").stdout))
        """,
        timeout=600,
    )
    assert out == "built\n/srv\nhello\n/srv\n"
    records = Path(node.store.root) / "e2b-templates"
    assert records.stat().st_mode & 0o777 == 0o700, "tenants' env and files are root's alone"
