"""Weights apart from the graph: which real tensor each attribute of a meta-traced graph stands for.

``export_to_gm`` traces a weightless twin of the model on the ``meta`` device, so nothing about the
graph depends on where the weights will live (nor costs a copy of them). Until ``load_weights``
runs, every parameter and buffer of the graph module is a meta tensor and every factory call in
the graph (``arange``, ``full``, ``_to_copy``...) names ``device=meta``. This module names the real
tensors (``WeightSource``), records how transforms derive the others, and resolves a graph
attribute to its real tensor (``WeightResolver``), for the two users that bind a graph to them:

* ``load_weights`` (stage ``weight_load``) binds the live graph for good with
  ``weight_placement.place_weights``: each meta tensor is replaced by the real one of the same name
  (moved to the pipeline device when it lives elsewhere), device arguments in nodes are retargeted,
  and the fake values move to the device so shape propagation sees one device.
* the numerics probe (and ``PipelineStepper.forward``) runs graphs from before ``weight_load`` with
  ``unloaded_run.run_unloaded``: a plain node loop that serves ``get_attr`` from the source and
  rewrites ``device=meta`` on the fly, without touching the graph.

Weights a transform derives before ``weight_load`` (e.g. per-expert views of a stacked MoE tensor)
are recorded with ``record_weight_view`` and rebuilt from their base when the base is bound.

Tensors the model makes inside ``forward`` from Python data (``torch.tensor([...], device=x.device)``,
an index list such as Falcon's ``fused_qkv[..., [-2], :]``) are constants to ``torch.export``, which
lifts them into the graph as attributes; made on ``meta`` they hold no values. ``export_to_gm``
recovers their values (a trace on CPU, see ``export/forward_constants.py``) and records them with
``record_forward_constant``; they are bound here like weights (the attribute stays ``meta`` until
``load_weights``, so the unloaded graph is uniformly weightless).

Quantized checkpoints: the eager model is the *dequantized* twin, and the source also carries the
checkpoint's raw tensors by their checkpoint names (``WeightSource.checkpoint``). A quantize
transform that gives the graph a tensor the eager model does not hold (an fp8 ``weight``, its
``weight_scale``, experts stacked from per-expert checkpoint tensors, AWQ codes repacked for our
op) declares where it comes from with ``record_tensor_binding``: named inputs from the checkpoint
or the eager model, and the conversion applied at load -- visible in ``gm.meta``, no load hooks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.fx as fx

from .graph.weights import fetch_attr

WEIGHT_VIEWS_KEY = "weight_views"  # gm.meta: target -> (base target, index into the base)
TENSOR_BINDINGS_KEY = "tensor_bindings"  # gm.meta: target -> TensorBinding
TRACE_DEVICE_KEY = "trace_device"  # gm.meta: the device export traced on ("meta" or the model's)
FORWARD_CONSTANTS_KEY = "forward_constants"  # gm.meta: target -> real (CPU) value of a tensor made in forward


class WeightSource(Mapping):
    """The real tensors of the eager model, by the names the exported graph uses.

    ``module`` is the module that was exported (``CausalLMLogits(model)``), so its parameter and
    buffer names are exactly the graph module's attribute targets. Tied names map to one tensor.
    Nothing is copied: this is a name index over the eager model's own tensors.

    ``checkpoint``: a quantized checkpoint's raw tensors by checkpoint name (None for other
    models); only ``record_tensor_binding`` entries read them.
    """

    def __init__(self, module: Optional[torch.nn.Module], checkpoint: Optional[Mapping] = None):
        self._tensors: Dict[str, torch.Tensor] = (
            {}
            if module is None
            else {
                **dict(module.named_parameters(remove_duplicate=False)),
                **dict(module.named_buffers(remove_duplicate=False)),
            }
        )
        self.checkpoint = checkpoint

    def with_checkpoint(self, checkpoint: Optional[Mapping]) -> "WeightSource":
        """The same eager tensors with ``checkpoint``'s raw tensors beside them (no copy)."""
        out = WeightSource(None, checkpoint)
        out._tensors = self._tensors
        return out

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        extra = f", checkpoint: {len(self.checkpoint)} tensors" if self.checkpoint is not None else ""
        return f"WeightSource({len(self)} tensors{extra})"


