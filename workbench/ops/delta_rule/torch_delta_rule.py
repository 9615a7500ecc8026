"""``workbench::torch_gated_delta_rule`` / ``torch_delta_rule`` and their cached forms (cached-state kit ops).

::

    q/k [b, s, hk, dk], v [b, s, h, dv] (h % hk == 0: value head j reads q/k head j // (h // hk))
    g [b, s, h]        log decay per token and value head, <= 0 (gated variant only)
    beta [b, s, h]     the delta rule's learning rate, usually sigmoid(...) in (0, 1)
    -> o [b, s, h, dv] in q's dtype

Every sequence starts from a zero state; the recurrence is in ``delta_rule_math`` (computed in
fp32). Options: ``scale`` multiplies q (None: ``dk ** -0.5``, what Qwen3-Next and FLA use),
``use_qk_l2norm`` L2-normalises q and k first (eps 1e-6, in fp32, as FLA's
``use_qk_l2norm_in_kernel``), ``chunk_size`` is the chunked form's block length (a speed knob:
every value gives the recurrence's result to fp32 round-off).

These are what the canonical export-time forwards (``workbench.models.canonical.delta_rule``)
call; the cache stage rewrites them into ``torch_cached_*`` / ``triton_cached_*`` (``ops/recurrent.py``),
which keep the fast-weight matrix ``state [num_slots, h, dk, dv]`` in fp32 whatever the model
dtype (it accumulates over the whole sequence; FLA and HF keep it in fp32 too). Prefill sequences
run the chunked form, decode rows one vectorised recurrence step (the Triton kernel, shared with
linear attention, in ``triton_delta_rule.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..recurrent import Inputs, Options, RecurrentMath, RecurrentOp, RecurrentState, define_recurrent_op
from . import triton_delta_rule
from .delta_rule_math import check_delta_rule_args, chunked_delta_rule, delta_rule_step, prepare


def _check(i: Inputs, options: Options) -> None:
    check_delta_rule_args(i["q"], i["k"], i["v"], i.get("g"), i["beta"], options["chunk_size"])


def _prepared(i: Inputs, options: Options):
    """fp32, heads first ``[b, h, s, d]`` (``delta_rule_math.prepare``)."""
    return prepare(i["q"], i["k"], i["v"], i.get("g"), i["beta"], options["scale"], options["use_qk_l2norm"])


def _run(i: Inputs, init: Optional[torch.Tensor], options: Options):
    """Whole sequences from ``init [b, h, dk, dv]`` (None: zeros): the chunked form."""
    q, k, v, g, beta = _prepared(i, options)
    state = v.new_zeros(v.shape[0], v.shape[1], k.shape[-1], v.shape[-1]) if init is None else init.float()
    out, final = chunked_delta_rule(q, k, v, g, beta, state, options["chunk_size"])
    return out.transpose(1, 2), final  # [b, s, h, dv]


def _step(i: Inputs, held: torch.Tensor, fresh: torch.Tensor, options: Options):
    """One token per row (``q [n, hk, dk]``, ...) from ``held [n, h, dk, dv]``."""
    rows = _prepared({name: None if t is None else t[None] for name, t in i.items()}, options)  # [1, h, n, ...]
    q, k, v, g, beta = (None if t is None else t[0].transpose(0, 1) for t in rows)  # [n, h, ...]
    return delta_rule_step(q, k, v, g, beta, held.float())


def output_like(i: Inputs) -> torch.Tensor:
    """An empty output: v's shape (per-token value heads), q's dtype."""
    return i["v"].new_empty(i["v"].shape, dtype=i["q"].dtype)


def state_shape(args) -> tuple:
    """Per-sequence state of a fast-weight node: ``(value_heads, dk, dv)`` from q and v."""
    return (int(args["v"].shape[2]), int(args["q"].shape[3]), int(args["v"].shape[3]))


def fast_weight_state(name: str, description: str) -> RecurrentState:
    """The fast-weight matrix ``S [value_heads, dk, dv]`` per sequence, in fp32 whatever the model
    dtype (it accumulates over the whole sequence): the delta rules' and linear attention's state."""
    return RecurrentState(
        name, shape=state_shape, dtype=torch.float32, layout="value_heads, dk, dv", description=description
    )


OPTIONS = "float? scale=None, bool use_qk_l2norm=False, int chunk_size=64"


def _delta_rule(name: str, inputs: str, state: RecurrentState) -> RecurrentOp:
    return RecurrentOp(
        name=name,
        inputs=inputs,
        options=OPTIONS,
        state=state,
        token_args=tuple(n.split()[-1] for n in inputs.split(",")),
        insert_key=f"insert_cached_{name}",
        math=RecurrentMath(check=_check, run=_run, step=_step),
        triton_decode=triton_delta_rule.decode,
        output_like=output_like,
    )


GATED_DELTA_RULE = define_recurrent_op(
    _delta_rule(
        "gated_delta_rule",
        "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta",
        fast_weight_state(
            "gated_delta_state",
            "fast-weight matrix S [value_heads, dk, dv] per sequence (fp32), decayed by exp(g) each token",
        ),
    )
)
DELTA_RULE = define_recurrent_op(
    _delta_rule(
        "delta_rule",
        "Tensor q, Tensor k, Tensor v, Tensor beta",
        fast_weight_state("delta_state", "fast-weight matrix S [value_heads, dk, dv] per sequence (fp32)"),
    )
)

__all__ = ["GATED_DELTA_RULE", "DELTA_RULE", "OPTIONS", "fast_weight_state", "output_like", "state_shape"]
