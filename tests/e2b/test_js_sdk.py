"""The official E2B JS SDK (npm ``e2b``, :data:`JS_VERSION`) against the session's DSec node.

``./setup.sh test`` makes ``.node-e2b/node_modules`` from the pinned ``package.json`` and
``package-lock.json`` there (``npm ci``, kept between runs like the Python SDKs' venvs); the
fixture makes it once when missing. A snippet is an ES module run by Node with ``.node-e2b`` as
its working directory (so ``import 'e2b'`` resolves there), ``Sandbox`` and the SDK's error
classes imported, ``out(value)`` printing one JSON value and ending the process (watches and
background commands would keep Node's event loop alive), and ``Seen``, text a callback collects
that a snippet awaits parts of. The SDK speaks Connect with JSON to
envd (``useBinaryFormat: false``), the same codec the Python SDKs use.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dsec.node.embedded import EmbeddedNode
from dsec.protocol.models import ShellRequest
from tests.e2b.conftest import REPO, SnippetFailed
from tests.e2e.test_egress import the_mirror  # noqa: F401 (a fixture)
from tests.netpolicy import mirror

JS_VERSION = "2.51.0"  # .node-e2b/package.json, and its lock file
JS_DIR = REPO / ".node-e2b"
_PRELUDE = """
import { Sandbox, CommandExitError, NotFoundError } from 'e2b';
const out = (v) => process.stdout.write(JSON.stringify(v) + '\\n', () => process.exit(0));
// Text a callback collects; seen.when(s) resolves once it holds s (no polling, no sleeping).
class Seen {
  constructor() { this.text = ''; this.waiting = []; }
  add(s) {
    this.text += s;
    this.waiting = this.waiting.filter(([want, resolve]) => !(this.text.includes(want) && (resolve(), true)));
  }
  when(want) {
    return this.text.includes(want) ? Promise.resolve() : new Promise((r) => this.waiting.push([want, r]));
  }
}
"""


def _stamp() -> Path:
    lock = (JS_DIR / "package-lock.json").read_bytes()
    return JS_DIR / "node_modules" / f".installed-{hashlib.sha256(lock).hexdigest()[:16]}"


def ensure_node_modules() -> None:
    """What setup.sh's install_e2b_js does, when it has not: ``npm ci`` from the lock file."""
    if not _stamp().exists():
        subprocess.run(["npm", "ci", "-s", "--no-audit", "--no-fund"], cwd=JS_DIR, check=True)
        _stamp().touch()


def node_binary() -> str:
    """Node's own build of 20 that setup.sh fetches where the system's Node is older (Debian
    12's 18 cannot load the SDK), else the system's."""
    fetched = sorted(JS_DIR.glob("runtime/node_modules/node-linux-*/bin/node"))
    return str(fetched[0]) if fetched else "node"


