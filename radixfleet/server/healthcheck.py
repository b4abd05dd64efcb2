"""The container's HEALTHCHECK: ``python -m radixfleet.server.healthcheck [URL]``.

GETs ``URL`` (default ``$RADIXFLEET_HEALTH_URL``, else the router's
``http://127.0.0.1:8000/health``) and exits 0 on a 200 answer within 2 s, else 1
with one line on stderr. The slim image has no curl; this needs only the standard
library, so it also works for an agent container (set the variable to its port).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000/health"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    url = argv[0] if argv else os.environ.get("RADIXFLEET_HEALTH_URL") or DEFAULT_URL
    try:
        # no proxies: the URL is this container's own loopback
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=2.0) as resp:
            if resp.status == 200:
                return 0
            print(f"healthcheck: {url} answered {resp.status}", file=sys.stderr)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"healthcheck: {url}: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
