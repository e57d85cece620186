"""Flags that more than one command takes, declared once (pure: argparse only).

``serve`` and ``simulate`` share the deployment's shape and routing (a simulated layout is
written the way it is served); ``generate``, ``serve``, ``profile`` and ``simulate`` the
scheduler's budgets and the KV block; ``bench``, ``simulate`` and ``plan`` the SLO, the result
file and the sweep. A command may choose its own default where the commands' worlds differ (a
CPU engine's step budget is not an H100's), never its own meaning.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.model_runtime.scheduler.plan import ColocatedSchedule
from pdserve.router.policy import POLICIES
from pdserve.steptime.roofline import TP_DEGREES


# Value checks for ``type=``: argparse then names the flag in its error. Each states the range it
# accepts, so NaN (which every comparison fails) is refused with the rest.
def int_at_least(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
        return value

    return parse


def finite_at_least(least: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text)
        if not least <= value < math.inf:
            raise argparse.ArgumentTypeError(f"must be a finite number >= {least:g}, got {text}")
        return value

    return parse


def positive_finite(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def share(text: str) -> float:
    """A share in (0, 1]."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535 (0: a free port), got {value}")
    return value


def add_layout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument(
        "--colocated",
        type=int,
        nargs="?",
        const=-1,
        default=0,
        help="N colocated engines instead (default N: prefill + decode, the same hardware)",
    )
    p.add_argument(
        "--colocated-schedule",
        choices=[c.value for c in ColocatedSchedule],
        default=ColocatedSchedule.CHUNKED.value,
        help="colocated engines: chunked prefill riding along decodes (default), or whole prompts "
        "first (vLLM v0's schedule; `pdserve plan` says when it wins)",
    )
    add_tp(p)


def tp_degree(text: str) -> int:
    """A worker's tensor-parallel degree: the GPUs it spans, a power of two within a node."""
    value = int(text)
    if value not in TP_DEGREES:
        raise argparse.ArgumentTypeError(
            f"must be a power of two from 1 to {TP_DEGREES[-1]} (GPUs a worker spans), got {value}"
        )
    return value


def add_tp(p: argparse.ArgumentParser) -> None:
    """``--prefill-tp`` / ``--decode-tp``: the GPUs each worker of a pool spans (colocated
    engines take ``--decode-tp``, as they take the decode workers' settings). ``pdserve plan``
    searches a degree not given (its default: None)."""
    for pool, whose in (("prefill", "prefill worker"), ("decode", "decode worker and colocated engine")):
        p.add_argument(
            f"--{pool}-tp",
            type=tp_degree,
            default=1,
            metavar="N",
            help=f"tensor-parallel degree: the GPUs each {whose} spans, 1/2/4/8 (default 1; "
            "pdserve plan searches it unless given)",
        )


def pool_degrees(args: argparse.Namespace) -> tuple[int, int]:
    """``(prefill, decode)`` degrees of a served or simulated layout (colocated engines: the
    decode degree, and a different prefill degree is refused: no prefill pool runs)."""
    ptp, dtp = int(getattr(args, "prefill_tp", 1) or 1), int(getattr(args, "decode_tp", 1) or 1)
    if colocated_count(args) and ptp not in (1, dtp):
        raise ValueError("colocated engines run at --decode-tp; --prefill-tp sizes a prefill pool")
    return (dtp if colocated_count(args) else ptp), dtp


def layout_label(prefill: int, decode: int, colocated: int, prefill_tp: int = 1, decode_tp: int = 1) -> str:
    """``"4P+4D"``, ``"8 colocated"``; a degree above 1 as ``@tp<N>`` (``"2P@tp4+3D@tp8"``)."""

    def at(tp: int) -> str:
        return f"@tp{tp}" if tp > 1 else ""

    if colocated:
        return f"{colocated} colocated{at(decode_tp)}"
    return f"{prefill}P{at(prefill_tp)}+{decode}D{at(decode_tp)}"


def colocated_count(args: argparse.Namespace) -> int:
    """``--colocated``'s engines: 0 for a split deployment."""
    n = int(args.colocated)
    return args.prefill + args.decode if n < 0 else n


def add_policy(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--policy", choices=sorted(POLICIES), default=default, help=f"routing policy (default {default})"
    )


def add_scheduler(
    p: argparse.ArgumentParser, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None
) -> None:
    """A default of ``None`` follows the device (``backend.default_step_tokens`` and
    ``default_max_seqs``; an emulated GPU is a GPU)."""
    default = "512 on a CPU, 8192 on a GPU" if max_num_batched_tokens is None else str(max_num_batched_tokens)
    seqs = "64 on a CPU, 256 on a GPU" if max_num_seqs is None else str(max_num_seqs)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=max_num_batched_tokens,
        help=f"tokens a step computes at most (prefill / colocated budget; default {default})",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=max_num_seqs,
        help=f"requests a step holds at most (default {seqs})",
    )


def add_block_size(p: argparse.ArgumentParser, default: int, why: str = "") -> None:
    p.add_argument(
        "--block-size", type=int, default=default, help=f"KV block tokens{why} (default {default})"
    )


# What ``pdserve serve`` and ``generate`` serve without --model: a real instruct model.
DEFAULT_MODEL = "smollm2-135m"


def add_model(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--model",
        default=default,
        help="smollm2-135m (a real instruct model, installed by the Makefile), tiny or bench (synthetic), "
        f"a Hugging Face directory, or a .gguf file (default {default})",
    )


def add_temperature(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--temperature",
        type=finite_at_least(0.0),
        default=0.0,
        help="sampling temperature (default 0: greedy)",
    )


def add_goodput(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--goodput", nargs="+", default=[], metavar="METRIC:MS", help="the SLO, e.g. ttft:250 tpot:100"
    )


def add_result(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save-result", action="store_true", help="write the result as JSON")
    p.add_argument("--result-dir", type=Path, default=Path("."), help="default: the working directory")
    p.add_argument("--result-filename", default=None, help="default: named after the run")


def save_result(args: argparse.Namespace, result: Any, default_name: str) -> Path | None:
    """With ``--save-result``, write ``result`` to ``--result-dir``/``--result-filename`` (or
    ``default_name``); the path written, else ``None``."""
    if not args.save_result:
        return None
    path: Path = args.result_dir / (args.result_filename or default_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    print(f"saved {path.resolve()}")
    return path


def add_sweep_steps(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sweep-steps", type=int_at_least(0), default=5, help="bisection steps after bracketing")
