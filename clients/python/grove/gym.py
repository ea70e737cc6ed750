"""A Gymnasium environment on a Grove sandbox: the agent's actions are shell commands run in one long-lived
shell session (so `cd`, `export`, venvs carry from step to step), the reward comes from a command of yours.

    from grove.gym import SandboxEnv
    env = SandboxEnv(setup="git clone ... /src && cd /src", reward="cd /src && pytest -q",
                     done="test -f /src/DONE", max_steps=20)
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("sed -i s/bug/fix/ /src/app.py")
    root = env.snapshot()              # tree search: every branch starts from here, session included
    branches = env.fork(4)             # 4 envs, each in its own sandbox restored from a snapshot
    env.close()

`AsyncSandboxEnvs` runs N of them at once over the asyncio client. Needs `pip install gymnasium`.
"""

from __future__ import annotations

import asyncio
import string
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from . import errors
from ._transport import AsyncClient, Client, default_client
from .async_sandbox import AsyncSandbox
from .sandbox import Sandbox, Snapshot

__all__ = ["SandboxEnv", "AsyncSandboxEnvs", "StepResult", "Reward"]

#: Characters of the action and observation spaces: printable ASCII (output outside it is shown as '?').
CHARSET = string.printable.replace("\x0b", "").replace("\x0c", "")

#: A reward: a shell command (its exit code, or the number its output ends with, per `reward_from`), or a
#: function of (env, action, step result) returning a float.
Reward = Union[str, Callable[["SandboxEnv", str, "StepResult"], float], None]


@dataclass
class StepResult:
    output: str
    exit_code: Optional[int]
    timed_out: bool


def _clean(text: str, limit: int) -> str:
    allowed = set(CHARSET)
    out = "".join(c if c in allowed else "?" for c in text)
    return out[-limit:] if len(out) > limit else out


class _Session:
    """One Grove shell session, over the native API (`/v1/sandboxes/{id}/sessions`)."""

    def __init__(self, c: Client, sandbox_id: str, name: str):
        self._c, self.sandbox_id, self.name = c, sandbox_id, name

    @classmethod
    def create(cls, c: Client, sandbox_id: str, name: str, cwd: Optional[str] = None) -> "_Session":
        body: Dict[str, Any] = {"name": name}
        if cwd:
            body["cwd"] = cwd
        c.request("POST", f"/v1/sandboxes/{sandbox_id}/sessions", json=body)
        return cls(c, sandbox_id, name)

    def run(self, command: str, timeout: Optional[float]) -> StepResult:
        body: Dict[str, Any] = {"command": command}
        if timeout is not None:
            body["timeout_ms"] = max(1, int(timeout * 1000))
        r = self._c.request("POST", f"/v1/sandboxes/{self.sandbox_id}/sessions/{self.name}/run", json=body,
                            timeout=(timeout or 600) + 30).json()
        return StepResult(r.get("output", ""), r.get("exit_code"), bool(r.get("timed_out")))


class _AsyncSession:
    def __init__(self, c: AsyncClient, sandbox_id: str, name: str):
        self._c, self.sandbox_id, self.name = c, sandbox_id, name

    @classmethod
    async def create(cls, c: AsyncClient, sandbox_id: str, name: str, cwd: Optional[str] = None) -> "_AsyncSession":
        body: Dict[str, Any] = {"name": name}
        if cwd:
            body["cwd"] = cwd
        await c.request("POST", f"/v1/sandboxes/{sandbox_id}/sessions", json=body)
        return cls(c, sandbox_id, name)

    async def run(self, command: str, timeout: Optional[float]) -> StepResult:
        body: Dict[str, Any] = {"command": command}
        if timeout is not None:
            body["timeout_ms"] = max(1, int(timeout * 1000))
        r = (await self._c.request("POST", f"/v1/sandboxes/{self.sandbox_id}/sessions/{self.name}/run", json=body,
                                   timeout=(timeout or 600) + 30)).json()
        return StepResult(r.get("output", ""), r.get("exit_code"), bool(r.get("timed_out")))


def _wrapped(action: str) -> str:
    """The action as the session runs it: read whole through a quoted heredoc (a random delimiter no action
    can end early), then eval'd in the session's own shell (so `cd`/`export` carry). An unbalanced quote or an
    unterminated heredoc in the action is then a syntax error (exit 2), never a shell left waiting for more."""
    end = f"GROVE_ACTION_{uuid.uuid4().hex}"
    return f"IFS= read -r -d '' __grove_action <<'{end}'\n{action}\n{end}\neval \"$__grove_action\""


