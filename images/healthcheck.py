#!/usr/bin/env python3
"""Container health check: every URL in $ROLLPACKER_HEALTH_URLS (comma-separated) answers 2xx.

Installed as /usr/local/bin/rollpacker-healthcheck in every image and used by its HEALTHCHECK and by
the manifests' exec probes. Each image sets the default for the process it serves (the MLflow
server's /health, a Ray node's raylet health endpoint); a pod overrides it through the environment.
Standard library only, so it works before and without the image's virtual environment.

Exit status 0: healthy; 1: a URL failed (the reason is printed); 2: nothing to check.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

ENV = "ROLLPACKER_HEALTH_URLS"


def check(url: str, timeout_s: float) -> str | None:
    """None if ``url`` answers 2xx within ``timeout_s``, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            if 200 <= resp.status < 300:
                return None
            return f"{url}: HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        return f"{url}: HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return f"{url}: {getattr(e, 'reason', e)}"


def main(argv: list[str]) -> int:
    urls = [u.strip() for u in (argv or os.environ.get(ENV, "").split(",")) if u.strip()]
    if not urls:
        print(f"unhealthy: no URL to check (set ${ENV} or pass URLs)", file=sys.stderr)
        return 2
    timeout_s = float(os.environ.get("ROLLPACKER_HEALTH_TIMEOUT_S", "3"))
    failures = [f for f in (check(u, timeout_s) for u in urls) if f]
    for f in failures:
        print(f"unhealthy: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
