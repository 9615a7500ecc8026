"""dtype parsing for user-facing APIs.

Notebooks and YAML pipelines pass dtypes as strings ("bf16"), Python code passes
``torch.dtype`` objects; everything funnels through :func:`resolve_dtype` so a typo
fails early with the list of accepted spellings instead of deep inside transformers.
"""

from __future__ import annotations

import torch

from ..errors import InputError

#: Accepted spellings -> dtype. Only the floating dtypes a model can sensibly run in.
DTYPE_ALIASES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

_ALLOWED = frozenset(DTYPE_ALIASES.values())


def auto_dtype(device: torch.device | str) -> torch.dtype:
    """What ``dtype="auto"`` means on ``device``: bfloat16 on CUDA (what GPU kernels -- FlashInfer,
    tensor cores -- are built for), float32 elsewhere (the CPU kernels' and HF eager's reference)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def resolve_dtype(x: torch.dtype | str, device: torch.device | str = "cpu") -> torch.dtype:
    """Return the ``torch.dtype`` for ``x`` (a dtype, or a string such as ``"bf16"``; ``"auto"``:
    ``auto_dtype(device)``).

    Strings are case-insensitive and may carry a ``torch.`` prefix. Raises ``InputError`` (a ``ValueError``)
    naming the accepted spellings for anything else (including non-floating dtypes).
    """
    if isinstance(x, str) and x.strip().lower() == "auto":
        return auto_dtype(device)
    if isinstance(x, torch.dtype):
        if x not in _ALLOWED:
            raise InputError(f"unsupported model dtype {x}; use one of float32, bfloat16, float16")
        return x
    if isinstance(x, str):
        key = x.strip().lower().removeprefix("torch.")
        if key in DTYPE_ALIASES:
            return DTYPE_ALIASES[key]
    raise InputError(
        f"unknown dtype {x!r}; accepted: torch.float32/bfloat16/float16 or one of the strings "
        + ", ".join(repr(k) for k in ("auto", *DTYPE_ALIASES))
    )
