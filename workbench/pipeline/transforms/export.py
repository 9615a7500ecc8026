"""Stage ``export``: ``export_to_gm`` turns the wrapped HF model into a torch.fx GraphModule.

Non-strict ``torch.export`` behind the contract ``(input_ids, position_ids) -> logits`` with dynamic
batch and sequence dims. The exported module keeps the model's parameter objects (no copy).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from pydantic import Field, field_validator

from ...models.export_contract import make_batch
from ..graph_utils import remove_tensor_metadata_asserts
from ..interface import Transform, TransformConfig, TransformInfo, register
from .export_patches import EXPORT_PATCHES, apply_patches, resolve_patches


class ExportToGMConfig(TransformConfig):
    strict: bool = Field(default=False, description="Use strict (dynamo) export instead of non-strict.")
    patches: Dict[str, bool] = Field(
        default_factory=dict,
        description="Switch export patches on/off by name (others keep their default). "
        f"Known: {sorted(EXPORT_PATCHES)}.",
    )
    example_batch_size: int = Field(
        default=2, ge=2, description="Batch size of the example inputs (>= 2 so it stays dynamic)."
    )
    example_seq_len: int = Field(
        default=8, ge=2, description="Sequence length of the example inputs (>= 2 so it stays dynamic)."
    )
    max_batch_size: Optional[int] = Field(
        default=None, ge=2, description="Upper bound of the dynamic batch dim (default: context's)."
    )
    max_seq_len: Optional[int] = Field(
        default=None, ge=2, description="Upper bound of the dynamic sequence dim (default: context's)."
    )
    remove_tensor_metadata_asserts: bool = Field(
        default=True,
        description="Drop aten._assert_tensor_metadata nodes that export adds around .to() calls; "
        "they check nothing the graph can violate and get in the way of pattern matching.",
    )

    @field_validator("patches")
    @classmethod
    def _known_patches(cls, v: Dict[str, bool]) -> Dict[str, bool]:
        resolve_patches(v)
        return v


@register("export_to_gm")
class ExportToGM(Transform):
    config_class = ExportToGMConfig

    def _apply(self, mod: torch.nn.Module, ctx) -> Tuple[torch.nn.Module, TransformInfo]:
        cfg: ExportToGMConfig = self.config
        if isinstance(mod, torch.fx.GraphModule):
            raise TypeError("export_to_gm got a GraphModule: the model is already exported")
        max_b = cfg.max_batch_size or ctx.max_batch_size
        max_s = cfg.max_seq_len or ctx.max_seq_len
        example = make_batch(
            ctx.vocab_size, cfg.example_batch_size, cfg.example_seq_len, seed=0, device=ctx.device
        )
        batch = torch.export.Dim("batch", min=1, max=max_b)
        seq = torch.export.Dim("seq", min=1, max=max_s)
        dyn = ({0: batch, 1: seq}, {0: batch, 1: seq})
        patches = resolve_patches(cfg.patches)
        with apply_patches(patches, mod), torch.inference_mode(False), torch.no_grad():
            ep = torch.export.export(mod, example.args, dynamic_shapes=dyn, strict=cfg.strict)
        gm = ep.module()
        removed = remove_tensor_metadata_asserts(gm) if cfg.remove_tensor_metadata_asserts else 0
        gm.meta["range_constraints"] = {str(k): str(v) for k, v in ep.range_constraints.items()}
        gm.meta["export_patches"] = [p.name for p in patches]
        gm.meta["dynamic_dims"] = {"batch": (1, max_b), "seq": (1, max_s)}
        gm.graph.eliminate_dead_code()
        gm.recompile()
        info = TransformInfo(
            num_matches=1, is_clean=True, has_valid_shapes=True,
            details={"patches": [p.name for p in patches], "asserts_removed": removed},
        )
        return gm, info
