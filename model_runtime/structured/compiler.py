"""Compiling constraints into grammars, once per process and off the step loop (xgrammar).

The engine is xgrammar, chosen by measurement over llguidance and outlines-core on this
project's CPU (``benchmarks/grammar_engines.py``, BENCHMARKS.md "Structured output"): its
compile precomputes each state's token masks, so a step's mask costs microseconds where
llguidance's lazy lexer costs hundreds in free-text positions.

``Grammars`` keeps a bounded cache of compile futures keyed by the constraint: the first
request with a constraint starts its compile on the compile thread and every later one shares
the result (or the refusal). A compile that outlives ``compile_timeout_s`` is refused (its
thread cannot be interrupted; the refusal stays cached, so a client repeating a hostile
constraint costs nothing more). A compiled grammar is refused too when it matches no output at
all (the first step's mask is empty) or is larger than ``max_grammar_bytes``.

Contract: ``compile`` never blocks; ``ready`` says whether ``compiled`` may be called, which
raises ``InvalidRequestError`` for a refused constraint. ``check`` blocks up to the timeout (the
router's checker process, ``structured/check_process.py``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.model_runtime.structured.constraint import Constraint, ConstraintKind, check_constraint, field_of
from pdserve.model_runtime.structured.vocab_masks import VocabMasks
from pdserve.model_runtime.tokenizer import TextTokenizer

if TYPE_CHECKING:  # imported on the compile thread, at the first constraint: it costs ~1 s
    import xgrammar as xgr

log = logging.getLogger(__name__)

# A worker's safety net: the router refuses what takes longer than its own limit (5 s) to
# compile, and a worker compiling beside a busy step loop may take longer than the router did.
COMPILE_TIMEOUT_S = 20.0
CACHE_ENTRIES = 512
COMPILE_THREADS = 4
MAX_GRAMMAR_BYTES = 64 << 20


def tokenizer_info(tokenizer: TextTokenizer, vocab_size: int, eos_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """The vocabulary as the grammar engine reads it. Ids past the tokenizer's (a model's logits
    may be padded) and special tokens are empty strings, which a grammar never allows: a
    ``<|im_start|>`` inside a JSON string would decode to nothing, and the client's text would
    not be the text the grammar checked."""
    import xgrammar as xgr

    tok = tokenizer.backend
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    # One call for the whole vocabulary: a call per token would wait for the GIL each time
    # behind a busy step loop (this runs on the compile thread).
    vocab = [""] * vocab_size
    for piece, i in tok.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and piece not in special:
            vocab[i] = piece
    decoder = json.loads(tok.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or ()}
    if "ByteLevel" in kinds:
        vocab_type = xgr.VocabType.BYTE_LEVEL
    elif "ByteFallback" in kinds:
        vocab_type = xgr.VocabType.BYTE_FALLBACK
    else:
        vocab_type = xgr.VocabType.RAW
    return xgr.TokenizerInfo(
        vocab, vocab_type=vocab_type, vocab_size=vocab_size, stop_token_ids=sorted(set(eos_ids))
    )


def _choice_grammar(options: list[str]) -> str:
    # JSON string literals are valid EBNF literals: quotes, backslashes and controls escaped.
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


class Grammars:
    """The compiled grammars of one process (see the module docstring)."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        vocab_size: int,
        eos_ids: Sequence[int],
        cache_entries: int = CACHE_ENTRIES,
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
        max_grammar_bytes: int = MAX_GRAMMAR_BYTES,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = tuple(sorted(set(eos_ids)))
        self.compile_timeout_s = compile_timeout_s
        self.max_grammar_bytes = max_grammar_bytes
        self._info: xgr.TokenizerInfo | None = None  # made by ``load``
        self._compilers = threading.local()  # one engine compiler per compile thread
        self.vocab: VocabMasks | None = None  # made by ``load``
        # Several threads: a compile past its timeout cannot be stopped, and one hostile
        # constraint must not hold every other one's compile behind it.
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()
        self._started: dict[tuple[str, str], float] = {}
        self._entries = cache_entries
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()
        self.compiles = 0  # compiles started (a counter tests and metrics read)

    def load(self) -> None:
        """Import the engine and read the vocabulary (~1 s, once). Call it on a thread that can
        afford the wait: importing on the compile thread behind a busy step loop crawls (every
        file the import reads gives the GIL away, and each time it waits a switch interval to
        get it back), so the engines call it on their own thread at the first constraint."""
        with self._load_lock:
            if self._info is not None:
                return
            info = tokenizer_info(self.tokenizer, self.vocab_size, self.eos_ids)
            self.vocab = VocabMasks.build(info.decoded_vocab[: self.vocab_size])
            self._info = info

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the cache -------------------------------------------------------------------------
    def compile(self, c: Constraint) -> Future[xgr.CompiledGrammar]:
        """The constraint's compile, started now unless it was before (never blocks)."""
        with self._lock:
            fut = self._cache.get(c.key)
            if fut is not None:
                self._cache.move_to_end(c.key)
                return fut
            fut = Future()
            self._cache[c.key] = fut
            while len(self._cache) > self._entries:
                old, f = self._cache.popitem(last=False)
                self._started.pop(old, None)
                if not f.done():  # still compiling: keep it (its waiters hold it anyway)
                    self._cache[old] = f
                    break
            self.compiles += 1
        self._pool.submit(self._run, c, fut)
        return fut

    def ready(self, c: Constraint) -> bool:
        """Whether ``compiled`` answers at once; a compile past its timeout counts as ready
        (refused)."""
        fut = self.compile(c)
        if fut.done():
            return True
        started = self._started.get(c.key)
        return started is not None and time.monotonic() - started > self.compile_timeout_s

    def compiled(self, c: Constraint) -> xgr.CompiledGrammar:
        """The compiled grammar; ``InvalidRequestError`` if the constraint was refused."""
        fut = self.compile(c)
        if not fut.done():
            if not self.ready(c):
                raise RuntimeError(f"{c.describe()} is still compiling: wait until ready()")
            raise self._too_slow(c)
        err = fut.exception()
        if err is not None:
            raise err
        return fut.result()

    def accepts(self, c: Constraint, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` are a prefix the constraint allows (the tokens a request brings to
        this worker: replayed, never sampled again). ``InvalidRequestError`` if refused."""
        g = self.compiled(c)
        if not tokens:
            return True
        import xgrammar as xgr

        m = xgr.GrammarMatcher(g)
        return all(m.accept_token(t) for t in tokens)

    def check(self, c: Constraint) -> None:
        """Block until the constraint compiled (``InvalidRequestError`` if refused or too slow).
        The timeout counts from the compile's start: time queued behind another compile is not
        this constraint's fault (though a queue that never moves is refused too)."""
        fut = self.compile(c)
        give_up = time.monotonic() + 4 * self.compile_timeout_s
        while True:
            started = self._started.get(c.key)
            now = time.monotonic()
            wait = 0.05 if started is None else started + self.compile_timeout_s - now
            try:
                fut.result(timeout=max(wait, 0.0))  # raises the refusal, if refused
                return
            except FutureTimeout:
                if started is not None or now > give_up:
                    raise self._too_slow(c) from None

    def _too_slow(self, c: Constraint) -> InvalidRequestError:
        limit = self.compile_timeout_s
        return InvalidRequestError(field_of(c), f"took longer than {limit:g} s to compile; simplify it")

    # -- the compile thread ----------------------------------------------------------------
    def _run(self, c: Constraint, fut: Future[xgr.CompiledGrammar]) -> None:
        started = self._started[c.key] = time.monotonic()
        try:
            g = self._compile_now(c)
            # Past the timeout it stays refused, even once done: whether a constraint is served
            # must not depend on when a client asks.
            if time.monotonic() - started > self.compile_timeout_s:
                raise self._too_slow(c)
            fut.set_result(g)
        except InvalidRequestError as e:
            fut.set_exception(e)
        except Exception as e:  # the engine's own words for a spec it cannot compile
            fut.set_exception(InvalidRequestError(field_of(c), f"does not compile: {_first_line(e)}"))
        except BaseException as e:  # a compile thread must always resolve its future
            fut.set_exception(InvalidRequestError(field_of(c), f"does not compile: {_first_line(e)}"))
            raise

    def _compile_now(self, c: Constraint) -> xgr.CompiledGrammar:
        check_constraint(c)
        t0 = time.perf_counter()
        self.load()
        assert self._info is not None
        comp = getattr(self._compilers, "compiler", None)
        if comp is None:
            import xgrammar as xgr

            comp = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
            self._compilers.compiler = comp
        if c.kind is ConstraintKind.JSON_OBJECT:
            # any object: JSON Schema's own default (additional properties allowed)
            g = comp.compile_json_schema('{"type":"object"}', any_whitespace=False, strict_mode=False)
        elif c.kind is ConstraintKind.JSON_SCHEMA:
            # strict: properties the schema does not name are not generated (still valid JSON
            # for the schema, and what OpenAI's strict mode asks for)
            g = comp.compile_json_schema(c.spec, any_whitespace=False, strict_mode=True)
        elif c.kind is ConstraintKind.REGEX:
            g = comp.compile_regex(c.spec)
        elif c.kind is ConstraintKind.CHOICE:
            g = comp.compile_grammar(_choice_grammar(json.loads(c.spec)))
        else:
            g = comp.compile_grammar(c.spec)
        size = g.memory_size_bytes
        if size > self.max_grammar_bytes:
            cap = self.max_grammar_bytes >> 20
            raise InvalidRequestError(field_of(c), f"compiles to {size >> 20} MiB; the cap is {cap} MiB")
        if not _matches_anything(g):
            raise InvalidRequestError(field_of(c), "matches no output at all")
        log.debug("compiled %s in %.1f ms (%d bytes)", c.describe(), (time.perf_counter() - t0) * 1e3, size)
        return g


def _matches_anything(g: xgr.CompiledGrammar) -> bool:
    import xgrammar as xgr

    m = xgr.GrammarMatcher(g)
    if m.is_terminated():
        return False
    mask = xgr.allocate_token_bitmask(1, g.tokenizer_info.vocab_size)
    m.fill_next_token_bitmask(mask)
    return bool(mask.any())


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[-1] if text else type(e).__name__
    # the engine prefixes its C++ source location: "[time] path.cc:123: message"
    return line.split(": ", 1)[1] if line.startswith("[") and ": " in line else line
