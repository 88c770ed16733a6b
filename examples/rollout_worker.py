"""A rollout worker: N concurrent episodes of the demo SWE task, from reset to graded reward.

    python examples/rollout_worker.py --job my-run --episodes 64

It survives being killed: run it again with the same ``--job`` and it reattaches to the job's
sandboxes (its lease kept them; a lapsed lease only paused them), replays each episode's
actions (recorded steps return their recorded results, nothing runs twice) and finishes. The
policy is scripted (:mod:`dsec.rl.demo`); a model would go where ``honest_policy`` is.

``--park-after K`` (for the preemption drill): each episode sends step K and then waits
forever without reading its answer, and the worker prints ``{"event": "parked"}`` per episode;
kill the worker then, with commands in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from dsec import DSecClient
from dsec.rl.demo import ensure_task, honest_policy
from dsec.rl.env import SandboxEnv, Task


def emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


async def renew_forever(client: DSecClient, job: str, lease_s: float) -> None:
    while True:
        await asyncio.sleep(lease_s / 3)
        await client.renew_lease(job, lease_s)


async def episode(
    client: DSecClient, task: Task, job: str, index: int, lease_s: float, park_after: int | None
) -> dict[str, Any]:
    env = SandboxEnv(client, task, job=job, episode=f"ep{index}", lease_s=lease_s)
    _, info = await env.reset()
    emit(event="reset", episode=index, **info)
    reward, grade = 0.0, None
    for n, action in enumerate(honest_policy()):
        if park_after is not None and n == park_after:
            in_flight = asyncio.ensure_future(env.step(action))  # never awaited: killed in flight
            assert env.sandbox is not None
            while not any(e.key == f"ep{index}:{n}" for e in await env.sandbox.trajectory()):  # noqa: ASYNC110
                await asyncio.sleep(0.05)  # until the edge has it: the kill must find it there
            emit(event="parked", episode=index)
            await asyncio.Event().wait()
            in_flight.cancel()
        step = await env.step(action)
        if step.terminated:
            reward, grade = step.reward, step.info["grade"]
            break
    assert env.sandbox is not None
    log = (await env.sandbox.read_file("/root/steps.log")).decode().split()
    await env.close()
    return {
        "episode": index,
        "reward": reward,
        "reattached": env.reattached,
        "steps_log": log,
        "tamper": [f.path for f in grade.tamper] if grade else [],
    }


async def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", default="demo-rollout")
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--lease", type=float, default=60.0, help="job lease seconds (renewed every third)")
    p.add_argument("--park-after", type=int, default=None, help="drill: stop each episode at this step")
    p.add_argument("--url", default=None)
    p.add_argument("--api-key", default=None)
    args = p.parse_args(argv)
    async with DSecClient(args.url, args.api_key) as client:
        task = await ensure_task(client)
        renewer = asyncio.ensure_future(renew_forever(client, args.job, args.lease))
        try:
            results = await asyncio.gather(
                *(
                    episode(client, task, args.job, i, args.lease, args.park_after)
                    for i in range(args.episodes)
                )
            )
        finally:
            renewer.cancel()
        left = await client.list(labels={"job": args.job})
        emit(
            event="done",
            episodes=len(results),
            mean_reward=sum(r["reward"] for r in results) / max(1, len(results)),
            reattached=sum(r["reattached"] for r in results),
            results=results,
            sandboxes_left=len(left),
        )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
