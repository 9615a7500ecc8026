"""Multi-head latent attention ops (DeepSeek-V2/V3 MLA); see README.md. Importing this package
registers ``torch.ops.workbench.torch_mla`` and ``torch.ops.workbench.torch_cached_mla``."""

from . import torch_cached_mla, torch_mla  # noqa: F401