def _parse_reward(reward_from: str, r: StepResult) -> float:
    if reward_from == "exit_code":
        return 1.0 if r.exit_code == 0 else 0.0
    words = r.output.split()
    try:
        return float(words[-1]) if words else 0.0
    except ValueError:
        return 0.0


def _spaces(max_action: int, max_obs: int) -> Tuple[spaces.Space, spaces.Space]:
    action = spaces.Text(max_length=max_action, min_length=1, charset=CHARSET)
    obs = spaces.Dict({"output": spaces.Text(max_length=max_obs, min_length=0, charset=CHARSET),
                       "exit_code": spaces.Discrete(256)})
    return action, obs


class SandboxEnv(gym.Env):
    """A gymnasium.Env over a Grove sandbox.

    reset(): a fresh sandbox (created from `image`, which a node with a warm pool for it claims at once, or
    restored from `from_snapshot`), a shell session in it, then `setup` run there.
    step(action): the action runs in the session (timeout `step_timeout`; one with a bash syntax error gets
    exit code 2). reward: `reward` as a command run in a subshell of the session (its
    state is seen, never changed), read per `reward_from` ("exit_code": 1.0 on 0, else 0.0; "output": the
    last number it prints), or a callable. terminated: `done` (a command) exits 0; truncated: `max_steps`.
    close(): the sandbox (and snapshots this env made) destroyed."""

    metadata = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(self, *, image: str = "debian12", setup: Union[str, Sequence[str], None] = None,
                 reward: Reward = None, reward_from: str = "exit_code", done: Optional[str] = None,
                 max_steps: int = 50, step_timeout: float = 60.0, session: str = "main",
                 cwd: Optional[str] = None, from_snapshot: Optional[str] = None,
                 sandbox: Optional[Dict[str, Any]] = None, client: Optional[Client] = None,
                 socket: Optional[str] = None, url: Optional[str] = None, api_key: Optional[str] = None,
                 max_action_chars: int = 4096, max_obs_chars: int = 16384, render_mode: Optional[str] = None):
        """`client`, or where to reach groved (`socket`, or `url` + `api_key`; plain values, which
        `gymnasium.make` can copy), else the default client (GROVE_SOCKET / GROVE_URL)."""
        if reward_from not in ("exit_code", "output"):
            raise ValueError("reward_from: 'exit_code' or 'output'")
        if render_mode not in (None, "ansi"):
            raise ValueError("render_mode: None or 'ansi'")
        self.image, self.reward_cmd, self.reward_from, self.done_cmd = image, reward, reward_from, done
        self.setup_cmds = [setup] if isinstance(setup, str) else list(setup or [])
        self.max_steps, self.step_timeout, self.session_name, self.cwd = max_steps, step_timeout, session, cwd
        self.from_snapshot, self.sandbox_kw, self.render_mode = from_snapshot, dict(sandbox or {}), render_mode
        self._given, self._conn = client, dict(socket=socket, base_url=url, api_key=api_key)
        self._own: Optional[Client] = None
        self.action_space, self.observation_space = _spaces(max_action_chars, max_obs_chars)
        self._max_obs = max_obs_chars
        self.sandbox: Optional[Sandbox] = None
        self._session: Optional[_Session] = None
        self._snapshots: List[Snapshot] = []
        self.steps = 0
        self._last = ""

    @property
    def _c(self) -> Client:
        if self._given is not None:
            return self._given
        if not any(self._conn.values()):
            return default_client()
        if self._own is None:
            self._own = Client(**self._conn)
        return self._own

    # --- gymnasium.Env ---------------------------------------------------------------------------------------
    def reset(self, *, seed: Optional[int] = None, options: Optional[dict] = None):
        super().reset(seed=seed)
        self._destroy()
        if self.from_snapshot:
            self.sandbox = Snapshot.get(self.from_snapshot, client=self._c).fork(1)[0]
            self._session = self._attach()
            out = StepResult("", 0, False)
        else:
            self.sandbox = Sandbox.create(self.image, client=self._c, **self.sandbox_kw)
            self._session = _Session.create(self._c, self.sandbox.id, self.session_name, self.cwd)
            out = StepResult("", 0, False)
            for cmd in self.setup_cmds:
                out = self._session.run(cmd, self.step_timeout)
                if out.exit_code != 0:
                    raise RuntimeError(f"setup {cmd!r} failed ({out.exit_code}): {out.output[-2000:]}")
        self.steps = 0
        obs = self._obs(out)
        return obs, {"sandbox_id": self.sandbox.id, "exit_code": out.exit_code}

    def step(self, action: str):
        if self._session is None:
            raise RuntimeError("call reset() first")
        action = str(action)
        r = self._run_action(action)
        self.steps += 1
        reward, reward_info = self._reward(action, r)
        terminated = False
        if self.done_cmd:
            terminated = self._session.run(f"( {self.done_cmd}\n) </dev/null", self.step_timeout).exit_code == 0
        truncated = not terminated and self.steps >= self.max_steps
        # Only what the action determines (gymnasium's check_env compares infos of equal steps): the
        # sandbox is `env.sandbox`.
        info = {"exit_code": r.exit_code, "timed_out": r.timed_out, "step": self.steps, **reward_info}
        return self._obs(r), float(reward), bool(terminated), bool(truncated), info

    def render(self):
        if self.render_mode == "ansi":
            return self._last
        return None

    def close(self):
        self._destroy()
        for s in self._snapshots:
            try:
                s.delete()
            except errors.GroveError:
                pass
        self._snapshots = []
        if self._own is not None:
            self._own.close()
            self._own = None
        super().close()

    # --- tree search -----------------------------------------------------------------------------------------
    def snapshot(self, name: Optional[str] = None) -> Snapshot:
        """The sandbox as it is now (files, processes, the session): fork it, or pass its name as
        `from_snapshot` to new envs. Deleted when this env closes."""
        if self.sandbox is None:
            raise RuntimeError("call reset() first")
        s = self.sandbox.snapshot(name=name)
        self._snapshots.append(s)
        return s

    def fork(self, n: int, snapshot: Optional[Snapshot] = None) -> List["SandboxEnv"]:
        """n envs, each in its own sandbox restored from `snapshot` (default: one taken now), at this env's
        step count; each then goes its own way. Close them as any env."""
        snap = snapshot or self.snapshot()
        sbxs = snap.fork(n)
        out = []
        for sbx in sbxs:
            e = SandboxEnv(image=self.image, setup=self.setup_cmds, reward=self.reward_cmd,
                           reward_from=self.reward_from, done=self.done_cmd, max_steps=self.max_steps,
                           step_timeout=self.step_timeout, session=self.session_name, cwd=self.cwd,
                           from_snapshot=snap.name, sandbox=self.sandbox_kw, client=self._c,
                           render_mode=self.render_mode)
            # Branches share this env's connection.
            e.action_space, e.observation_space, e._max_obs = self.action_space, self.observation_space, self._max_obs
            e.sandbox, e.steps, e._last = sbx, self.steps, self._last
            e._session = e._attach()
            out.append(e)
        return out

    # --- internals ----------------------------------------------------------------------------------------------
    def _attach(self) -> _Session:
        # A restored sandbox carries its sessions: the same name answers there.
        return _Session(self._c, self.sandbox.id, self.session_name)

    def _run_action(self, action: str) -> StepResult:
        return self._session.run(_wrapped(action), self.step_timeout)

    def _reward(self, action: str, r: StepResult) -> Tuple[float, dict]:
        if self.reward_cmd is None:
            return 0.0, {}
        if callable(self.reward_cmd):
            return float(self.reward_cmd(self, action, r)), {}
        rr = self._session.run(f"( {self.reward_cmd}\n) </dev/null", self.step_timeout)
        return _parse_reward(self.reward_from, rr), {"reward_output": rr.output[-2000:],
                                                     "reward_exit_code": rr.exit_code}

    def _obs(self, r: StepResult) -> Dict[str, Any]:
        self._last = r.output
        code = r.exit_code if r.exit_code is not None else 255
        return {"output": _clean(r.output, self._max_obs), "exit_code": int(np.int64(code % 256))}

    def _destroy(self) -> None:
        if self.sandbox is not None:
            try:
                self.sandbox.kill()
            except errors.NotFound:
                pass
        self.sandbox, self._session = None, None


