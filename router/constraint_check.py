"""Checking a constraint before routing it: compiled in a child process, within a time limit.

Every constraint a client sends is compiled here before any worker sees it, so a constraint
that does not compile, matches nothing, compiles too large or too slowly is a 400 naming its
field, and workers compile only what passed (in about the same time: the limit bounds theirs).
The compile runs in ``model_runtime/structured/check_process.py``, started at the first
constraint (a few seconds: the grammar engine's import), because the router's process loads no
torch, and because a compile past ``timeout_s`` is stopped by killing that process: it cannot
hold the router, or later checks, behind it. The next check starts a new one.

Verdicts are cached by the constraint's key (bounded, oldest first out); concurrent checks of
one constraint share one compile; checks of different constraints take turns (one child).
A refusal for time is final, like any other: whether a constraint is served does not depend on
when it is asked.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections import OrderedDict

from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.model_runtime.structured.constraint import Constraint, field_of

log = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 5.0  # workers allow more (``structured.compiler``): they compile beside a step loop
START_TIMEOUT_S = 120.0
CACHE_ENTRIES = 4096

Verdict = tuple[str, str] | None  # (field, message) of a refusal, or None: accepted


class ConstraintChecker:
    def __init__(
        self, model: str, timeout_s: float = COMPILE_TIMEOUT_S, cache_entries: int = CACHE_ENTRIES
    ) -> None:
        self.model = model
        self.timeout_s = timeout_s
        self._entries = cache_entries
        self._verdicts: OrderedDict[tuple[str, str], Verdict] = OrderedDict()
        self._inflight: dict[tuple[str, str], asyncio.Future[Verdict]] = {}
        self._proc: asyncio.subprocess.Process | None = None
        self._turn = asyncio.Lock()
        self.compiles = 0  # constraints sent to the child (tests, metrics)
        self.restarts = 0  # children started

    async def check(self, c: Constraint) -> None:
        """Raise ``InvalidRequestError`` if the constraint is refused."""
        verdict = await self._verdict(c)
        if verdict is not None:
            raise InvalidRequestError(*verdict)

    async def _verdict(self, c: Constraint) -> Verdict:
        key = c.key
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            return self._verdicts[key]
        fut = self._inflight.get(key)
        if fut is None:
            fut = self._inflight[key] = asyncio.get_running_loop().create_future()
            try:
                async with self._turn:
                    verdict = await self._compile(c)
            except BaseException as e:
                fut.set_exception(e)
                fut.exception()  # retrieved: waiters see it, nobody else must
                raise
            finally:
                self._inflight.pop(key, None)
            self._verdicts[key] = verdict
            while len(self._verdicts) > self._entries:
                self._verdicts.popitem(last=False)
            fut.set_result(verdict)
            return verdict
        return await asyncio.shield(fut)

    async def _compile(self, c: Constraint) -> Verdict:
        proc = await self._child()
        assert proc.stdin is not None and proc.stdout is not None
        self.compiles += 1
        proc.stdin.write(json.dumps({"kind": c.kind.value, "spec": c.spec}).encode() + b"\n")
        try:
            await proc.stdin.drain()
            line = await asyncio.wait_for(proc.stdout.readline(), self.timeout_s)
        except asyncio.TimeoutError:
            await self._kill()
            return field_of(c), f"took longer than {self.timeout_s:g} s to compile; simplify it"
        except (ConnectionError, BrokenPipeError):
            line = b""
        if not line:  # the compile took the process down
            await self._kill()
            log.error("the constraint checker died compiling %s", c.describe())
            return field_of(c), "cannot be compiled (it crashed the grammar compiler)"
        answer = json.loads(line)
        return None if answer.get("ok") else (str(answer["field"]), str(answer["message"]))

    async def _child(self) -> asyncio.subprocess.Process:
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        self.restarts += 1
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pdserve.model_runtime.structured.check_process", self.model,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=1 << 20,
        )  # fmt: skip
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
        except asyncio.TimeoutError:
            line = b""
        if not line or not json.loads(line).get("ready"):
            proc.kill()
            await proc.wait()
            why = "structured output is unavailable: its checker did not start"
            raise InvalidRequestError("response_format", why)
        self._proc = proc
        return proc

    async def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()

    async def close(self) -> None:
        """Stop the child (it also exits by itself when this process goes)."""
        await self._kill()
