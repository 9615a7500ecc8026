"""Why greedy tokens differ from HF's: a near-tie, HF's own cache, workbench's cache or its graph.

Token-for-token equality with HF ``generate`` is the check's oracle, but a difference alone does not
say whose it is. At the first step where the tokens differ (same prompt, same tokens before it), four
predictions of the next token are compared:

* HF ``generate``'s token (HF's cached decode) and HF's uncached forward over prompt + prefix
  (``use_cache=False``, one pass): when these two disagree, HF's cache path changes HF's own answer
  -- the oracle is not reproducible there (DSA's top-k indexer breaking ties between keys of equal
  score one way in a one-row decode and another in a full-sequence pass does exactly this);
* workbench's cached token (``generate``) and its own single-pass prefill of the same prefix (the
  graph on scratch caches, ``Workbench.forward``): when these disagree, workbench's cache does not
  carry the past correctly -- a cache bug;
* otherwise both sides are self-consistent and their forwards disagree: a near-tie when HF's top two
  logits lie closer together than workbench's logits lie from HF's and that distance is rounding
  (``ROUNDING`` of the logits' spread): rounding decides the argmax; else the graph computes
  something else than HF's model.

``explain_divergence`` returns the ``Divergence`` of one prompt; ``Divergence.line`` is the one-line
verdict ``workbench check`` prints after "tokens differ".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Literal, Optional, Sequence, Tuple

import torch

Verdict = Literal["hf cache", "workbench cache", "near-tie", "graph"]

#: The most workbench's logits may lie from HF's, relative to the spread (std) of HF's logits, for a
#: difference to count as rounding (bf16 logits of a real model lie ~1e-3 of their spread from fp32;
#: a wrong graph lies a good part of it away).
ROUNDING = 1e-2


@dataclass(frozen=True)
class Divergence:
    """The first differing step of one prompt's continuation, and whose difference it is."""

    prompt: int  # index of the prompt
    step: int  # index of the first differing new token
    ours: int  # workbench's cached token there
    hf: int  # HF generate's token there
    hf_forward: int  # HF's uncached one-pass forward's top token
    graph: int  # workbench's graph's one-pass prefill's top token
    hf_margin: float  # HF's forward: top logit minus the runner-up's
    graph_distance: float  # max |graph logits - HF forward logits| at that step
    verdict: Verdict

    @property
    def line(self) -> str:
        where = f"prompt {self.prompt + 1}, new token {self.step}"
        if self.verdict == "hf cache":
            return (
                f"HF's own cache changes its answer ({where}): HF generate gives {self.hf}, HF's uncached forward "
                f"{self.hf_forward}, workbench {self.ours} (its prefill {self.graph}); the HF oracle is not "
                "reproducible here"
            )
        if self.verdict == "workbench cache":
            return (
                f"workbench's cache does not carry the past ({where}): its cached decode gives {self.ours}, its own "
                f"prefill of the same tokens {self.graph}, HF {self.hf}"
            )
        if self.verdict == "near-tie":
            return (
                f"near-tie ({where}): HF's top two logits are {self.hf_margin:.2e} apart, less than workbench's "
                f"logits lie from HF's ({self.graph_distance:.2e}); workbench gives {self.ours}, HF {self.hf}"
            )
        return (
            f"the graph computes something else ({where}): HF's top two logits are {self.hf_margin:.2e} apart and "
            f"workbench's logits lie {self.graph_distance:.2e} from HF's; workbench gives {self.ours}, HF {self.hf}"
        )


def first_difference(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]]) -> Optional[Tuple[int, int]]:
    """``(prompt index, step)`` of the first continuation that differs and its first differing token
    (the shorter one's length when one is a prefix of the other); None when every compared
    continuation is equal."""
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = list(g), list(w)
        if g != w:
            return i, next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
    return None


def classify(
    ours: int, hf: int, hf_logits: torch.Tensor, graph_logits: torch.Tensor
) -> tuple[Verdict, int, int, float, float]:
    """``(verdict, hf_forward, graph, hf_margin, graph_distance)`` from the last-position logits [V]
    of HF's uncached forward and workbench's one-pass prefill (see the module docstring)."""
    hf_logits, graph_logits = hf_logits.float(), graph_logits.float()
    top2 = hf_logits.topk(2).values
    margin = float(top2[0] - top2[1])
    distance = float((graph_logits - hf_logits).abs().max())
    hf_forward, graph = int(hf_logits.argmax()), int(graph_logits.argmax())
    if hf_forward != hf:
        verdict: Verdict = "hf cache"
    elif graph != ours:
        verdict = "workbench cache"
    elif margin <= 2 * distance and distance <= ROUNDING * float(hf_logits.std()):
        verdict = "near-tie"
    else:
        verdict = "graph"
    return verdict, hf_forward, graph, margin, distance


def explain_divergence(
    wb: Any,
    hf_model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    got: Sequence[Sequence[int]],
    want: Sequence[Sequence[int]],
) -> Optional[Divergence]:
    """The ``Divergence`` at the first differing token of ``got`` (workbench's continuations of
    ``prompts``) against ``want`` (HF generate's); None when they are equal. ``wb``: the finished
    ``Workbench`` that generated ``got``; ``hf_model``: the eager HF model ``want`` came from."""
    first = first_difference(got, want)
    if first is None or first[1] >= min(len(got[first[0]]), len(want[first[0]])):
        return None  # equal, or a continuation that stopped early: no token to compare
    i, step = first
    prefix: List[int] = list(prompts[i]) + list(want[i][:step])  # equal on both sides up to ``step``
    device = next(hf_model.parameters()).device
    ids = torch.tensor([prefix], device=device)
    with torch.no_grad():
        hf_logits = hf_model(ids, use_cache=False).logits[0, -1]
        positions = torch.arange(len(prefix), device=device)[None]
        out = wb.forward(ids, positions)
        graph_logits = (out if isinstance(out, torch.Tensor) else out[0])[0, -1].to(hf_logits.device)
    verdict, hf_forward, graph, margin, distance = classify(got[i][step], want[i][step], hf_logits, graph_logits)
    return Divergence(i, step, got[i][step], want[i][step], hf_forward, graph, margin, distance, verdict)