gym.register(id="grove/Sandbox-v0", entry_point="grove.gym:SandboxEnv", nondeterministic=False)


class AsyncSandboxEnvs:
    """N SandboxEnv-like environments driven at once over the asyncio client: `await reset()` returns
    (observations, infos), `await step(actions)` returns (observations, rewards, terminated, truncated, infos)
    with numpy arrays for the numbers, as Gymnasium's vector envs do (no autoreset)."""

    def __init__(self, n: int, *, image: str = "debian12", setup: Union[str, Sequence[str], None] = None,
                 reward: Optional[str] = None, reward_from: str = "exit_code", done: Optional[str] = None,
                 max_steps: int = 50, step_timeout: float = 60.0, session: str = "main", cwd: Optional[str] = None,
                 sandbox: Optional[Dict[str, Any]] = None, client: Optional[AsyncClient] = None,
                 max_obs_chars: int = 16384):
        if reward is not None and not isinstance(reward, str):
            raise ValueError("reward: a shell command")
        self.n, self.image, self.reward_cmd, self.reward_from, self.done_cmd = n, image, reward, reward_from, done
        self.setup_cmds = [setup] if isinstance(setup, str) else list(setup or [])
        self.max_steps, self.step_timeout, self.session_name, self.cwd = max_steps, step_timeout, session, cwd
        self.sandbox_kw, self._max_obs, self._c = dict(sandbox or {}), max_obs_chars, client
        self.single_action_space, self.single_observation_space = _spaces(4096, max_obs_chars)
        self.sandboxes: List[AsyncSandbox] = []
        self._sessions: List[_AsyncSession] = []
        self.steps = np.zeros(n, dtype=np.int64)

    def _client(self) -> AsyncClient:
        if self._c is None:
            from ._transport import default_async_client
            self._c = default_async_client()
        return self._c

    def _obs(self, r: StepResult) -> Dict[str, Any]:
        code = r.exit_code if r.exit_code is not None else 255
        return {"output": _clean(r.output, self._max_obs), "exit_code": code % 256}

    async def reset(self, *, seed: Optional[int] = None):
        await self.close()
        c = self._client()

        async def one(i: int):
            sbx = await AsyncSandbox.create(self.image, client=c, **self.sandbox_kw)
            s = await _AsyncSession.create(c, sbx.id, self.session_name, self.cwd)
            out = StepResult("", 0, False)
            for cmd in self.setup_cmds:
                out = await s.run(cmd, self.step_timeout)
                if out.exit_code != 0:
                    raise RuntimeError(f"setup {cmd!r} failed in env {i}: {out.output[-2000:]}")
            return sbx, s, out

        made = await asyncio.gather(*[one(i) for i in range(self.n)], return_exceptions=True)
        self.sandboxes = [m[0] for m in made if not isinstance(m, BaseException)]
        self._sessions = [m[1] for m in made if not isinstance(m, BaseException)]
        failed = [m for m in made if isinstance(m, BaseException)]
        if failed:
            await self.close()
            raise failed[0]
        self.steps[:] = 0
        return [self._obs(m[2]) for m in made], {"sandbox_id": [s.id for s in self.sandboxes]}

    async def step(self, actions: Sequence[str]):
        if len(actions) != self.n or not self._sessions:
            raise ValueError(f"reset() first, then {self.n} actions")

        async def one(i: int, action: str):
            s = self._sessions[i]
            r = await s.run(_wrapped(action), self.step_timeout)
            reward = 0.0
            if self.reward_cmd:
                reward = _parse_reward(self.reward_from,
                                       await s.run(f"( {self.reward_cmd}\n) </dev/null", self.step_timeout))
            term = False
            if self.done_cmd:
                term = (await s.run(f"( {self.done_cmd}\n) </dev/null", self.step_timeout)).exit_code == 0
            return r, reward, term

        res = await asyncio.gather(*[one(i, a) for i, a in enumerate(actions)])
        self.steps += 1
        terminated = np.array([t for _, _, t in res], dtype=bool)
        truncated = ~terminated & (self.steps >= self.max_steps)
        rewards = np.array([rw for _, rw, _ in res], dtype=np.float64)
        infos = {"exit_code": [r.exit_code for r, _, _ in res], "timed_out": [r.timed_out for r, _, _ in res]}
        return [self._obs(r) for r, _, _ in res], rewards, terminated, truncated, infos

    async def close(self) -> None:
        sbxs, self.sandboxes, self._sessions = self.sandboxes, [], []

        async def kill(s: AsyncSandbox):
            try:
                await s.kill()
            except errors.NotFound:
                pass

        await asyncio.gather(*[kill(s) for s in sbxs])
