"""The router's constraint checker: a child process that compiles each constraint it is sent.

The router loads no grammar engine itself (the engine brings torch with it), and a compile it
must give up on is stopped by killing this process, where a thread could only be left running.
One JSON line in (``{"kind", "spec"}``), one out (``{"ok": true}`` or ``{"ok": false, "field",
"message"}``); a first line ``{"ready": true}`` once the engine and vocabulary are loaded. It
exits at the end of its input (its router is gone). ``router/constraint_check.py`` runs it.

    python -m pdserve.model_runtime.structured.check_process MODEL
"""

from __future__ import annotations

import json
import sys

from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.model_runtime.presets import resolve_model
from pdserve.model_runtime.structured.compiler import Grammars
from pdserve.model_runtime.structured.constraint import MAX_SPEC_BYTES, Constraint, ConstraintKind
from pdserve.model_runtime.tokenizer import TextTokenizer

MAX_LINE = 4 * MAX_SPEC_BYTES  # a spec JSON-escaped


def answer(grammars: Grammars, line: str) -> dict[str, object]:
    try:
        if len(line) > MAX_LINE:
            raise ValueError("line too long")
        msg = json.loads(line)
        c = Constraint(ConstraintKind(msg["kind"]), str(msg["spec"]))
    except (ValueError, KeyError, TypeError) as e:
        return {"ok": False, "field": "constraint", "message": f"malformed check: {e}"}
    try:
        grammars.check(c)
    except InvalidRequestError as e:
        return {"ok": False, "field": e.field, "message": e.message}
    return {"ok": True}


def main(argv: list[str]) -> int:
    checkpoint = resolve_model(argv[0])
    tokenizer = TextTokenizer.load(checkpoint)
    if tokenizer is None:
        print(json.dumps({"ready": False, "message": "the model has no tokenizer"}), flush=True)
        return 1
    config = checkpoint.model_config()
    # The router times each compile and kills this process past its limit: no limit here.
    grammars = Grammars(tokenizer, config.vocab_size, config.eos_token_ids, compile_timeout_s=1e9)
    grammars.load()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(answer(grammars, line)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
