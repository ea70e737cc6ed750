"""grove.gym: Gymnasium's own check_env on SandboxEnv, and a short best-of-N search over forks of a snapshot
(the shell session, with its cwd and variables, carried into every branch)."""

from __future__ import annotations

import gymnasium
from gymnasium.utils.env_checker import check_env

import grove
from grove.gym import AsyncSandboxEnvs, SandboxEnv

# A task: make /task/answer hold the number the setup hid in $TARGET. Reward: 1 when it does.
SETUP = ["mkdir -p /task && cd /task && export TARGET=7"]
REWARD = 'test "$(cat /task/answer 2>/dev/null)" = "$TARGET"'


def test_check_env(groved, client):
    env = gymnasium.make("grove/Sandbox-v0", setup=SETUP, reward=REWARD, done=REWARD, max_steps=5,
                         step_timeout=10, socket=groved.socket, max_action_chars=48, max_obs_chars=4096,
                         render_mode="ansi", sandbox={"memory_mb": 128, "labels": {"test": "gym"}})
    try:
        check_env(env.unwrapped)
    finally:
        env.close()
    assert grove.Sandbox.list(labels={"test": "gym"}, client=client) == []


def test_best_of_n_over_forks(groved, client):
    env = SandboxEnv(setup=SETUP, reward=REWARD, done=REWARD, max_steps=3, step_timeout=10, client=client,
                     sandbox={"memory_mb": 128, "labels": {"test": "gym-bon"}})
    try:
        obs, info = env.reset(seed=0)
        obs, r, term, trunc, info = env.step("echo 3 > answer")
        assert (r, term, trunc) == (0.0, False, False)
        # Try N candidate actions from the same state, each in its own branch; keep the best.
        candidates = [f"echo {k} > answer && cat answer" for k in (5, 7, 9, 11)]
        branches = env.fork(len(candidates))
        try:
            outcomes = []
            for b, a in zip(branches, candidates):
                assert b.steps == 1
                obs, r, term, trunc, info = b.step(a)
                outcomes.append((r, a, obs["output"].strip(), term))
            best = max(outcomes)
            assert best[0] == 1.0 and best[1] == candidates[1] and best[2] == "7" and best[3] is True
            assert [o[0] for o in outcomes] == [0.0, 1.0, 0.0, 0.0]
            # Each branch went its own way; the root is where it was.
            assert [o[2] for o in outcomes] == ["5", "7", "9", "11"]
        finally:
            for b in branches:
                b.close()
        obs, r, term, trunc, info = env.step("cat answer; pwd")
        assert obs["output"].split() == ["3", "/task"] and r == 0.0
        # A syntax error is an observation (exit 2), and the session lives on.
        obs, r, term, trunc, info = env.step('echo "unbalanced')
        assert obs["exit_code"] == 2 and trunc is True
    finally:
        env.close()
    assert grove.Sandbox.list(labels={"test": "gym-bon"}, client=client) == []


async def test_async_envs_step_together(groved, aclient):
    envs = AsyncSandboxEnvs(3, setup=SETUP, reward=REWARD, max_steps=2, step_timeout=10, client=aclient,
                            sandbox={"memory_mb": 128, "labels": {"test": "gym-vec"}})
    try:
        obs, infos = await envs.reset()
        assert len(obs) == 3 and len(set(infos["sandbox_id"])) == 3
        obs, rewards, term, trunc, infos = await envs.step([f"echo {k} > answer" for k in (6, 7, 8)])
        assert rewards.tolist() == [0.0, 1.0, 0.0] and not trunc.any()
        obs, rewards, term, trunc, infos = await envs.step(["cat answer"] * 3)
        assert [o["output"].strip() for o in obs] == ["6", "7", "8"] and trunc.all()
    finally:
        await envs.close()
    assert await grove.AsyncSandbox.list(labels={"test": "gym-vec"}, client=aclient) == []
