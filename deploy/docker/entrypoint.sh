#!/usr/bin/env bash
# The container's entry point: `pdserve serve` with container defaults, or a health check.
#
#   entrypoint.sh [pdserve serve flags...]   serve (flags given here win over the defaults)
#   entrypoint.sh health                     exit 0 when the router is up and not draining
#
# Defaults, each from an environment variable: the model (PDSERVE_MODEL, default smollm2-135m),
# the bind address (PDSERVE_HOST, default 0.0.0.0: a container's own interfaces, which its
# network namespace isolates; set PDSERVE_API_KEY with it) and the HTTP port (PDSERVE_HTTP_PORT,
# default 8000). The API key is read by pdserve itself from PDSERVE_API_KEY. `exec` makes pdserve
# the process that receives SIGTERM: it drains in-flight requests, then exits.
set -euo pipefail

host="${PDSERVE_HOST:-0.0.0.0}"
http_port="${PDSERVE_HTTP_PORT:-8000}"

if [[ "${1:-}" == "health" ]]; then
    # HTTPS when the server was given a certificate (PDSERVE_TLS=1); the check runs inside the
    # container against itself, so the certificate's name is not verified.
    scheme=http
    [[ "${PDSERVE_TLS:-0}" == "1" ]] && scheme=https
    exec python3 - "$scheme://127.0.0.1:$http_port/health" <<'PY'
import ssl
import sys
import urllib.request

context = ssl._create_unverified_context()
try:
    with urllib.request.urlopen(sys.argv[1], timeout=3, context=context) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception as e:  # refused, 503 while draining, timeout
    print(f"unhealthy: {e}", file=sys.stderr)
    sys.exit(1)
PY
fi

exec pdserve serve --model "${PDSERVE_MODEL:-smollm2-135m}" --host "$host" --http-port "$http_port" "$@"
