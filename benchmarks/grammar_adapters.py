"""One interface over xgrammar, llguidance and outlines-core for ``benchmarks/grammar_engines.py``.

Each adapter compiles a ``Constraint`` the way that engine's serving integrations do (JSON
schemas with separators ``", "`` / ``": "`` and no free whitespace, a regex, a choice list),
fills bitmask rows ([n, words] int32, bit ``t`` of a row set when token ``t`` is allowed), and
accepts tokens. xgrammar's is the project's own path (``structured.compiler``'s vocabulary and
options). outlines-core compiles in a child process so a compile that runs for minutes is cut
off (``TimeoutError``) instead of stalling the run.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from pdserve.model_runtime.structured.compiler import _choice_grammar, tokenizer_info
from pdserve.model_runtime.structured.constraint import Constraint, ConstraintKind
from pdserve.model_runtime.tokenizer import TextTokenizer, bytes_to_unicode

SEPARATORS = (", ", ": ")


@dataclass(frozen=True)
class Vocab:
    tokenizer: TextTokenizer
    size: int
    eos_ids: tuple[int, ...]


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Median milliseconds of ``repeat`` calls, and the last result."""
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


class Engine:
    name = ""

    def __init__(self, vocab: Vocab, threads: int = 1, timeout_s: float = 0.0) -> None:
        self.vocab = vocab
        self.threads = threads
        self.timeout_s = timeout_s

    def bitmask(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, words(self.vocab.size), dtype=torch.int32)

    def compile_timed(self, c: Constraint, repeat: int) -> tuple[float, Any]:
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        raise NotImplementedError

    def fill(self, matcher: Any, row: torch.Tensor) -> None:
        raise NotImplementedError

    def accept(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError

    def batch_fill(self, matchers: Sequence[Any], bitmask: torch.Tensor) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, vocab: Vocab, threads: int = 1, timeout_s: float = 0.0) -> None:
        import xgrammar as xgr

        super().__init__(vocab, threads, timeout_s)
        self.xgr = xgr
        self.info = tokenizer_info(vocab.tokenizer, vocab.size, vocab.eos_ids)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile_timed(self, c: Constraint, repeat: int) -> tuple[float, Any]:
        def once() -> Any:  # a fresh compiler: nothing cached from the last compile
            comp = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
            if c.kind is ConstraintKind.JSON_SCHEMA:
                return comp.compile_json_schema(
                    c.spec, any_whitespace=False, separators=SEPARATORS, strict_mode=True
                )
            if c.kind is ConstraintKind.REGEX:
                return comp.compile_regex(c.spec)
            return comp.compile_grammar(_choice_grammar(json.loads(c.spec)))

        return timed(once, repeat)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, row: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(row)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def batch_fill(self, matchers: Sequence[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(list(matchers), bitmask)


class LLGuidance(Engine):
    """A constraint compiles into a grammar and a first matcher (llguidance builds its lexer
    there, lazily after that); each later matcher is a copy of that first one, reset."""

    name = "llguidance"

    def __init__(self, vocab: Vocab, threads: int = 1, timeout_s: float = 0.0) -> None:
        import llguidance
        import llguidance.torch as llt

        super().__init__(vocab, threads, timeout_s)
        self.ll = llguidance
        self.llt = llt
        self.tok = llguidance.LLTokenizer(
            vocab.tokenizer.backend.to_str(), n_vocab=vocab.size, eos_token=list(vocab.eos_ids)
        )
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def _grammar(self, c: Constraint) -> str:
        M = self.ll.LLMatcher
        if c.kind is ConstraintKind.JSON_SCHEMA:
            options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
            return M.grammar_from_json_schema(c.spec, overrides=options)  # type: ignore[arg-type]
        if c.kind is ConstraintKind.REGEX:
            return M.grammar_from_regex(c.spec)
        options = json.loads(c.spec)
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))

    def compile_timed(self, c: Constraint, repeat: int) -> tuple[float, Any]:
        def once() -> Any:
            m = self.ll.LLMatcher(self.tok, self._grammar(c), log_level=0)
            if m.is_error():
                raise ValueError(m.get_error())
            return m

        return timed(once, repeat)

    def matcher(self, compiled: Any) -> Any:
        m = compiled.deep_copy()
        m.reset()
        return m

    def fill(self, matcher: Any, row: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask(matcher, row, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def batch_fill(self, matchers: Sequence[Any], bitmask: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, j) for j, m in enumerate(matchers)], bitmask)


