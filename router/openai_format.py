"""OpenAI response bodies (completions and chat, whole and streamed) from router events."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.model_runtime.tokenizer import TextTokenizer
from pdserve.router.errors import Code, RouterError
from pdserve.router.stream import Chunk, Event, Final
from pdserve.router.structured_api import ToolCallFormat
from pdserve.router.tool_calls import ToolCallStream, tool_message
from pdserve.worker.messages import Logprob

_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)  # one, not one a call


def sse_data(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return b"data: " + _JSON.encode(obj).encode() + b"\n\n"


ERROR_TYPES = {
    Code.INVALID_ARGUMENT: "invalid_request_error",
    Code.UNAUTHENTICATED: "authentication_error",
    Code.NOT_FOUND: "not_found_error",
    Code.RESOURCE_EXHAUSTED: "rate_limit_error",
}


def error_body(e: RouterError) -> dict[str, Any]:
    return {
        "error": {
            "message": e.message,
            "type": ERROR_TYPES.get(e.code, "server_error"),
            "param": e.field,
            "code": e.code.http,
        }
    }


def invalid_request(err: Mapping[str, Any], body: Any) -> RouterError:
    """A request the framework refused (one of pydantic's errors) as a 400 naming the field;
    a body that is not JSON at all is told as such, with where the parser stopped."""
    path = tuple(err.get("loc", ()))
    path = path[1:] if path[:1] == ("body",) else path
    if err.get("type") == "json_invalid":
        offset = path[0] if path and isinstance(path[0], int) else 0
        why = str(err.get("ctx", {}).get("error", "")) or "malformed"
        return RouterError(Code.INVALID_ARGUMENT, f"body: not valid JSON: {why} at {_place(body, offset)}")
    loc: list[str] = []
    for x in path:
        if not (isinstance(x, int) or str(x).isidentifier()):
            break  # a union member's tag ("constrained-str", "list[...]"): not a field
        loc.append(str(x))
    field = ".".join(loc) or "body"
    return RouterError(Code.INVALID_ARGUMENT, f"{field}: {err.get('msg', 'invalid')}", field)


def _place(body: Any, offset: int) -> str:
    """Where character ``offset`` of a request body is, as an editor shows it."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    if not isinstance(text, str):
        return f"character {offset}"
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return f"line {line}, column {column} (character {offset})"


def finish_reason(final: Final) -> str:
    return "stop" if final.finish_reason == "stop_string" else final.finish_reason


def usage_json(finals: Sequence[Final]) -> dict[str, Any]:
    prompt = sum(f.usage.prompt_tokens for f in {f.prompt_token_ids: f for f in finals}.values())
    completion = sum(f.usage.completion_tokens for f in finals)
    cached = sum(f.usage.cached_tokens for f in {f.prompt_token_ids: f for f in finals}.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    final: Final | None = None
    streamed: int = 0  # characters of token strings streamed so far (the next ``text_offset``)


class ChoiceBuilder:
    def __init__(
        self,
        tokenizer: TextTokenizer | None,
        response_id: str,
        chat: bool,
        return_token_ids: bool,
        model: str,
        num_choices: int,
        tool_format: ToolCallFormat | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.id = response_id
        self.chat = chat
        self.return_token_ids = return_token_ids
        self.model = model
        self.num_choices = num_choices
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._choices = [_Choice() for _ in range(num_choices)]
        # A tool-call chat request's output is answered as tool_calls (``router/tool_calls.py``).
        self.tool_format = tool_format if chat else None
        fmt = self.tool_format
        self._tools = [ToolCallStream(fmt, f"{response_id}-{i}") for i in range(num_choices)] if fmt else []
        # A streamed chunk's event, less its text and token ids, encoded once (``stream_event``).
        envelope = _JSON.encode(self._envelope([]))
        assert envelope.endswith("[]}")
        field = '"delta":{"content":' if chat else '"text":'
        self._heads = [f'data: {envelope[:-2]}{{"index":{i},{field}' for i in range(num_choices)]
        self._tail = ("}," if chat else ",") + '"logprobs":null,"finish_reason":null'

    # -- whole responses ---------------------------------------------------------------------
    def add(self, index: int, ev: Event) -> None:
        c = self._choices[index]
        if isinstance(ev, Chunk):
            c.text.append(ev.text)
            c.token_ids.extend(ev.token_ids)
            if ev.logprobs is not None:
                c.logprobs = (c.logprobs or []) + list(ev.logprobs)
        else:
            c.final = ev

    def response(self) -> dict[str, Any]:
        choices = []
        finals = [c.final for c in self._choices if c.final is not None]
        for i, c in enumerate(self._choices):
            text = "".join(c.text)
            body: dict[str, Any] = {"index": i}
            reason = finish_reason(c.final) if c.final else None
            if self.tool_format is not None and reason is not None:
                complete = c.final is not None and c.final.finish_reason == "stop"
                body["message"], reason = tool_message(
                    text, reason, complete, self.tool_format, f"{self.id}-{i}"
                )
            elif self.chat:
                body["message"] = {"role": "assistant", "content": text}
            else:
                body["text"] = text
            body["logprobs"] = self._logprobs(c.logprobs)
            body["finish_reason"] = reason
            body["stop_reason"] = c.final.stop_reason if c.final else None
            if c.final is not None and c.final.migrations:
                body["migrations"] = c.final.migrations  # (an extension: only when it moved)
            if self.return_token_ids and c.final is not None:
                body["prompt_token_ids"] = list(c.final.prompt_token_ids)
                body["token_ids"] = c.token_ids
            choices.append(body)
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_json(finals),
        }

    # -- streamed responses ------------------------------------------------------------------
    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def stream_event(self, index: int, ev: Event) -> bytes:
        """``stream_chunk``'s server-sent event. A chunk without logprobs (most of a stream's
        events) is its text and ids set into pieces encoded once: the same bytes, a third of
        the time of building and encoding the whole object. A tool-call choice's event may be
        none (b"") or several."""
        if self._tools:
            return b"".join(sse_data(obj) for obj in self._tool_chunks(index, ev))
        if isinstance(ev, Chunk) and ev.logprobs is None:
            ids = f',"token_ids":{_JSON.encode(ev.token_ids)}' if self.return_token_ids else ""
            return f"{self._heads[index]}{_JSON.encode(ev.text)}{self._tail}{ids}}}]}}\n\n".encode()
        return sse_data(self.stream_chunk(index, ev))

    def role_chunk(self, index: int) -> dict[str, Any]:
        delta = self._tools[index].head() if self._tools else {"role": "assistant", "content": ""}
        return self._envelope([{"index": index, "delta": delta, "finish_reason": None}])

    def _tool_chunks(self, index: int, ev: Event) -> list[dict[str, Any]]:
        """A tool-call choice's chunks for one event: ``stream_chunk``'s, with the deltas of
        ``ToolCallStream``."""
        calls = self._tools[index]
        if isinstance(ev, Chunk):
            delta = calls.text(ev.text)
            if delta is None and ev.logprobs is None and not self.return_token_ids:
                return []
            chunk = self.stream_chunk(index, ev)
            chunk["choices"][0]["delta"] = delta or {}
            return [chunk]
        deltas, reason = calls.end(finish_reason(ev), ev.finish_reason == "stop")
        out = [self._envelope([{"index": index, "delta": d, "logprobs": None, "finish_reason": None}])
               for d in deltas]  # fmt: skip
        last = self.stream_chunk(index, ev)
        last["choices"][0]["finish_reason"] = reason
        return [*out, last]

    def stream_chunk(self, index: int, ev: Event) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if isinstance(ev, Chunk):
            c = self._choices[index]
            if self.chat:
                choice["delta"] = {"content": ev.text}
            else:
                choice["text"] = ev.text
            lps = self._logprobs(list(ev.logprobs) if ev.logprobs is not None else None, c.streamed)
            if lps is not None and not self.chat and lps["tokens"]:
                # Offsets run on over the chunks, as in the whole response, however they are cut.
                c.streamed = lps["text_offset"][-1] + len(lps["tokens"][-1])
            choice["logprobs"] = lps
            choice["finish_reason"] = None
            if self.return_token_ids:
                choice["token_ids"] = list(ev.token_ids)
        else:
            if self.chat:
                choice["delta"] = {}
            else:
                choice["text"] = ""
            choice["logprobs"] = None
            choice["finish_reason"] = finish_reason(ev)
            choice["stop_reason"] = ev.stop_reason
            if ev.migrations:
                choice["migrations"] = ev.migrations  # (an extension: only when it moved)
            if self.return_token_ids:
                choice["token_ids"] = []
                choice["prompt_token_ids"] = list(ev.prompt_token_ids)
        return self._envelope([choice])

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope([])
        body["usage"] = usage
        return body

    # -- logprobs ----------------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.token_str(token_id)

    def _logprobs(self, lps: list[Logprob] | None, start: int = 0) -> dict[str, Any] | None:
        """The ``logprobs`` object; a completion's ``text_offset`` counts from ``start``."""
        if lps is None:
            return None
        if self.chat:
            content = []
            for lp in lps:
                tok = self._token(lp.token_id)
                content.append(
                    {
                        "token": tok,
                        "logprob": lp.logprob,
                        "bytes": list(tok.encode()),
                        "top_logprobs": [
                            {"token": (t := self._token(tid)), "logprob": v, "bytes": list(t.encode())}
                            for tid, v in lp.top
                        ],
                    }
                )
            return {"content": content}
        tokens = [self._token(lp.token_id) for lp in lps]
        offsets, pos = [], start
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self._token(tid): v for tid, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }
