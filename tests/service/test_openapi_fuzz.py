"""The HTTP API against its own ``/openapi.json``: schemathesis, the property-based OpenAPI
fuzzer, generates schema-valid and schema-violating requests for every operation of a running
router and checks each answer — no server error, a documented status code and content type,
a body that matches the documented schema, and schema-violating requests refused.

Its ``positive_data_acceptance`` check (every schema-valid request accepted) is left out, and
why: some limits are not expressible in the schema (prompt + max_tokens beyond the context,
min_tokens above max_tokens, top_logprobs without logprobs), and the document says those are
answered 400 with the error shape the other checks verify."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.service.helpers import start_service

pytest.importorskip("schemathesis")
pytestmark = pytest.mark.slow


def test_the_http_api_answers_as_its_openapi_document_says() -> None:
    st, ep = start_service(use_ray=False, colocated=1)
    try:
        cmd = [
            sys.executable, "-m", "schemathesis.cli", "run", f"{ep.http}/openapi.json",
            "--checks", "all", "--exclude-checks", "positive_data_acceptance",
            "--max-examples", "25", "--seed", "20261201", "--output-sanitize", "false",
            # a CPU engine generating a fuzzed max_tokens (up to the cap) on a busy 2-core host
            # can take longer than schemathesis's 10 s default: slowness is not a wrong answer
            "--request-timeout", "120",
        ]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
        assert " passed" in out.stdout and "failed" not in out.stdout.split("SUMMARY")[-1], out.stdout[-3000:]
    finally:
        st.stop()
