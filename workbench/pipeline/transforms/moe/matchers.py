"""Mixture-of-experts patterns (stage ``pattern_matcher``).

* ``match_moe_pattern``: HF transformers>=5 stacked experts -> ``torch_moe_fused`` (gpt-oss's biased,
  transposed, interleaved clamped-SwiGLU experts too: ``biased_experts.py``); Mixtral's classic
  loop over ``nn.Linear`` experts (``one_hot`` mask, ``torch.where``, ``index_add_``) ->
  ``torch_moe`` (``expert_loop.py``). Export spells the
  experts' forward by ``config._experts_implementation``: ``grouped_mm`` (sort tokens by expert,
  ``transformers::grouped_mm_fallback`` twice, un-permute, sum over top-k) or ``batched_mm``
  (gather each token's expert weights, ``bmm``). ``eager`` loops over the experts that received
  tokens, a data-dependent loop that does not export at all.
* ``match_bmm_moe_pattern``: Llama-4 style, routing applied to the *input* of all-expert BMMs ->
  ``torch_moe_dense_mlp(..., apply_routing_on_input=True)``.
* ``match_dense_moe_pattern``: the dense all-experts BMM form weighted on the output ->
  ``torch_moe_dense_mlp``. No causal LM in transformers 5.x spells its MoE this way (their experts
  use the experts interface above, loop over the hit experts, or are Llama-4's input-weighted BMMs).
* ``split_moe_fused_for_sharding``: ``torch_moe_fused`` -> ``torch_moe`` with per-expert weight
  lists (views of the stacked parameters, no copies), the form sharding splits.
* ``match_moe_routing_pattern``: softmax -> top-k -> renormalize -> one routing op.

The router (gate linear, softmax, top-k) stays outside the MoE op: the op takes the selected
experts and their weights, so routing variants (renormalised or not, sigmoid, grouped) need no
new MoE op, and ``match_moe_routing_pattern`` can fuse the common router separately.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Literal, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from pydantic import Field

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ....models.quantized_checkpoint import bmm_scale_names
from ....ops.moe.torch_moe import has_expert_extras
from ...context import PipelineContext
from ...graph.utils import call_nodes, tensor_meta
from ...interface import Transform, TransformConfig, TransformInfo, register
from ...matcher import (
    Match,
    Pattern,
    PatternMatcher,
    PatternTransform,
    annotate_new_nodes,
    match_info,
    named_args,
    same_shape,
)
from ...weights import record_weight_view
from .biased_experts import EXPERT_SIZE_ARGS, biased_expert_patterns, grouped_mm_op
from .expert_loop import replace_expert_loops

aten = torch.ops.aten
wb = torch.ops.workbench

# Example sizes (and sentinels) for tracing: T tokens, H hidden, I intermediate, E experts, k top-k.
_T, _H, _I, _E, _K = 5, 8, 6, 7, 3


def _moe_examples():
    selected = torch.stack([torch.randperm(_E)[:_K] for _ in range(_T)])
    return (torch.randn(_T, _H), selected, torch.rand(_T, _K), torch.randn(_E, 2 * _I, _H), torch.randn(_E, _H, _I))


def _grouped_mm_experts(x, selected, weights, w1_w3, w2, k, sentinel: bool):
    # transformers' grouped_mm experts forward (gated, weights [E, out, in], no bias): sort the
    # (token, slot) pairs by expert, one grouped GEMM per projection, un-permute, sum over top-k.
    # ``sentinel``: as transformers 5.17 writes it, with an expert-parallel "sentinel" mask (ids >= E)
    # built and applied whether or not experts are sharded -- zeroed input rows and zeroed rows
    # after each grouped GEMM; with E experts no id reaches E, so it masks nothing. Its in-place
    # clamp of the ids is read by nothing without biases, but export keeps it (a mutation): it is
    # returned, to be a second output of the pattern rather than an outside user of the sorted ids.
    mm = grouped_mm_op()
    flat_w, flat_e = weights.reshape(-1), selected.reshape(-1)
    expert_sorted, perm = torch.sort(flat_e)
    xs, ws = x[perm // k], flat_w[perm]
    counts = torch.histc(expert_sorted.float(), bins=_E, min=0, max=_E - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    clamped = None
    if sentinel:
        mask = (expert_sorted >= _E).unsqueeze(-1)
        clamped = expert_sorted.clamp_(max=_E - 1)
        xs.masked_fill_(mask, 0.0)
    h = mm(xs.to(w1_w3.dtype), w1_w3.transpose(-2, -1), offsets)
    h = h.masked_fill(mask, 0.0) if sentinel else h
    gate, up = h.chunk(2, dim=-1)
    y = mm((F.silu(gate) * up).to(w2.dtype), w2.transpose(-2, -1), offsets)
    y = y.masked_fill(mask, 0.0) if sentinel else y
    y = y * ws.unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.size(0))
    return y[inv].view(x.shape[0], k, x.shape[-1]).sum(dim=1).to(x.dtype), clamped


def _moe_grouped_mm(x, selected, weights, w1_w3, w2, *, k):
    return _grouped_mm_experts(x, selected, weights, w1_w3, w2, k, sentinel=False)[0]


def _moe_grouped_mm_sentinel(x, selected, weights, w1_w3, w2, *, k):
    return _grouped_mm_experts(x, selected, weights, w1_w3, w2, k, sentinel=True)


def _moe_fused_replacement_2(x, selected, weights, w1_w3, w2, *, k):
    # the second output (the dead in-place clamp) has no users: any value will do
    return wb.torch_moe_fused.default(x, selected, weights, w1_w3, w2), selected


def _batched_mm_experts(x, selected, weights, w1_w3, w2, k, clamp: bool):
    # transformers' batched_mm experts forward: gather every (token, slot)'s expert weights.
    # ``clamp``: as transformers 5.17 writes it, the expert ids clamped to 0..E-1 first
    # (expert-parallel sentinels; a no-op with E local experts).
    xs = x.repeat_interleave(k, dim=0)
    flat_w, flat_e = weights.reshape(-1), selected.reshape(-1)
    if clamp:
        flat_e = flat_e.clamp(0, _E - 1)
    h = torch.bmm(w1_w3[flat_e], xs.unsqueeze(-1)).squeeze(-1)
    gate, up = h.chunk(2, dim=-1)
    y = torch.bmm(w2[flat_e], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
    y = y * flat_w.unsqueeze(-1)
    return y.view(x.shape[0], k, x.shape[-1]).sum(dim=1).to(x.dtype)


def _moe_batched_mm(x, selected, weights, w1_w3, w2, *, k):
    return _batched_mm_experts(x, selected, weights, w1_w3, w2, k, clamp=False)


def _moe_batched_mm_clamped(x, selected, weights, w1_w3, w2, *, k):
    return _batched_mm_experts(x, selected, weights, w1_w3, w2, k, clamp=True)


def _moe_fused_replacement(x, selected, weights, w1_w3, w2, *, k):
    return wb.torch_moe_fused.default(x, selected, weights, w1_w3, w2)


def _moe_check(m: Match) -> Optional[Dict[str, Any]]:
    """Shapes agree with a gated MoE: x [T, H], selected/weights [T, k], w1_w3 [E, 2I, H],
    w2 [E, H, I]; histc counts exactly the E experts; the final view is [T, k, H]."""
    x, sel, w = m.val("x"), m.val("selected"), m.val("weights")
    w13, w2 = m.val("w1_w3"), m.val("w2")
    if any(t is None for t in (x, sel, w, w13, w2)) or x.dim() != 2 or sel.dim() != 2:
        return None
    n_exp, two_i, hidden = w13.shape
    if sel.shape[-1] != m.literals["k"] or tuple(w2.shape) != (n_exp, hidden, two_i // 2):
        return None
    if sel.dtype.is_floating_point or not same_shape(w.shape, sel.shape):
        return None
    for h in m.matched(aten.histc.default):
        if tuple(h.args[1:4]) != (n_exp, 0, n_exp - 1):
            return None
    for ge in m.matched(aten.ge.Scalar):  # the sentinel test: ids >= E
        if ge.args[1] != n_exp:
            return None
    for c in m.matched(aten.clamp.default):  # the sentinel clamp: ids into 0..E-1
        if tuple(c.args[1:3]) != (0, n_exp - 1):
            return None
    for v in m.matched(aten.view.default):
        out = tensor_meta(v)
        if out is None or out.dim() != 3 or out.shape[1] != m.literals["k"]:
            return None
    return {}


# the experts' size arguments, and the batched form's clamp bound (a size in the unbiased spelling)
_IGNORE_SHAPES = (*EXPERT_SIZE_ARGS, (aten.clamp.default, "max"))


def moe_patterns() -> List[Pattern]:
    """The stacked-experts MoE patterns usable with the installed transformers."""
    forms = []
    if grouped_mm_op() is not None:
        forms += [
            ("moe_grouped_mm", _moe_grouped_mm, _moe_fused_replacement),
            ("moe_grouped_mm_sentinel", _moe_grouped_mm_sentinel, _moe_fused_replacement_2),
        ]
    forms += [
        ("moe_batched_mm", _moe_batched_mm, _moe_fused_replacement),
        ("moe_batched_mm_clamped", _moe_batched_mm_clamped, _moe_fused_replacement),
    ]
    return [
        Pattern(
            name,
            search,
            replace,
            _moe_examples,
            literals={"k": _K},
            ignore=_IGNORE_SHAPES,
            check=_moe_check,
            inputs=("x", "selected", "weights", "w1_w3", "w2"),
        )
        for name, search, replace in forms
    ]


@functools.lru_cache(maxsize=None)
def _stacked_expert_patterns(with_grouped_mm: bool) -> Tuple[Pattern, ...]:
    # One tuple per availability of transformers' grouped_mm op (tracing happens lazily, on first
    # use, and is kept with the tuple). gpt-oss's biased, transposed, clamped-SwiGLU experts
    # (biased_experts.py) reach the same op with its bias / activation options.
    assert with_grouped_mm == (grouped_mm_op() is not None)
    return tuple(moe_patterns()) + tuple(biased_expert_patterns())


@register("match_moe_pattern")
class MatchMoePattern(PatternTransform):
    """Replace transformers' stacked-experts MoE (grouped_mm / batched_mm; plain or gpt-oss's biased,
    clamped-SwiGLU experts) by ``torch_moe_fused``, and an unrolled loop over experts by ``torch_moe``."""

    def active_patterns(self) -> Sequence[Pattern]:
        # the grouped_mm forms only once transformers' MoE integration is loaded (grouped_mm_op)
        return _stacked_expert_patterns(grouped_mm_op() is not None)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        counts = PatternMatcher(self.active_patterns()).apply(gm)
        if any(n.target is aten.index_add_.default for n in gm.graph.nodes):  # an unrolled expert loop?
            counts["moe_expert_loop"] = replace_expert_loops(gm)
        return match_info(gm, counts)


# ------------------------------------------------------------------------------ dense / BMM forms


def _dense_examples():
    return (torch.randn(_T, _H), torch.rand(_T, _E), torch.randn(_E, _H, 2 * _I), torch.randn(_E, _I, _H))


def _halves(h, up_first: bool):
    # (gate, up) of the stacked projection's output: HF writes ``gate, up = h.chunk(2)``; other
    # model code stores the up rows first (``up, gate = h.chunk(2)``).
    first, second = h.chunk(2, dim=-1)
    return (second, first) if up_first else (first, second)


def _bmm_moe_routed_input(up_first: bool):
    def search(x, scores, gate_up, down):
        # Llama-4 TextMoe + TextExperts: every expert sees every token, pre-scaled by its score.
        n_exp = gate_up.shape[0]
        routed = x.repeat(n_exp, 1) * scores.transpose(0, 1).reshape(-1, 1)
        h = torch.bmm(routed.view(n_exp, -1, x.shape[-1]), gate_up)
        gate, up = _halves(h, up_first)
        y = torch.bmm(up * F.silu(gate), down).view(-1, x.shape[-1])
        return y.reshape(n_exp, -1, x.shape[-1]).sum(dim=0)

    return search


def _dense_moe(up_first: bool):
    def search(x, scores, gate_up, down):
        # The dense all-experts form weighted on the output (e.g. older gpt-oss CPU experts).
        n_exp = gate_up.shape[0]
        h = torch.bmm(x.repeat(n_exp, 1).view(n_exp, -1, x.shape[-1]), gate_up)
        gate, up = _halves(h, up_first)
        y = torch.bmm(F.silu(gate) * up, down)
        y = y * scores.transpose(0, 1).reshape(n_exp, -1)[..., None]
        return y.sum(dim=0)

    return search


def _dense_replacement(on_input: bool, up_first: bool):
    def replacement(x, scores, gate_up, down):
        # Weights are stored [E, in, out]; the op takes nn.Linear layout [E, out, in] (views).
        w13 = aten.transpose.int(gate_up, 1, 2)
        w2 = aten.transpose.int(down, 1, 2)
        flags = {"up_first": True} if up_first else {}
        return wb.torch_moe_dense_mlp.default(x, scores, w13, w2, apply_routing_on_input=on_input, **flags)

    return replacement


def _dense_check(m: Match) -> Optional[Dict[str, Any]]:
    """x [T, H], scores [T, E], gate_up [E, H, 2I], down [E, I, H]; reshapes split/merge E."""
    x, s, gu, dn = (m.val(n) for n in ("x", "scores", "gate_up", "down"))
    if any(t is None for t in (x, s, gu, dn)) or x.dim() != 2 or s.dim() != 2 or gu.dim() != 3:
        return None
    n_exp, hidden, two_i = gu.shape
    if s.shape[-1] != n_exp or tuple(dn.shape) != (n_exp, two_i // 2, hidden):
        return None
    for r in m.matched(aten.repeat.default):
        if list(r.args[1]) != [n_exp, 1]:
            return None
    for v in m.matched(aten.view.default) + m.matched(aten.reshape.default):
        out = tensor_meta(v)
        if out is None or (out.dim() == 3 and out.shape[0] != n_exp):
            return None
    return {}


_DENSE_IGNORE = ((aten.repeat.default, "repeats"), (aten.view.default, "size"), (aten.reshape.default, "shape"))


def _dense_patterns(name: str, search_of, on_input: bool) -> Tuple[Pattern, ...]:
    """The patterns of one dense form, in either order of the gate and up halves."""
    return tuple(
        Pattern(
            f"{name}{'_up_first' if up_first else ''}",
            search_of(up_first),
            _dense_replacement(on_input, up_first),
            _dense_examples,
            ignore=_DENSE_IGNORE,
            check=_dense_check,
        )
        for up_first in (False, True)
    )


BMM_MOE_PATTERNS = _dense_patterns("bmm_moe_routed_input", _bmm_moe_routed_input, on_input=True)
DENSE_MOE_PATTERNS = _dense_patterns("dense_moe", _dense_moe, on_input=False)


def fp8_bmm_weights(gm: fx.GraphModule, ctx: PipelineContext) -> Set[str]:
    """Graph targets of the stacked weights the checkpoint stores in FP8 for ``bmm`` (``p`` in
    float8_e4m3fn with ``p_weight_scale`` / ``p_input_scale``: ModelOpt's Llama-4 experts)."""
    ck = getattr(ctx, "checkpoint", None)
    if ck is None:
        return set()
    out = set()
    for bmm in call_nodes(gm, aten.bmm.default):
        node = bmm.args[1]
        if not isinstance(node, fx.Node) or node.op != "get_attr":
            continue
        name = ck.checkpoint_name(str(node.target))
        w = ck.tensors.get(name)
        if w is not None and w.dtype == torch.float8_e4m3fn and all(s in ck for s in bmm_scale_names(name)):
            out.add(str(node.target))
    return out


def _not_reading(targets: Set[str], check):
    def guarded(m: Match) -> Optional[Dict[str, Any]]:
        for name in ("gate_up", "down"):
            node = m.inputs.get(name)
            if isinstance(node, fx.Node) and node.op == "get_attr" and str(node.target) in targets:
                return None
        return check(m) if check is not None else {}

    return guarded


@register("match_bmm_moe_pattern")
class MatchBmmMoePattern(PatternTransform):
    """Replace Llama-4 style BMM MoE (routing scales the input) by ``torch_moe_dense_mlp``.

    Experts an FP8 checkpoint stores in fp8 (with per-tensor scales) stay BMMs: the dense MoE op
    has no FP8 form, and ``quantize_fp8_bmm_from_config`` turns those BMMs into ``torch_fp8_bmm``
    (``details["left_fp8"]`` names them)."""

    patterns = BMM_MOE_PATTERNS

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        fp8 = fp8_bmm_weights(gm, ctx)
        if not fp8:
            return super()._apply(gm, ctx)
        patterns = [dataclasses.replace(p, check=_not_reading(fp8, p.check)) for p in self.patterns]
        return match_info(gm, PatternMatcher(patterns).apply(gm), left_fp8=sorted(fp8))


@register("match_dense_moe_pattern")
class MatchDenseMoePattern(PatternTransform):
    """Replace the dense all-experts BMM MoE (weighted on the output) by ``torch_moe_dense_mlp``."""

    patterns = DENSE_MOE_PATTERNS


# ------------------------------------------------------------------------------ split for sharding


def _get_param(gm: fx.GraphModule, node: Any) -> Optional[torch.Tensor]:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        try:
            return gm.get_parameter(node.target)
        except AttributeError:
            try:
                return gm.get_buffer(node.target)
            except AttributeError:
                return None
    return None


def _expert_views(gm, node: fx.Node, name: str, stacked: torch.Tensor, index: Tuple[Any, ...]) -> List[fx.Node]:
    """Register ``stacked[e][index]`` for every expert ``e`` next to the stacked parameter ``node``
    (views: no copy) and return their get_attr nodes. Each view is recorded as derived from the
    stacked tensor, so ``load_weights`` rebuilds it as a view of the real weights when the graph
    was traced on meta."""
    owner_path, _, attr = node.target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    nodes = []
    for e in range(stacked.shape[0]):
        leaf = f"{attr}_{name}_{e}"
        target = f"{owner_path}.{leaf}" if owner_path else leaf
        if not hasattr(owner, leaf):
            owner.register_parameter(leaf, torch.nn.Parameter(stacked[e][index], requires_grad=False))
            record_weight_view(gm, target, node.target, (e, *index))
        nodes.append(gm.graph.get_attr(target))
    return nodes


@register("split_moe_fused_for_sharding")
class SplitMoeFusedForSharding(Transform):
    """Convert ``torch_moe_fused`` (stacked weights) to ``torch_moe`` (per-expert lists).

    The per-expert weights are views of the stacked parameters (no memory is copied), registered
    beside them as ``<stacked>_w1_<e>`` / ``_w2_<e>`` / ``_w3_<e>``. Nodes with gpt-oss's options
    (expert biases, interleaved gate/up rows, clamped SwiGLU) stay ``torch_moe_fused``: ``torch_moe``
    has none of them; ``details["left"]`` names each with the reason.
    """

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        n, left = 0, []
        for node in call_nodes(gm, wb.torch_moe_fused.default):
            args = dict(named_args(node))
            extras = has_expert_extras(args)
            if extras:  # torch_moe's per-expert lists carry none of these
                left.append(f"{node.name}: {', '.join(extras)} (torch_moe has no such option)")
                continue
            w13, w2 = _get_param(gm, args["w1_w3_stacked"]), _get_param(gm, args["w2_stacked"])
            if w13 is None or w2 is None:
                left.append(f"{node.name}: the stacked experts are not plain parameters")
                continue
            inter = w13.shape[1] // 2
            with gm.graph.inserting_before(node):
                w1 = _expert_views(gm, args["w1_w3_stacked"], "w1", w13, (slice(None, inter),))
                w3 = _expert_views(gm, args["w1_w3_stacked"], "w3", w13, (slice(inter, None),))
                w2n = _expert_views(gm, args["w2_stacked"], "w2", w2, ())
                new = gm.graph.call_function(
                    wb.torch_moe.default,
                    (args["x"], args["selected_experts"], args["routing_weights"], w1, w2n, w3),
                    {"act_fn": args["act_fn"]} if args["act_fn"] != "silu" else {},
                )
            mode: Any = getattr(tensor_meta(args["x"]), "fake_mode", None)
            for p in (w1 + w3 + w2n) if mode is not None else ():
                p.meta["val"] = mode.from_tensor(gm.get_parameter(p.target), static_shapes=True)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            annotate_new_nodes(gm, [new], [node.name], anchor=node)
            n += 1
        return match_info(gm, {"split_moe": n}, **({"left": left} if left else {}))


# ------------------------------------------------------------------------------ routing


def _routing(softmax_cast: str, renorm: str):
    """softmax (fp32 via a cast or softmax's dtype) -> top-k -> renormalise (in place, out of place,
    or not at all) -> (weights, indices)."""

    def search(logits, *, k):
        if softmax_cast == "cast":
            probs = F.softmax(logits.to(torch.float32), dim=-1)
        else:
            probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, indices = torch.topk(probs, k, dim=-1)
        if renorm == "inplace":
            weights /= weights.sum(dim=-1, keepdim=True)
        elif renorm == "div":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, indices

    return search


class MatchMoeRoutingPatternConfig(TransformConfig):
    backend: Literal["torch", "triton"] = Field(
        default="torch",
        description="Op to emit: 'torch' (torch_moe_topk_softmax, the canonical reference) or "
        "'triton' (triton_moe_topk_softmax: the fused Triton kernel where it can run, CUDA or "
        "TRITON_INTERPRET=1, else the same torch code).",
    )


def _routing_patterns(backend: str) -> List[Pattern]:
    op = wb.triton_moe_topk_softmax.default if backend == "triton" else wb.torch_moe_topk_softmax.default
    out = []
    for renorm in ("inplace", "div", "none"):
        for cast in ("cast", "dtype"):

            def replacement(logits, *, k, _renorm=renorm != "none"):
                res = op(logits, k, _renorm)
                return res[0], res[1]

            out.append(
                Pattern(
                    f"routing_{cast}_{renorm}_{backend}",
                    _routing(cast, renorm),
                    replacement,
                    lambda: (torch.randn(_T, _E),),
                    literals={"k": _K},
                    ignore=((aten.to.dtype, "dtype"),) if cast == "cast" else (),
                    check=_routing_check(cast),
                )
            )
    return out


def _routing_check(cast: str):
    def check(m: Match) -> Optional[Dict[str, Any]]:
        logits = m.val("logits")
        if logits is None or not logits.dtype.is_floating_point:
            return None
        if cast == "cast" and any(c.args[1] != torch.float32 for c in m.matched(aten.to.dtype)):
            return None
        return {}

    return check


ROUTING_PATTERNS = {b: tuple(_routing_patterns(b)) for b in ("torch", "triton")}


@register("match_moe_routing_pattern")
class MatchMoeRoutingPattern(Transform[MatchMoeRoutingPatternConfig]):
    """Replace softmax -> top-k -> renormalize by one routing op (torch reference or Triton)."""

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        return match_info(gm, PatternMatcher(ROUTING_PATTERNS[self.config.backend]).apply(gm))


__all__ = ["BMM_MOE_PATTERNS", "DENSE_MOE_PATTERNS", "ROUTING_PATTERNS"]
