"""Reading a written HTML report in tests: its packed blocks put back in place."""

import base64
import gzip
import re


def unpacked(html: str) -> str:
    """The report with its packed blocks (``data-z``: gzip + base64) put back, as its script does."""

    def put_back(m: re.Match) -> str:
        return gzip.decompress(base64.b64decode(m.group(1))).decode("utf-8")

    return re.sub(r'<div class="packed" data-z="([^"]+)">.*?</div>', put_back, html, flags=re.S)