def with_checkpoint(source: Optional[Mapping], checkpoint: Optional[Mapping]) -> Optional[Mapping]:
    """``source`` (a ``WeightSource`` or a plain mapping) with ``checkpoint`` beside it."""
    if source is None or checkpoint is None or getattr(source, "checkpoint", None) is checkpoint:
        return source
    if isinstance(source, WeightSource):
        return source.with_checkpoint(checkpoint)
    out = WeightSource(None, checkpoint)
    out._tensors = dict(source)
    return out


@dataclass(frozen=True)
class TensorBinding:
    """Where ``load_weights`` gets a graph tensor the eager model does not hold as it is.

    ``inputs`` are tensor names in ``namespace``: ``"checkpoint"`` (the quantized checkpoint's raw
    tensors, by checkpoint name) or ``"model"`` (the eager model's, by graph name). ``convert``
    (a module-level function, named in renders and reports) makes the tensor from them, with the
    static ``kwargs``; None takes the single input as it is. ``output`` picks one element when
    ``convert`` returns a tuple (several graph tensors from one conversion run it once per load).
    """

    inputs: Tuple[str, ...]
    namespace: str = "checkpoint"
    convert: Optional[Callable[..., torch.Tensor]] = None
    kwargs: Tuple[Tuple[str, Any], ...] = ()
    output: Optional[int] = None

    def __post_init__(self):
        if self.namespace not in ("checkpoint", "model"):
            raise ValueError(f"TensorBinding.namespace must be 'checkpoint' or 'model', got {self.namespace!r}")
        if self.convert is None and len(self.inputs) != 1:
            raise ValueError(f"a TensorBinding without convert takes exactly one input, got {self.inputs}")

    def describe(self) -> str:
        args = ", ".join([*self.inputs, *(f"{k}={v!r}" for k, v in self.kwargs)])
        call = f"{self.convert.__name__}({args})" if self.convert is not None else args
        pick = f"[{self.output}]" if self.output is not None else ""
        return f"{self.namespace}: {call}{pick}"


def record_tensor_binding(gm: fx.GraphModule, target: str, binding: TensorBinding) -> None:
    """Declare that attribute ``target`` is made at load as ``binding`` says (takes precedence over
    an eager tensor of the same name: e.g. ``q_proj.weight`` fp8 from the checkpoint, not the
    dequantized twin's fp32). A new dict each time: snapshots share the old one."""
    gm.meta[TENSOR_BINDINGS_KEY] = {**gm.meta.get(TENSOR_BINDINGS_KEY, {}), target: binding}


def tensor_bindings(gm: fx.GraphModule) -> Dict[str, TensorBinding]:
    return dict(gm.meta.get(TENSOR_BINDINGS_KEY, {}))


def record_weight_view(gm: fx.GraphModule, target: str, base: str, index: Tuple[Any, ...]) -> None:
    """Note that attribute ``target`` is ``base[index]`` (ints and slices), so that binding ``base``
    to its real tensor rebuilds ``target`` as a view of it."""
    gm.meta.setdefault(WEIGHT_VIEWS_KEY, {})[target] = (base, tuple(index))


def record_forward_constant(gm: fx.GraphModule, target: str, value: torch.Tensor) -> None:
    """Note that attribute ``target`` (a ``meta`` tensor export lifted from the model's forward) has
    the real value ``value``: ``load_weights`` binds it, the unloaded probe reads it. A new dict each
    time: snapshots share the old one."""
    gm.meta[FORWARD_CONSTANTS_KEY] = {**gm.meta.get(FORWARD_CONSTANTS_KEY, {}), target: value}


