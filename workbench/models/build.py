"""Build a random-weight HF causal LM from a config: meta device first, then materialise.

Why meta: constructing a model normally allocates every weight and runs torch's default
init, then transformers' ``post_init`` re-initialises everything again. Under
``torch.device("meta")`` construction allocates nothing (and ``post_init`` skips init on
meta in transformers 5), so memory is allocated exactly once, on the target device.

Why not plain ``Module.to_empty``: it *unties* shared parameters (each module that holds
the tied embedding gets its own fresh tensor: ``lm_head.weight is embed_tokens.weight``
becomes False), which allocates the tied matrix twice and changes init results (HF's
normal build initialises the shared tensor twice, the last writer - lm_head - wins).
:func:`to_empty_keep_ties` allocates each distinct parameter/buffer once and re-installs
the same object everywhere it was shared.

Why re-running init works (transformers 5.x): ``PreTrainedModel.initialize_weights()``
walks the module tree (``smart_apply``) calling ``_init_weights`` on every module not
flagged ``_is_hf_initialized``. ``_init_weights`` covers Linear/Embedding/norms, the
stacked MoE expert tensors and routers (model-specific overrides), *and* recomputes the
rotary ``inv_freq`` / ``original_inv_freq`` buffers from the config - so the garbage
left in non-persistent buffers is overwritten too. ``tie_weights()`` is re-run afterwards
(a no-op when the ties survived, a safety net otherwise). We poison
all floating tensors with NaN before init and fail loudly if any survives, so a future
transformers change that skips a tensor cannot silently hand out garbage weights.

Seeding: init runs under ``torch.random.fork_rng`` + ``torch.manual_seed(seed)``, so the
result is bit-identical for a given (config, seed, device) and the caller's global RNG
state is untouched. Init always runs in float32; lower-precision dtypes are then made by
casting the parameters, so ``dtype=bf16`` gives the fp32 weights rounded (handy for
numerics comparisons). Buffers stay as the modeling code made them (RoPE ``inv_freq``
is float32), matching ``from_config(dtype=...)``. The cost: a bf16 request first
allocates the fp32 weights, then each is replaced by its cast (peak ~ fp32 size; fine
for tiny configs, and still no tensor is allocated twice in the same dtype).
"""

from __future__ import annotations

import copy
from typing import Any, MutableMapping, Tuple

import torch


def auto_class_for(config):
    """``AutoModelForCausalLM``, or ``AutoModelForImageTextToText`` for a vision-language config that has no
    causal-LM class of its own (Qwen2.5-VL): the workbench exports and runs its text stack only."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM, AutoModelForImageTextToText

    # the mapping object itself (not the static name table) also holds classes registered at run time
    return AutoModelForCausalLM if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING else AutoModelForImageTextToText


def build_on_meta(config) -> torch.nn.Module:
    """Instantiate the model class for ``config`` (``auto_class_for``) on the meta device (no storage)."""
    with torch.device("meta"):
        return auto_class_for(config).from_config(config, dtype=torch.float32)


def _fork_rng(device: torch.device):
    if device.type == "cpu" or device.type == "meta":
        return torch.random.fork_rng(devices=[])
    backend = getattr(torch, device.type)
    return torch.random.fork_rng(devices=list(range(backend.device_count())), device_type=device.type)


def _floating_tensors(model: torch.nn.Module):
    yield from (t for t in model.parameters() if t.is_floating_point())
    yield from (t for t in model.buffers() if t.is_floating_point())


@torch.no_grad()
def to_empty_keep_ties(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Like ``model.to_empty(device=device)`` but shared tensors stay shared (allocated once)."""
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in model.modules():
        tables: Tuple[MutableMapping[str, Any], ...] = (module._parameters, module._buffers)
        for table in tables:
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in memo:  # keep `t` alive in memo so its id cannot be reused
                    new = torch.empty_like(t, device=device)
                    if isinstance(t, torch.nn.Parameter):
                        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                    memo[id(t)] = (t, new)
                table[name] = memo[id(t)][1]
    return model


