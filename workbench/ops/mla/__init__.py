"""Multi-head latent attention ops (DeepSeek-V2/V3 MLA); see README.md. Importing this package
registers ``torch.ops.workbench.torch_mla``, ``torch_cached_mla`` and ``triton_cached_mla``."""

from . import torch_cached_mla, torch_mla, triton_cached_mla  # noqa: F401