def forward_constants(gm: fx.GraphModule) -> Dict[str, torch.Tensor]:
    return dict(gm.meta.get(FORWARD_CONSTANTS_KEY, {}))


def tensor_attributes(gm: fx.GraphModule) -> Dict[str, torch.Tensor]:
    """Every tensor the graph module holds: parameters, buffers (tied names included) and plain
    tensor attributes that ``get_attr`` nodes read (constants export lifted)."""
    out: Dict[str, torch.Tensor] = {
        **dict(gm.named_parameters(remove_duplicate=False)),
        **dict(gm.named_buffers(remove_duplicate=False)),
    }
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target not in out:
            value = fetch_attr(gm, node.target)
            if isinstance(value, torch.Tensor):
                out[node.target] = value
    return out


def unloaded_targets(mod: torch.nn.Module) -> List[str]:
    """Names of the meta tensors a graph module still holds (empty once ``load_weights`` ran)."""
    if not isinstance(mod, fx.GraphModule):
        return []
    return [name for name, t in tensor_attributes(mod).items() if t.is_meta]


class WeightResolver:
    """Real tensor for a graph attribute name: made as a recorded binding says, taken from the
    source, rebuilt as a recorded view, or the recorded value of a tensor made in forward."""

    def __init__(self, gm: fx.GraphModule, source: Optional[Mapping]):
        self.source = source if source is not None else {}
        self.views: Dict[str, Tuple[str, tuple]] = dict(gm.meta.get(WEIGHT_VIEWS_KEY, {}))
        self.bindings: Dict[str, TensorBinding] = tensor_bindings(gm)
        self.constants: Dict[str, torch.Tensor] = forward_constants(gm)
        self._memo: Dict[str, torch.Tensor] = {}
        self._converted: Dict[tuple, Any] = {}  # one conversion run per load, however many outputs

    def _input(self, namespace: str, name: str) -> torch.Tensor:
        if namespace == "model":
            return self.source[name]
        checkpoint = getattr(self.source, "checkpoint", None)
        if checkpoint is None:
            raise KeyError(f"{name} (a quantized checkpoint tensor, and this weight source has no checkpoint)")
        return checkpoint[name]

    def _bound(self, binding: TensorBinding) -> torch.Tensor:
        key = (binding.convert, binding.namespace, binding.inputs, binding.kwargs)
        if key not in self._converted:
            tensors = [self._input(binding.namespace, n) for n in binding.inputs]
            with torch.no_grad():
                self._converted[key] = (
                    binding.convert(*tensors, **dict(binding.kwargs)) if binding.convert is not None else tensors[0]
                )
        out = self._converted[key]
        return out[binding.output] if binding.output is not None else out

    def __call__(self, name: str) -> torch.Tensor:
        if name in self._memo:
            return self._memo[name]
        if name in self.bindings:
            value = self._bound(self.bindings[name])
        elif name in self.source:
            value = self.source[name]
        elif name in self.views:
            base, index = self.views[name]
            value = self(base)[index]
        elif name in self.constants:
            value = self.constants[name]
        else:
            raise KeyError(name)
        self._memo[name] = value
        return value

    def missing(self, names) -> List[str]:
        out = []
        for name in names:
            try:
                self(name)
            except KeyError:
                out.append(name)
        return out


__all__ = [
    "WeightSource",
    "WeightResolver",
    "unloaded_targets",
    "tensor_attributes",
    "record_weight_view",
    "record_forward_constant",
    "forward_constants",
    "FORWARD_CONSTANTS_KEY",
    "WEIGHT_VIEWS_KEY",
    "TRACE_DEVICE_KEY",
    "TensorBinding",
    "record_tensor_binding",
    "tensor_bindings",
    "with_checkpoint",
    "TENSOR_BINDINGS_KEY",
]