@torch.no_grad()
def _init_conv1d_left(model: torch.nn.Module) -> None:
    """HF's ``Conv1D`` (GPT-2 style transposed linear) initialises itself in its constructor, which
    the meta build skips; GPT-2's ``_init_weights`` covers it, OpenAI GPT's does not. Those left
    poisoned get what the constructor gives: normal(0, 0.02) weights, zero bias (the same
    distribution; not the same draws, which the constructor takes from the RNG mid-construction)."""
    from transformers.pytorch_utils import Conv1D

    for module in model.modules():
        if isinstance(module, Conv1D) and torch.isnan(module.weight).any():
            module.weight.normal_(0.0, 0.02)
            if module.bias is not None:
                module.bias.zero_()


@torch.no_grad()
def materialise(model: torch.nn.Module, device: torch.device, seed: int) -> torch.nn.Module:
    """Allocate ``model``'s meta tensors on ``device`` and initialise them deterministically."""
    to_empty_keep_ties(model, device)
    for t in _floating_tensors(model):
        t.fill_(float("nan"))  # poison, see module docstring
    with _fork_rng(device):
        torch.manual_seed(seed)
        model.initialize_weights()  # type: ignore[operator]  # nn.Module's __getattr__ stub: an HF model's method
        _init_conv1d_left(model)
    model.tie_weights()  # type: ignore[operator]  # (same)
    if device.type != "meta":
        bad = _uninitialised(model)
        if bad:
            _from_constructor(model, bad, device, seed)
            bad = _uninitialised(model)
        if bad:
            raise RuntimeError(f"weight init left these tensors uninitialised (transformers change?): {bad}")
    return model


def _uninitialised(model: torch.nn.Module) -> list:
    return [
        n
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if t.is_floating_point() and not torch.isfinite(t).all()
    ]


@torch.no_grad()
def _from_constructor(model: torch.nn.Module, names: list, device: torch.device, seed: int) -> None:
    """Copy into ``names`` the values the modules' own constructors give them.

    Some modules set constants in ``__init__`` that no ``_init_weights`` covers (Apertus' xIELU
    activation: ``alpha_p``, ``alpha_n``, ``beta``, ``eps`` as parameters): after the meta build they
    hold the poison. The model is built once more the ordinary way (constructors run on ``device``,
    seeded) and those tensors are taken from it; a tensor the constructor leaves non-finite too stays
    bad and is reported. Costs a second build, for such families only."""
    with _fork_rng(device), torch.device(device):
        torch.manual_seed(seed)
        ref = type(model)(model.config)
    values = dict([*ref.named_parameters(), *ref.named_buffers()])
    mine = dict([*model.named_parameters(), *model.named_buffers()])
    for name in names:
        if name in values and values[name].shape == mine[name].shape:
            mine[name].copy_(values[name])


@torch.no_grad()
def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast floating *parameters* (not buffers) to ``dtype``, preserving shared/tied ones."""
    memo: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            # Keys are ids of original params, all alive when the loop starts, so a freed
            # original's id cannot collide with one looked up later (no need to pin them).
            if id(p) not in memo:
                memo[id(p)] = torch.nn.Parameter(p.to(dtype), requires_grad=p.requires_grad)
            module._parameters[name] = memo[id(p)]
    model.config.dtype = dtype
    return model


@torch.no_grad()
def meta_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers live on ``meta``: same classes, names,
    config and ties, no storage.

    This is what ``export_to_gm`` traces, so the graph never depends on where the weights are
    (nor costs a copy of them): ``copy.deepcopy`` with a memo that maps every parameter and buffer
    to its meta counterpart copies the module tree and its Python state but no tensor data. Two
    names that held one tensor (tied embeddings) get one meta tensor, so the tie survives. Tensors
    held as plain attributes (not registered) are small by nature and deep-copied as they are.
    """
    memo: dict = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for t in table.values():
                if t is None or id(t) in memo:
                    continue
                twin = t.detach().to("meta")
                if isinstance(t, torch.nn.Parameter):
                    twin = torch.nn.Parameter(twin, requires_grad=False)
                memo[id(t)] = twin
    return copy.deepcopy(model, memo)


def build_random_model(config, dtype: torch.dtype, device: torch.device | str, seed: int) -> torch.nn.Module:
    """Meta-build ``config``, materialise on ``device`` with ``seed``, cast to ``dtype``."""
    device = torch.device(device)
    model = materialise(build_on_meta(config), device, seed)
    if dtype != torch.float32:
        cast_parameters(model, dtype)
    return model


__all__ = ["build_on_meta", "meta_twin", "to_empty_keep_ties", "materialise", "cast_parameters", "build_random_model"]
