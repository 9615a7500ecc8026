"""Reading a written HTML report in tests: its packed blocks put back in place; the Chromium the
browser tests drive (the system one: playwright downloads no browser here)."""

import base64
import gzip
import re
import shutil
from pathlib import Path
from typing import Optional


def unpacked(html: str) -> str:
    """The report with its packed blocks (``data-z``: gzip + base64) put back, as its script does."""

    def put_back(m: re.Match) -> str:
        return gzip.decompress(base64.b64decode(m.group(1))).decode("utf-8")

    return re.sub(r'<div class="packed" data-z="([^"]+)">.*?</div>', put_back, html, flags=re.S)


def find_chromium() -> Optional[str]:
    """The system Chromium (or Chrome), None when there is none."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None
