"""``RuntimeLimits``: how much the compiled model must serve -- the one holder of each limit.

Made once from the ``Workbench`` arguments (max_batch_size, max_seq_len, max_num_tokens, page_size);
a transform field that overrides one (``initialize_cache.max_batch_size``) replaces it and the
change is recorded. The KV cache's geometry (``KVCacheConfig``) holds the limits it was sized for
instead of copies of them, so a limit has one value wherever it is read.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Optional, Tuple

from ..errors import InputError

DEFAULT_MAX_NUM_TOKENS = 2048


@dataclass(frozen=True)
class RuntimeLimits:
    """How much the compiled model must serve: one source of truth for every stage and the runtime."""

    max_batch_size: int = 64  # sequences in flight at once
    max_seq_len: int = 2048  # tokens one sequence may hold (prompt + generated)
    max_num_tokens: Optional[int] = None  # tokens per forward step; None: min(2048, batch * seq)
    page_size: int = 16  # tokens per KV-cache page
    overrides: Tuple[str, ...] = ()  # "initialize_cache.max_batch_size: 64 -> 8", in order

    def __post_init__(self):
        for name in ("max_batch_size", "max_seq_len", "page_size", "max_num_tokens"):
            value = getattr(self, name)
            if name == "max_num_tokens" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise InputError(f"{name} must be a whole number >= 1, got {value!r}")

    @property
    def num_tokens(self) -> int:
        """Tokens per forward step, resolved."""
        return self.max_num_tokens or min(DEFAULT_MAX_NUM_TOKENS, self.max_batch_size * self.max_seq_len)

    def override(self, key: str, **values: Optional[int]) -> "RuntimeLimits":
        """These limits with ``values`` (None: keep) set by transform ``key``, the change recorded."""
        changed = {k: v for k, v in values.items() if v is not None and v != getattr(self, k)}
        if not changed:
            return self
        notes = tuple(f"{key}.{k}: {getattr(self, k)} -> {v}" for k, v in changed.items())
        return dataclasses.replace(self, **changed, overrides=self.overrides + notes)


__all__ = ["RuntimeLimits", "DEFAULT_MAX_NUM_TOKENS"]
