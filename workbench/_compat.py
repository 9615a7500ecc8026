"""Version-gated access to library internals we cannot avoid touching.

Everything here is a context manager that restores what it changed on exit, is checked against the
library versions it was written for, and has its own test (tests/test_compat.py).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import transformers
from packaging.version import Version

TRANSFORMERS_VERSION = Version(transformers.__version__.split("+")[0])


@contextlib.contextmanager
def hf_packed_sequence_detection_disabled() -> Iterator[None]:
    """Make transformers' mask builder skip its packed-sequence detection.

    With no attention mask, ``masking_utils._preprocess_mask_arguments`` looks at ``position_ids``
    to detect several sequences packed into one row and then materialises a position-dependent mask
    (diff / cumsum / index nodes in every exported graph). The export contract always gives each
    row contiguous positions, so the detection can only cost graph nodes. transformers >= 4.53
    has the function; older versions never detected packing, so there is nothing to do.
    """
    import transformers.masking_utils as mu

    if TRANSFORMERS_VERSION < Version("4.53") or not hasattr(mu, "find_packed_sequence_indices"):
        yield
        return
    original = mu.find_packed_sequence_indices
    mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = original