@dataclass
class JS:
    url: str
    key: str

    async def run(self, code: str, *, timeout: float = 90) -> Any:
        """Run ``code`` (an ES module body) with the JS SDK; the JSON value it ``out``-puts."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
        env.update(E2B_API_URL=self.url, E2B_SANDBOX_URL=self.url, E2B_API_KEY=self.key)
        proc = await asyncio.create_subprocess_exec(
            node_binary(),
            "--input-type=module",
            "-e",
            _PRELUDE + code,
            cwd=JS_DIR,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            raw_out, raw_err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        stdout, stderr = raw_out.decode(), raw_err.decode()
        lines = stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            raise SnippetFailed(proc.returncode or 0, stdout, stderr)
        return json.loads(lines[-1])


@pytest.fixture(scope="session")
async def js(node: EmbeddedNode, e2b_keys: tuple[str, str]) -> JS:
    await asyncio.to_thread(ensure_node_modules)
    return JS(node.url, e2b_keys[0])


async def test_lifecycle_create_info_list_timeout_connect_kill(js: JS, node: EmbeddedNode) -> None:
    out = await js.run(
        """
        const sbx = await Sandbox.create({ timeoutMs: 120_000, metadata: { suite: 'js' } });
        const info = await sbx.getInfo();
        const listed = (await Sandbox.list().nextItems()).map((s) => s.sandboxId);
        const other = await Sandbox.create({ timeoutMs: 120_000, metadata: { suite: 'other' } });
        const both = (await Sandbox.list().nextItems()).map((s) => s.sandboxId);
        const byMeta = (await Sandbox.list({ query: { metadata: { suite: 'js' } } }).nextItems())
          .map((s) => s.sandboxId);
        await other.kill();
        await sbx.setTimeout(300_000);
        const after = await sbx.getInfo();
        const again = await Sandbox.connect(sbx.sandboxId);
        const ran = (await again.commands.run('echo connected')).stdout;
        const running = await sbx.isRunning();
        out({ id: sbx.sandboxId, infoId: info.sandboxId, meta: info.metadata, listed,
              extended: after.endAt.getTime() - info.endAt.getTime(), ran, running,
              state: info.state, byMeta, both, other: other.sandboxId });
        """
    )
    assert out["infoId"] == out["id"] and out["meta"] == {"suite": "js"}
    assert out["id"] in out["listed"] and out["state"] == "running"
    assert out["byMeta"] == [out["id"]] and {out["id"], out["other"]} <= set(out["both"])
    assert out["extended"] >= 150_000  # 120 s -> 300 s from a later moment
    assert out["ran"] == "connected\n" and out["running"] is True
    assert out["id"] in [s.id for s in await node.link.list_sandboxes()]
    killed = await js.run(
        f"""
        const sbx = await Sandbox.connect({out["id"]!r});
        const killed = await Sandbox.kill({out["id"]!r});
        const running = await sbx.isRunning();
        const again = await Sandbox.kill({out["id"]!r});
        const listed = (await Sandbox.list().nextItems()).map((s) => s.sandboxId);
        let reconnect = null;
        try {{ await Sandbox.connect({out["id"]!r}); reconnect = 'connected'; }}
        catch (e) {{ reconnect = e.constructor.name; }}
        out({{ killed, running, again, listed, reconnect }});
        """
    )
    assert (killed["killed"], killed["running"], killed["again"]) == (True, False, False)
    assert out["id"] not in killed["listed"] and killed["reconnect"] == "SandboxNotFoundError"
    assert out["id"] not in [s.id for s in await node.link.list_sandboxes()]


async def test_foreground_command_output_exit_code_and_failure(js: JS) -> None:
    out = await js.run(
        """
        const sbx = await Sandbox.create({ timeoutMs: 120_000 });
        const seen = { out: [], err: [] };
        const r = await sbx.commands.run('echo one; echo two >&2; echo three', {
          onStdout: (d) => seen.out.push(d), onStderr: (d) => seen.err.push(d) });
        const env = (await sbx.commands.run('echo $GREETING-$PWD',
          { envs: { GREETING: 'hi' }, cwd: '/tmp' })).stdout;
        let failed = null;
        try { await sbx.commands.run('echo failing >&2; exit 3'); }
        catch (e) { failed = { cls: e instanceof CommandExitError, code: e.exitCode, stderr: e.stderr }; }
        out({ stdout: r.stdout, stderr: r.stderr, code: r.exitCode, seen, env, failed });
        """
    )
    assert (out["stdout"], out["stderr"], out["code"]) == ("one\nthree\n", "two\n", 0)
    assert "".join(out["seen"]["out"]) == "one\nthree\n" and "".join(out["seen"]["err"]) == "two\n"
    assert out["env"] == "hi-/tmp\n"
    assert out["failed"] == {"cls": True, "code": 3, "stderr": "failing\n"}


async def test_background_command_wait_list_connect_and_kill(js: JS, node: EmbeddedNode) -> None:
    out = await js.run(
        """
        const sbx = await Sandbox.create({ timeoutMs: 120_000 });
        const quick = await sbx.commands.run('echo done; exit 4', { background: true });
        let waited = null;
        try { await quick.wait(); } catch (e) { waited = { code: e.exitCode, stdout: e.stdout }; }
        await sbx.commands.run('mkfifo /tmp/go');
        const h = await sbx.commands.run('read l < /tmp/go; echo got-$l; sleep 600', { background: true });
        const listed = (await sbx.commands.list()).map((p) => p.pid);
        const lines = new Seen();
        const attached = await sbx.commands.connect(h.pid, { onStdout: (d) => lines.add(d) });
        await sbx.commands.run('echo now > /tmp/go');
        await lines.when('got-now\\n');
        const killed = await attached.kill();
        const after = (await sbx.commands.list()).map((p) => p.pid);
        out({ id: sbx.sandboxId, pid: h.pid, waited, listed, lines: lines.text, killed, after });
        """
    )
    assert out["waited"] == {"code": 4, "stdout": "done\n"}
    assert out["pid"] in out["listed"] and out["lines"] == "got-now\n"
    assert out["killed"] is True and out["pid"] not in out["after"]
    gone = await node.link.run_shell(
        out["id"], ShellRequest(command=f"test -e /proc/{out['pid']} && echo alive || echo gone")
    )
    assert gone.stdout == "gone\n"


async def test_stdin_is_sent_and_closed(js: JS) -> None:
    out = await js.run(
        """
        const sbx = await Sandbox.create({ timeoutMs: 120_000 });
        const h = await sbx.commands.run('cat; echo eof', { background: true, stdin: true });
        await sbx.commands.sendStdin(h.pid, 'hello ');
        await h.sendStdin('world\\n');
        await h.closeStdin();
        const r = await h.wait();
        out({ stdout: r.stdout, code: r.exitCode });
        """
    )
    assert out == {"stdout": "hello world\neof\n", "code": 0}


async def test_pty_create_input_resize_and_kill(js: JS) -> None:
    out = await js.run(
        """
        const sbx = await Sandbox.create({ timeoutMs: 120_000 });
        const dec = new TextDecoder();
        const seen = new Seen();
        const pty = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => seen.add(dec.decode(d)) });
        const enc = new TextEncoder();
        // The shell's echo of the line holds "$((6*7))"; only its output holds "mark-42".
        await sbx.pty.sendInput(pty.pid, enc.encode('stty size; echo mark-$((6*7))\\n'));
        await seen.when('mark-42');
        const before = seen.text;
        await sbx.pty.resize(pty.pid, { cols: 120, rows: 40 });
        await sbx.pty.sendInput(pty.pid, enc.encode('stty size; tty; echo mark-$((7*8))\\n'));
        await seen.when('mark-56');
        const tail = seen.text.slice(before.length);
        const killed = await sbx.pty.kill(pty.pid);
        out({ before, tail, killed });
        """
    )
    assert "24 80" in out["before"]
    assert "40 120" in out["tail"] and "/dev/pts/" in out["tail"]
    assert out["killed"] is True


async def test_files_text_bytes_list_exists_rename_remove_mkdir(js: JS, node: EmbeddedNode) -> None:
    out = await js.run(
        """
        const sbx = await Sandbox.create({ timeoutMs: 120_000 });
        const w = await sbx.files.write('/tmp/js/a.txt', 'héllo');
        const text = await sbx.files.read('/tmp/js/a.txt');
        const bin = new Uint8Array([0, 1, 2, 250, 255]);
        await sbx.files.write('/tmp/js/b.bin', bin.buffer);
        const bytes = Array.from(await sbx.files.read('/tmp/js/b.bin', { format: 'bytes' }));
        await sbx.files.write('/tmp/js/g.txt', 'zipped', { gzip: true });
        const gz = await sbx.files.read('/tmp/js/g.txt', { gzip: true });
        const many = await sbx.files.write([{ path: '/tmp/js/c.txt', data: 'c' },
                                            { path: '/tmp/js/d.txt', data: 'd' }]);
        const made = await sbx.files.makeDir('/tmp/js/sub');
        const madeAgain = await sbx.files.makeDir('/tmp/js/sub');
        const list = (await sbx.files.list('/tmp/js')).map((e) => [e.name, e.type, e.size]).sort();
        const moved = await sbx.files.rename('/tmp/js/c.txt', '/tmp/js/sub/e.txt');
        const existsOld = await sbx.files.exists('/tmp/js/c.txt');
        const existsNew = await sbx.files.exists('/tmp/js/sub/e.txt');
        await sbx.files.remove('/tmp/js/d.txt');
        const info = await sbx.files.getInfo('/tmp/js/a.txt');
        let missing = null;
        try { await sbx.files.read('/tmp/js/d.txt'); } catch (e) { missing = e instanceof NotFoundError; }
        out({ id: sbx.sandboxId, w: [w.name, w.path, w.type], text, bytes,
              many: many.map((e) => e.path), made, madeAgain, list,
              moved: [moved.name, moved.path], existsOld, existsNew,
              info: [info.name, info.type, info.size], missing, gz });
        """
    )
    assert out["w"] == ["a.txt", "/tmp/js/a.txt", "file"]
    assert out["text"] == "héllo" and out["bytes"] == [0, 1, 2, 250, 255]
    assert out["gz"] == "zipped"
    assert out["many"] == ["/tmp/js/c.txt", "/tmp/js/d.txt"]
    assert (out["made"], out["madeAgain"]) == (True, False)
    assert out["list"] == [
        ["a.txt", "file", 6],
        ["b.bin", "file", 5],
        ["c.txt", "file", 1],
        ["d.txt", "file", 1],
        ["g.txt", "file", 6],
        ["sub", "dir", out["list"][5][2]],
    ]
    assert out["moved"] == ["e.txt", "/tmp/js/sub/e.txt"]
    assert (out["existsOld"], out["existsNew"], out["missing"]) == (False, True, True)
    assert out["info"] == ["a.txt", "file", 6]
    seen = await node.link.run_shell(
        out["id"], ShellRequest(command="cat /tmp/js/sub/e.txt; ls /tmp/js | tr '\\n' ' '")
    )
    assert seen.stdout == "ca.txt b.bin g.txt sub "


async def test_watch_dir_sees_writes_and_stops(js: JS) -> None:
    out = await js.run(
        """
        const sbx = await Sandbox.create({ timeoutMs: 120_000 });
        await sbx.files.makeDir('/tmp/w');
        const events = [];
        const seen = new Seen();
        const handle = await sbx.files.watchDir('/tmp/w', (e) => {
          events.push([e.name, e.type]);
          seen.add(`${e.name} ${e.type}\\n`);
        });
        await sbx.files.write('/tmp/w/new.txt', 'x');
        await sbx.commands.run('mkdir /tmp/w/d && rm /tmp/w/new.txt');
        await seen.when('new.txt remove\\n');
        await handle.stop();
        out({ events });
        """
    )
    names = {(n, t) for n, t in out["events"]}
    assert ("new.txt", "create") in names or ("new.txt", "write") in names
    assert ("d", "create") in names and ("new.txt", "remove") in names


async def test_pause_and_connect_resume_keeping_files_and_processes(js: JS) -> None:
    out = await js.run(
        """
        const sbx = await Sandbox.create({ timeoutMs: 120_000 });
        await sbx.files.write('/tmp/kept.txt', 'kept');
        const h = await sbx.commands.run('sleep 600', { background: true });
        const paused = await sbx.pause();
        const state = (await Sandbox.getInfo(sbx.sandboxId)).state;
        const resumed = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 120_000 });
        const after = (await resumed.getInfo()).state;
        const text = await resumed.files.read('/tmp/kept.txt');
        const pids = (await resumed.commands.list()).map((p) => p.pid);
        out({ paused, state, after, text, alive: pids.includes(h.pid) });
        """
    )
    assert out == {"paused": True, "state": "paused", "after": "running", "text": "kept", "alive": True}


async def test_network_rules_with_a_secret(the_mirror: None, js: JS) -> None:  # noqa: F811
    """``network.rules`` with ``Secret.fill`` on a host in ``allowOut``: the header reaches the
    host with the secret's value (README, "Egress headers"), and the sandbox's info never shows
    it."""
    name, value = f"js-{uuid.uuid4().hex[:10]}", f"sk-{uuid.uuid4().hex}"
    out = await js.run(
        f"""
        import {{ Secret }} from 'e2b';
        const HOST = {mirror.PUBLIC_NAME!r}, NAME = {name!r};
        await Secret.create(NAME, {value!r});
        try {{
          const headers = {{ Authorization: `Bearer ${{Secret.fill(NAME)}}` }};
          const rules = {{ [HOST]: [{{ transform: {{ headers }} }}] }};
          const sbx = await Sandbox.create({{ timeoutMs: 120_000,
            network: {{ allowOut: [HOST], denyOut: ['0.0.0.0/0'], rules }} }});
          const got = await sbx.commands.run(`curl -sS --max-time 20 https://${{HOST}}/headers`);
          const info = await sbx.getInfo();
          await sbx.kill();
          out({{ sent: JSON.parse(got.stdout), shown: JSON.stringify(info) }});
        }} finally {{
          await Secret.destroy(NAME);
        }}
        """,
        timeout=180,
    )
    assert [v for k, v in out["sent"] if k.lower() == "authorization"] == [f"Bearer {value}"]
    assert value not in out["shown"]
