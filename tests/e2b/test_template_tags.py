"""E2B's template tags and build logs routes (``/templates/tags``, ``/templates/{id}/tags``,
``/templates/{id}/builds/{buildID}/logs``) and the v1 build routes' 501, through the official
SDK's ``Template.assign_tags`` / ``remove_tags`` / ``get_tags`` and plain HTTP.

The routes are the same for SDKs 2.34 and 2.63: run with the newest only, one build.
"""

from __future__ import annotations

import uuid

from tests.e2b.conftest import E2B


async def test_tags_name_builds_and_the_logs_page_by_time(e2b_latest: E2B) -> None:
    name = f"tags-{uuid.uuid4().hex[:8]}"
    out = await e2b_latest.run(
        f"""
        import httpx
        from e2b import Template
        NAME = {name!r}
        import pathlib, tempfile
        ctx = tempfile.mkdtemp()
        pathlib.Path(ctx, "folder").mkdir()
        for f in ("a.txt", "b.txt"):
            pathlib.Path(ctx, "folder", f).write_text(f[0])
        # E2B's test_build_template: a glob's matches go into dest as a directory, and a
        # relative dest is where the next RUN runs (here root's home).
        # skip_cache: the steps run (their logs are read below), whatever an earlier run built
        template = (Template(file_context_path=ctx).skip_cache().from_debian_image("bookworm")
                    .copy("folder/*", "folder").run_cmd("cat folder/a.txt folder/b.txt; echo -built-it"))
        info = Template.build(template, NAME + ":v1")
        def fails(call):
            try:
                call()
            except Exception as e:
                return type(e).__name__ + ": " + str(e)[:200]
            return None
        assigned = Template.assign_tags(NAME + ":v1", ["production", "Latest", "production"])
        single = Template.assign_tags(NAME + ":v1", "stable")
        tags = sorted((t.tag, t.build_id) for t in Template.get_tags(NAME))
        sbx = Sandbox.create(NAME + ":production", timeout=60)
        ran = sbx.commands.run("echo in-tagged").stdout
        sbx.kill()
        Template.remove_tags(NAME, ["production", "never-assigned"])
        after = sorted(t.tag for t in Template.get_tags(NAME))
        errors = {{
            "gone": fails(lambda: Sandbox.create(NAME + ":production", timeout=60)),
            "no_alias": fails(lambda: Template.assign_tags(NAME + ":v1", ":invalid-tag")),
            "no_tag": fails(lambda: Template.assign_tags(NAME + ":v1", NAME + ":")),
            "no_target": fails(lambda: Template.assign_tags(NAME + ":nope", "x")),
            "default": fails(lambda: Template.remove_tags(NAME, "default")),
            "tagged_name": fails(lambda: Template.remove_tags(NAME + ":v1", "stable")),
        }}
        api = os.environ["E2B_API_URL"]
        h = {{"X-API-Key": os.environ["E2B_API_KEY"]}}
        logs_url = f"{{api}}/templates/{{info.template_id}}/builds/{{info.build_id}}/logs"
        def logs(**q):
            r = httpx.get(logs_url, params=q, headers=h)
            return r.status_code, r.json()
        _, everything = logs()
        last_ms = int(__import__("datetime").datetime.fromisoformat(
            everything["logs"][-1]["timestamp"]).timestamp() * 1000)
        pages = {{
            "forward": [e["message"] for e in everything["logs"]],
            "backward_1": logs(direction="backward", limit=1)[1]["logs"],
            "after_last": logs(cursor=last_ms + 1)[1]["logs"],
            "errors_only": logs(level="error")[1]["logs"],
            "bad_direction": logs(direction="sideways"),
            "bad_limit": logs(limit=101)[0],
        }}
        bad_build = httpx.get(f"{{api}}/templates/{{info.template_id}}/builds/nope/logs", headers=h)
        v1 = httpx.post(f"{{api}}/templates", json={{"dockerfile": "FROM x"}}, headers=h)
        print(json.dumps({{
            "build_id": info.build_id, "assigned": [assigned.build_id, sorted(assigned.tags)],
            "single": single.tags, "tags": tags, "ran": ran, "after": after, "errors": errors,
            "pages": pages, "last": everything["logs"][-1],
            "bad_build": [bad_build.status_code, bad_build.json()], "v1": [v1.status_code, v1.json()],
        }}))
        """,
        timeout=240,
    )
    build = out["build_id"]
    assert out["assigned"] == [build, ["latest", "production"]]
    assert out["single"] == ["stable"]
    assert out["tags"] == [[t, build] for t in ("latest", "production", "stable", "v1")]
    assert out["ran"] == "in-tagged\n"
    assert out["after"] == ["latest", "stable", "v1"]
    errors = out["errors"]
    assert errors["gone"] and "404" in errors["gone"], errors
    assert errors["no_alias"] and "Invalid tag" in errors["no_alias"], errors
    assert errors["no_tag"] and "Invalid tag" in errors["no_tag"], errors
    assert errors["no_target"] and "not found" in errors["no_target"], errors
    assert errors["default"] and "Cannot delete the 'default' tag" in errors["default"], errors
    assert errors["tagged_name"] and "should not contain a tag" in errors["tagged_name"], errors
    pages = out["pages"]
    assert any("ab-built-it" in m for m in pages["forward"]), pages["forward"]
    assert pages["backward_1"] == [out["last"]]
    assert pages["after_last"] == []
    assert pages["errors_only"] == []
    assert pages["bad_direction"][0] == 400 and "direction" in pages["bad_direction"][1]["message"]
    assert pages["bad_limit"] == 400
    assert out["bad_build"] == [400, {"code": 400, "message": "Invalid build id"}]
    assert out["v1"][0] == 501 and "Template()" in out["v1"][1]["message"]
