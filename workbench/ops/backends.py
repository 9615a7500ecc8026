"""The op backend tables: which ``torch.ops.workbench`` op serves each canonical op on each backend.

Match first, fuse later: the pattern stage leaves canonical ``torch_*`` ops; ``insert_cached_attention``
and the ``post_load_fusion`` transforms swap them for the backend op picked here by name.

    table        backend      op (torch.ops.workbench.*)            needs
    attention    torch        torch_cached_attention                nothing (reads lengths on the host)
    attention    cpu          cpu_cached_attention                  an x86-64 (AVX2+) or ARM64 CPU + g++ (C++ kernel, decode)
    attention    triton       triton_cached_attention               triton + CUDA (or TRITON_INTERPRET=1)
    attention    flashinfer   flashinfer_cached_attention           flashinfer + CUDA; head_dim 64/128/256
    mla          torch        torch_cached_mla                      nothing (reads lengths on the host)
    mla          triton       triton_cached_mla                     triton + CUDA (or TRITON_INTERPRET=1)
    <state op>   torch        torch_cached_<op> (ops/recurrent.py)  nothing (reads lengths on the host)
    <state op>   triton       triton_cached_<op>                    triton + CUDA (or TRITON_INTERPRET=1)
    rmsnorm      torch        torch_rmsnorm (canonical, kept)       nothing
    rmsnorm      triton       triton_rmsnorm                        triton + CUDA (or TRITON_INTERPRET=1)
    rmsnorm      flashinfer   flashinfer_rmsnorm                    flashinfer + CUDA
    rope         torch        torch_rope_with_explicit_cos_sin      nothing
    rope         triton       triton_rope_with_explicit_cos_sin     triton + CUDA (or TRITON_INTERPRET=1)
    silu_mul     torch        torch_silu_and_mul                    nothing
    silu_mul     triton       triton_silu_and_mul                   triton + CUDA (or TRITON_INTERPRET=1)
    rmsnorm/rope/silu_mul  cpu  cpu_rmsnorm, cpu_rope_with_explicit_cos_sin, cpu_silu_and_mul  AVX2+ or NEON + g++

Every table -- attention, MLA, each stateful op (``state_backends``), fusion, compile -- is checked
against its family's contract when it is built (``Backend.contract_problems``) and chooses the same
way (``BackendRegistry.choose``: an explicit name, or ``auto`` -- the first
of the table's ``auto_order`` for the device type that runs there and serves the model). Attention
``auto``: FlashInfer, then Triton (both captured by CUDA graphs), then the torch reference on CUDA;
the C++ kernel, then torch, on CPU. Fusion ``auto``: Triton on CUDA, the C++ kernels (``cpu``) on a
CPU where they build, the torch op otherwise; never FlashInfer (its half-precision rounding differs
slightly from HF: opt-in).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.fx

from .attention.flashinfer_cached_attention import ALIBI_UNSUPPORTED, CHUNKED_UNSUPPORTED, FlashInferPlanner
from .attention.flashinfer_cached_attention import unsupported as flashinfer_unsupported
from .capture import HOST_SYNC_TAG
from .registry import Backend, BackendRegistry, Choice, OpBackend
from .state import StatefulOp
from .step_plan import StepPlanner
from .triton_support import triton_available

_CPU = "workbench.ops.cpu_kernels"
_ATT, _NORM, _ROPE, _MLP = (
    "workbench.ops.attention",
    "workbench.ops.normalization",
    "workbench.ops.rope",
    "workbench.ops.mlp",
)
TRITON_NEEDS = "triton and a CUDA GPU (or TRITON_INTERPRET=1 for CPU tensors)"
FLASHINFER_NEEDS = "a CUDA GPU and the flashinfer package (pip install flashinfer-python)"
CPU_KERNELS_NEED = (
    "an x86-64 CPU with AVX2 (or AVX-512) or an ARM64 CPU, g++ and ninja "
    "(the workbench's C++ CPU kernels, built on first use)"
)
# What an unset (``auto``) ``insert_cached_attention.backend`` tries, in order, per device type: the
# first that runs there and serves every layer's shape. On CUDA the two that CUDA graphs capture
# come first (FlashInfer where installed and the shapes fit, else Triton); the host-syncing torch
# reference is the last resort.
ATTENTION_AUTO = {"cpu": ("cpu", "torch"), "cuda": ("flashinfer", "triton", "torch")}
# What fusion ``auto`` tries, in order, per device type.
FUSION_AUTO = {"cuda": ("triton", "torch"), "cpu": ("cpu", "torch")}


ShapeCheck = Callable[[int, int, torch.dtype, bool], Optional[str]]


@dataclass(frozen=True)
class AttentionBackend(OpBackend):
    """A paged cached-attention op and what it serves, declared here rather than looked up:

    - ``captures``: whether a CUDA graph captures its decode steps; checked at registration against
      the op's own tag (``workbench.ops.capture``: a host-syncing op is tagged ``cudagraph_unsafe``).
    - ``shape_check(head_dim, v_head_dim, dtype, has_sinks)``: why it cannot take a layer of that
      shape (None: it can); absent: every shape.
    - ``refuses``: features it cannot serve, with why (``"alibi"``, ``"chunked"``).
    - ``planner``: the class that plans each step on the host (``workbench.ops.step_plan``), for
      kernels that need one (FlashInfer); None: none.
    """

    captures: bool = False
    shape_check: Optional[ShapeCheck] = None
    refuses: Mapping[str, str] = field(default_factory=dict)
    planner: Optional[type] = None

    def contract_problems(self) -> List[str]:
        problems = super().contract_problems()
        if problems:
            return problems
        reference = torch.ops.workbench.torch_cached_attention.default._schema.arguments
        arguments = self.op._schema.arguments
        if [(a.name, str(a.type)) for a in arguments] != [(a.name, str(a.type)) for a in reference]:
            problems.append("torch_cached_attention's arguments (backends are interchangeable in a graph)")
        tagged_unsafe = HOST_SYNC_TAG in self.op.tags
        if self.captures == tagged_unsafe:
            problems.append(
                f"a capture declaration matching its op's tags (captures={self.captures}, "
                f"op tagged cudagraph_unsafe={tagged_unsafe})"
            )
        unknown = set(self.refuses) - REFUSABLE
        if unknown:
            problems.append(f"refusals among {sorted(REFUSABLE)} (got {sorted(unknown)})")
        if self.planner is not None and not callable(getattr(self.planner, "begin", None)):
            problems.append(f"a planner with the StepPlanner methods ({self.planner.__name__} has no begin())")
        return problems

    def unsupported(self, head_dim: int, v_head_dim: int, dtype: torch.dtype, has_sinks: bool) -> Optional[str]:
        """Why this backend cannot take a layer of this shape (None: it can)."""
        return self.shape_check(head_dim, v_head_dim, dtype, has_sinks) if self.shape_check is not None else None

    def unsupported_chunked(self) -> Optional[str]:
        """Why this backend cannot serve chunked local attention (``chunk_size``; None: it can)."""
        return self.refuses.get("chunked")

    def unsupported_alibi(self) -> Optional[str]:
        """Why this backend cannot serve ALiBi (``alibi_slopes``; None: it can)."""
        return self.refuses.get("alibi")


#: The features an attention backend may refuse by name.
REFUSABLE = frozenset({"alibi", "chunked"})

ATTENTION_BACKENDS: BackendRegistry[AttentionBackend] = BackendRegistry(
    "attention",
    [
        AttentionBackend("torch", "nothing beyond PyTorch", f"{_ATT}.torch_cached_attention", "torch_cached_attention"),
        AttentionBackend("cpu", CPU_KERNELS_NEED, _CPU, "cpu_cached_attention"),
        AttentionBackend(
            "triton",
            "triton and a CUDA GPU (or TRITON_INTERPRET=1 on CPU)",
            f"{_ATT}.triton_cached_attention",
            "triton_cached_attention",
            captures=True,
        ),
        AttentionBackend(
            "flashinfer",
            FLASHINFER_NEEDS,
            f"{_ATT}.flashinfer_cached_attention",
            "flashinfer_cached_attention",
            captures=True,
            shape_check=flashinfer_unsupported,
            refuses={"alibi": ALIBI_UNSUPPORTED, "chunked": CHUNKED_UNSUPPORTED},
            planner=FlashInferPlanner,
        ),
    ],
    default="torch",
    auto_order=ATTENTION_AUTO,
)


def _fusion(family: str, *rows: Tuple[str, str, str, str]) -> BackendRegistry[OpBackend]:
    return BackendRegistry(
        family,
        [OpBackend(name, need, module, op) for name, module, op, need in rows],
        default="torch",
        auto_order={d: tuple(n for n in order if n in {r[0] for r in rows}) for d, order in FUSION_AUTO.items()},
    )


FUSION_BACKENDS: Dict[str, BackendRegistry[OpBackend]] = {
    "rmsnorm": _fusion(
        "rmsnorm",
        ("torch", f"{_NORM}.torch_norms", "torch_rmsnorm", "nothing beyond PyTorch"),
        ("triton", f"{_NORM}.triton_rmsnorm", "triton_rmsnorm", TRITON_NEEDS),
        ("flashinfer", f"{_NORM}.flashinfer_rmsnorm", "flashinfer_rmsnorm", FLASHINFER_NEEDS),
        ("cpu", _CPU, "cpu_rmsnorm", CPU_KERNELS_NEED),
    ),
    "rope": _fusion(
        "rope",
        ("torch", f"{_ROPE}.torch_rope", "torch_rope_with_explicit_cos_sin", "nothing beyond PyTorch"),
        ("triton", f"{_ROPE}.triton_rope", "triton_rope_with_explicit_cos_sin", TRITON_NEEDS),
        ("cpu", _CPU, "cpu_rope_with_explicit_cos_sin", CPU_KERNELS_NEED),
    ),
    "silu_mul": _fusion(
        "silu_mul",
        ("torch", f"{_MLP}.torch_silu_mul", "torch_silu_and_mul", "nothing beyond PyTorch"),
        ("triton", f"{_MLP}.triton_silu_mul", "triton_silu_and_mul", TRITON_NEEDS),
        ("cpu", _CPU, "cpu_silu_and_mul", CPU_KERNELS_NEED),
    ),
}


#: Multi-head latent attention over a paged latent cache (``insert_cached_mla_attention``): the torch
#: reference reads lengths on the host; the Triton op's decode-only steps are capturable.
MLA_BACKENDS: BackendRegistry[OpBackend] = BackendRegistry(
    "MLA",
    [
        OpBackend("torch", "nothing beyond PyTorch", "workbench.ops.mla.torch_cached_mla", "torch_cached_mla"),
        OpBackend("triton", TRITON_NEEDS, "workbench.ops.mla.triton_cached_mla", "triton_cached_mla"),
    ],
    default="torch",
    auto_order={"cuda": ("triton", "torch"), "cpu": ("torch",)},
)


@dataclass(frozen=True)
class StateOpBackend(Backend):
    """One cached form of a stateful op (``workbench.ops.state.StatefulOp.cached``): ``op_name`` the
    qualified op; a ``triton`` backend runs where Triton kernels do (``ops/triton_support.py``)."""

    op_name: str = ""

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        if self.name != "triton":
            return None
        ok, why = triton_available(device)
        return None if ok else why

    def contract_problems(self) -> List[str]:
        problems = super().contract_problems()
        ns, _, name = self.op_name.partition("::")
        if ns != "workbench" or not hasattr(torch.ops.workbench, name):
            problems.append(f"a registered cached op (got {self.op_name!r})")
        if self.name not in STATE_BACKEND_NAMES:
            problems.append(f"a backend name among {STATE_BACKEND_NAMES}")
        return problems


STATE_BACKEND_NAMES = ("torch", "triton")


def state_backends(op: StatefulOp) -> BackendRegistry[StateOpBackend]:
    """The backend table of one stateful op, from its ``cached`` mapping: auto takes Triton on CUDA
    where the op has a kernel and Triton runs, the torch reference otherwise."""
    needs = {"torch": "nothing beyond PyTorch", "triton": TRITON_NEEDS}
    return BackendRegistry(
        op.source.split("::")[1],
        [StateOpBackend(name, needs.get(name, ""), qualified) for name, qualified in op.cached.items()],
        default="torch",
        auto_order={d: tuple(n for n in order if n in op.cached) for d, order in FUSION_AUTO.items()},
    )


def planners_for(module: torch.nn.Module, device: torch.device) -> Dict[str, StepPlanner]:
    """A new planner for each attention backend that needs one and whose op ``module`` calls: in
    its graphs, or as a wrapper's ``op`` (transformers mode's ``HFCachedLM``)."""
    called = {getattr(module, "op", None)}
    for m in module.modules():
        if isinstance(m, torch.fx.GraphModule):
            called.update(n.target for n in m.graph.nodes if n.op == "call_function")
    found: Dict[str, StepPlanner] = {}
    for backend in ATTENTION_BACKENDS:
        if backend.planner is not None and backend.op in called:
            found[backend.name] = backend.planner(torch.device(device))
    return found


def fusion_backend_names(family: str) -> Tuple[str, ...]:
    return ("auto", *FUSION_BACKENDS[family].names())


def choose_fusion_backend(family: str, name: str, device: torch.device, field: str) -> Choice[OpBackend]:
    """The fusion backend of ``family`` for ``name`` on ``device``, and why (``BackendRegistry.choose``)."""
    return FUSION_BACKENDS[family].choose(name, device, field)


__all__ = [
    "AttentionBackend",
    "ATTENTION_BACKENDS",
    "REFUSABLE",
    "planners_for",
    "MLA_BACKENDS",
    "StateOpBackend",
    "state_backends",
    "ATTENTION_AUTO",
    "CPU_KERNELS_NEED",
    "FUSION_BACKENDS",
    "FUSION_AUTO",
    "fusion_backend_names",
    "choose_fusion_backend",
    "TRITON_NEEDS",
    "FLASHINFER_NEEDS",
]
