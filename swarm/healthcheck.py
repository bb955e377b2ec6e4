"""`python -m swarm.healthcheck`: exit 0 if this container's peer answers /healthz, else 1 (Docker HEALTHCHECK).

It asks the metrics port named by SWARM_METRICS_PORT (the image sets 9100) on 127.0.0.1.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

TIMEOUT = 5.0


def check(port: str | None) -> str | None:
    """None if healthy, else why not."""
    if not port:
        return "SWARM_METRICS_PORT is not set: no /healthz to ask"
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{int(port)}/healthz", timeout=TIMEOUT) as reply:
            return None if reply.status == 200 else f"/healthz answered {reply.status}"
    except urllib.error.HTTPError as e:
        return e.read().decode(errors="replace").strip() or f"/healthz answered {e.code}"
    except (OSError, ValueError) as e:
        return f"/healthz on port {port}: {e}"


def main() -> None:
    problem = check(os.environ.get("SWARM_METRICS_PORT"))
    if problem:
        print(problem, file=sys.stderr)
        sys.exit(1)
    print("healthy")


if __name__ == "__main__":
    main()