def _outlines_vocabulary(tokenizer_json: str, eos_id: int) -> Any:
    """outlines-core's Vocabulary of the tokenizer: each token's bytes (byte-level pieces
    decoded), special tokens left out as the project's tokenizer_info leaves them out."""
    import outlines_core
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    to_byte = {ch: b for b, ch in bytes_to_unicode().items()}
    table: dict[bytes, list[int]] = {}
    for piece, i in tok.get_vocab(with_added_tokens=True).items():
        if piece in special or i == eos_id:
            continue
        if not all(ch in to_byte for ch in piece):
            continue  # not a byte-level piece: no text the grammar could match
        table.setdefault(bytes(to_byte[ch] for ch in piece), []).append(i)
    return outlines_core.Vocabulary(eos_id, table)


def _outlines_regex(c: Constraint) -> str:
    from outlines_core.json_schema import build_regex_from_schema

    if c.kind is ConstraintKind.JSON_SCHEMA:
        # one optional space where whitespace may go: the documents' ", " and ": "
        return str(build_regex_from_schema(c.spec, "[ ]?"))
    if c.kind is ConstraintKind.REGEX:
        return c.spec
    return "(" + "|".join(re.escape(o) for o in json.loads(c.spec)) + ")"


def _outlines_worker(conn: Connection, tokenizer_json: str, eos_id: int) -> None:
    import outlines_core

    vocabulary = _outlines_vocabulary(tokenizer_json, eos_id)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        kind, spec = msg
        try:
            t0 = time.perf_counter()
            index = outlines_core.Index(_outlines_regex(Constraint(ConstraintKind(kind), spec)), vocabulary)
            ms = (time.perf_counter() - t0) * 1e3
            _, (blob,) = index.__reduce__()
            conn.send(("ok", ms, blob))
        except Exception as e:
            conn.send(("error", 0.0, str(e)))


class OutlinesCore(Engine):
    """An Index per constraint (regex to token-level automaton, every state's tokens
    precomputed), compiled in a child process with a time limit; a Guide per matcher."""

    name = "outlines-core"

    def __init__(self, vocab: Vocab, threads: int = 1, timeout_s: float = 20.0) -> None:
        import outlines_core

        super().__init__(vocab, threads, timeout_s)
        self.oc = outlines_core
        self._proc: Any = None
        self._conn: Connection | None = None

    def _start(self) -> Connection:
        if self._conn is None:
            ctx = mp.get_context("spawn")  # the parent holds engine threads: no fork
            parent, child = ctx.Pipe()
            args = (child, self.vocab.tokenizer.backend.to_str(), self.vocab.eos_ids[0])
            self._proc = ctx.Process(target=_outlines_worker, args=args, daemon=True)
            self._proc.start()
            if parent.recv() != "ready":
                raise RuntimeError("outlines-core worker did not start")
            self._conn = parent
        return self._conn

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
        self._proc = self._conn = None

    def compile_timed(self, c: Constraint, repeat: int) -> tuple[float, Any]:
        conn = self._start()
        conn.send((c.kind.value, c.spec))
        if not conn.poll(self.timeout_s):
            self.close()  # the compile cannot be interrupted: its process goes
            raise TimeoutError(f"{self.timeout_s:g}")
        status, ms, payload = conn.recv()
        if status != "ok":
            raise ValueError(payload)
        return ms, self.oc.Index.from_binary(payload)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, matcher: Any, row: torch.Tensor) -> None:
        matcher.write_mask_into(row.data_ptr(), row.numel(), 4)

    def accept(self, matcher: Any, token: int) -> bool:
        try:
            matcher.advance(token, return_tokens=False)
        except Exception:  # outlines-core raises on a token its automaton has no edge for
            return False
        return True

    def batch_fill(self, matchers: Sequence[Any], bitmask: torch.Tensor) -> None:
        n = bitmask.shape[1]
        for j, m in enumerate(matchers):
            m.write_mask_into(bitmask[j].data_ptr(), n, 4)


ENGINES: dict[str, Callable[..., Engine]] = {
    "xgrammar": XGrammar,
    "llguidance": LLGuidance,
    "outlines-core": OutlinesCore,
}
