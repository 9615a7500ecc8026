"""Decode tokens/s: HF eager, HF static cache + torch.compile, llama.cpp and the workbench backends.

    .venv/bin/python bench/decode.py                       # smollm2 fp32 on CPU, batch 1 8 32
    .venv/bin/python bench/decode.py --batch-sizes 1 --no-hf-compile
    python bench/decode.py --device cuda --dtype bfloat16 --model shape:smollm2   # GPU, random weights
    python bench/decode.py --device cuda --dtype bfloat16 --model shape:llama3-8b --batch-sizes 1
    python bench/decode.py --model shape:smollm2 --no-hf-eager --no-hf-compile --no-hf-graph-loop \\
        --no-llama-cpp --backends auto                     # the workbench rows only

Output: every row is printed (flushed) the moment it is measured, one fixed-width line
``row <name> bs <B> <tok/s> tok/s  <note>`` ("-" where nothing was measured: a skipped or failed
row), so a run killed at any moment shows every row it measured. The summary table with the ratios
follows once all rows are in; a ratio whose peer did not run prints "-".

HF peers, each switched off by its flag: eager ``generate`` (``--no-hf-eager``); ``generate`` with a
static cache and HF's own compile of the decode step (``--no-hf-compile``); HF's model in our own
greedy loop, one ``torch.compile(mode="reduce-overhead")`` decode step per token (CUDA graphs;
``--hf-graph-loop/--no-hf-graph-loop``, default on with CUDA). Each compiled row's note says whether
Inductor skipped CUDA graphs. llama.cpp rows: ``--no-llama-cpp``. With every peer off only the
workbench rows run.

Workbench rows: one per compile backend of ``--backends`` (on CUDA by default ``auto`` first, then
the explicit ones). Attention is left to the pipeline's ``auto`` (on CUDA FlashInfer where installed
and the shape fits, else Triton; on CPU the C++ kernel) unless ``--attention`` names one; each row's
note says which attention backend the pipeline chose and why, and an ``auto`` row also which compile
backend ``auto`` resolved to (CUDA graphs when the graph can be captured). Every workbench row also
gets one profiled run: the median decode step split into host time (scheduling, input preparation
and launch, sampling) and device time.

Every row runs in this one process on the same weights: B prompts of ``--prompt-len`` random tokens,
``--new-tokens`` greedy tokens each (no stop token). Decode tokens/s counts only decode steps:
for HF ``B * (new - 1) / (t(new) - t(1))`` (a generate of one token is the prefill), for the
workbench the runtime's decode-only steps. Achieved bandwidth = weight bytes read per decode step
(every parameter except an untied input embedding, of which a step reads B rows) x steps/s, shown
as a fraction of the device's copy bandwidth (``2 x bytes / t`` of a large tensor copy) and of its
GEMV bandwidth (matrix bytes / t of a large ``torch.mv``), both measured here first; llama.cpp rows
use the bytes of their GGUF file's tensors. "x best peer" compares with the fastest peer at the
benchmark's dtype (llama.cpp on the packaged 4-bit GGUF is shown but not counted).

On CPU with smollm2 the run ends with alternated bs 1 rounds (``--paired-rounds``; not with
``--no-llama-cpp``): llama.cpp and the workbench's rows (``--paired-backends``, default ``auto`` and
``torch-compile``) timed back to back, the ratio
taken within each round, then the median over rounds. This machine's memory bandwidth drifts by tens
of percent within minutes, so the table's rows, timed minutes apart, can differ by the machine's
state as much as by the engines.

``shape:<name>`` models are random weights of a real model's config (no download, no GGUF): the
GPU benchmarks use them. llama.cpp rows and the Q4_1 rows need a GGUF model (``smollm2`` only);
llama.cpp also needs ``llama-cpp-python`` (extra ``llamacpp``), the CPU and batch 1: it runs the
packaged Q4_1 file, and an F32 copy of it written once (the same weights the workbench's fp32 model
holds); otherwise its row says why it is skipped.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_peers import (float32_gguf, gguf_tensor_bytes, hf_decode_rate, hf_graph_decode_rate,  # noqa: E402
                          hf_greedy_tokens, llama_cpp_decode_rate, llama_cpp_unavailable, SHAPES)
from decode_rows import print_q4_ratios, print_table, Row, RowLog  # noqa: E402

from workbench import Workbench, load_model  # noqa: E402
from workbench.models import resolve_spec  # noqa: E402

LLAMA_CPP = "llama.cpp (llama-cpp-python)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], None], device: torch.device, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(device: torch.device, nbytes: int = 512 * 2**20) -> float:
    """Bytes/s of a large tensor copy (read + write)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = best_time(lambda: dst.copy_(src), device)
    return 2 * nbytes / t


def gemv_bandwidth(device: torch.device, dtype: torch.dtype, nbytes: int = 512 * 2**20, cols: int = 4096) -> float:
    """Matrix bytes/s of the fastest matrix-vector product on a large row-major matrix: the ceiling
    of a batch-1 decode. Two spellings are timed -- ``torch.mv`` and ``W @ [x, x].T`` (the
    two-column GEMM that ``cpu_linear_wxt`` uses, which MKL streams faster than its GEMV) -- and
    the faster one counts, so the workbench is not measured against a ceiling it beats."""
    rows = nbytes // (cols * torch.tensor([], dtype=dtype).element_size())
    w = torch.randn(rows, cols, device=device, dtype=dtype)
    x = torch.randn(cols, device=device, dtype=dtype)
    x2 = torch.stack([x, x], 1)  # [cols, 2]
    t = min(best_time(lambda: torch.mv(w, x), device), best_time(lambda: torch.mm(w, x2), device))
    return w.numel() * w.element_size() / t


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Parameter bytes a decode step reads: all but an untied input embedding (B rows of it)."""
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == emb.data_ptr()
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen or (p is emb and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def best_decode_rate(wb, prompts: List[List[int]], new: int, repeats: int) -> float:
    """Best decode tokens/s of ``repeats`` greedy generate runs (no stop token)."""
    return max(wb.generate(prompts, max_new_tokens=new, stop_token_ids=[]).stats.decode_tokens_per_s
               for _ in range(repeats))


def pipeline_choices(wb, backend: str) -> str:
    """What the pipeline chose where the bench leaves it the choice: the attention backend (its
    ``auto`` depends on the device, what is installed and every layer's shape) and, for compile
    backend ``auto``, what that resolved to (on CUDA: CUDA graphs only when the graph can be captured)."""
    # details: "backend" the name, "chosen" why ("auto on cuda: triton (passed over: flashinfer: ...)")
    attention = wb.snapshot("insert_cached_attention").info.details
    notes = [f"attention {attention['backend']} [{attention['chosen']}]" if "backend" in attention
             else f"attention not cached ({wb.snapshot('insert_cached_attention').info.skip_reason})"]
    if backend == "auto":
        compiled = wb.snapshot("compile_model").info.details
        notes.append(f"compile {compiled['backend']} [{compiled['chosen']}]")
    layout = wb.snapshot("linear_weight_layout").info.details if "linear_weight_layout" in wb.keys else {}
    if layout.get("summary"):  # on CPU: the calibrated linear choices and the times behind them
        notes.append(f"linears: {layout['summary']}")
    return "; ".join(notes)


def kernels_per_decode_step(wb, prompts: List[List[int]], device: torch.device) -> Optional[float]:
    """CUDA kernels one decode step launches (CUDA graph replays included, as the profiler sees
    them): the kernels of a 10-token generate minus those of a 2-token one, over the 8 extra decode
    steps (prefill, warm-up and the first token cancel out). None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    counts = []
    for new in (2, 10):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            wb.generate(prompts, max_new_tokens=new, stop_token_ids=[])
            torch.cuda.synchronize(device)
        device_ops = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        counts.append(sum(1 for n in device_ops if not n.startswith(("Memcpy", "Memset"))))
    return (counts[1] - counts[0]) / 8


def workbench_rates(loaded, device: torch.device, batches: List[int], prompts: Dict[int, List[List[int]]],
                    new: int, backends: List[str], repeats: int = 2, label: str = "workbench",
                    step_bytes: Optional[int] = None, peer_dtype: bool = True,
                    extra_overrides: Optional[Dict[str, object]] = None) -> Iterator[Row]:
    """One pipeline; the compile backend is switched by configure (only the compile stage re-runs).
    Best of ``repeats`` generate runs per batch size (HF rows: best of 2 as well). Yields each row
    as soon as it is measured."""
    max_b = max(batches)
    overrides = {
        "initialize_cache.max_batch_size": max_b,
        "initialize_cache.max_seq_len": len(prompts[max_b][0]) + new,
        "resize_kv_cache.cpu_budget_bytes": 4 * 2**30,
        **(extra_overrides or {}),
    }
    wb = Workbench(loaded, device=device, numerics=False, overrides=overrides)
    for backend in backends:
        name = f"{label} {backend}"
        try:
            wb.configure("compile_model", backend=backend)
            t0 = time.perf_counter()
            wb.run()
            setup, choices = time.perf_counter() - t0, pipeline_choices(wb, backend)
            for b in batches:
                wb.generate(prompts[b][:1], max_new_tokens=4, stop_token_ids=[])  # warm-up
                best = best_decode_rate(wb, prompts[b], new, repeats)
                # one more, profiled run (its synchronisations would cost the timed ones their overlap)
                prof = wb.generate(prompts[b], max_new_tokens=new, stop_token_ids=[], profile_steps=True)
                note = f"setup {setup:.0f}s; {choices}" if b == batches[0] else choices
                yield Row(name, b, best, note, step_bytes=step_bytes, peer_dtype=peer_dtype,
                          step_ms=prof.stats.decode_step_ms, kernels=kernels_per_decode_step(wb, prompts[b], device))
        except Exception as e:  # noqa: BLE001 - a failing backend is a row, not the end of the run
            yield Row(name, 0, None, f"failed: {type(e).__name__}: {str(e)[:200]}")


def hf_rows(model, prompts: Dict[int, List[List[int]]], device: torch.device,
            args: argparse.Namespace) -> Iterator[Row]:
    """The HF peers the flags leave on, each row yielded as soon as it is measured."""
    batches, new = args.batch_sizes, args.new_tokens
    if args.no_hf_eager:
        yield Row("HF generate eager", 0, None, "skipped (--no-hf-eager)")
    else:
        for b in batches:
            yield Row("HF generate eager", b, *hf_decode_rate(model, prompts[b], new, device))
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    if args.no_hf_compile:
        yield Row("HF static cache + HF compile", 0, None, "skipped (--no-hf-compile)")
    else:
        for b in batches:
            try:
                rate, note = hf_decode_rate(model, prompts[b], new, device, compile_mode=mode)
                yield Row(f"HF static cache + HF compile({mode})", b, rate, note)
            except Exception as e:  # noqa: BLE001
                yield Row(f"HF static cache + HF compile({mode})", b, None, f"failed: {str(e)[:200]}")
        torch._dynamo.reset()
    if args.hf_graph_loop or (args.hf_graph_loop is None and device.type == "cuda"):
        ref = hf_greedy_tokens(model, prompts[batches[0]][0], new, device)
        for b in batches:
            name = f"HF model, own decode loop, compile({mode})"
            try:
                rate, note = hf_graph_decode_rate(model, prompts[b], new, device, mode,
                                                  check_tokens=ref if b == batches[0] else None)
                yield Row(name, b, rate, note)
            except Exception as e:  # noqa: BLE001
                yield Row(name, b, None, f"failed: {type(e).__name__}: {str(e)[:200]}")
            torch._dynamo.reset()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, tiny:<arch> or shape:<name> (random "
                    f"weights of a real config: {', '.join(SHAPES)})")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--backends", nargs="+", default=None,
                    help="workbench compile backends, 'auto' included (default: every one this device runs; "
                    "on CUDA auto first)")
    ap.add_argument("--attention", default=None,
                    help="insert_cached_attention.backend for the workbench rows (default: the pipeline's auto)")
    ap.add_argument("--q4-activations", nargs="+", choices=["auto", "fp32", "int8"], default=["auto", "fp32", "int8"],
                    help="Q4_1 rows and rounds: linear_weight_layout.int4_activations values to run (auto: the "
                    "default, what this CPU's calibration picks; fp32: exact; int8: activations rounded per block "
                    "of 32, as llama.cpp)")
    ap.add_argument("--no-hf-eager", action="store_true", help="skip HF generate eager")
    ap.add_argument("--no-hf-compile", action="store_true", help="skip HF static cache + torch.compile")
    ap.add_argument("--hf-graph-loop", action=argparse.BooleanOptionalAction, default=None,
                    help="also time HF's model in a hand-written compiled decode loop (CUDA graphs on a GPU; "
                    "default: on with CUDA)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp rows and the alternated rounds")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--llama-cpp-lib", default=None,
                    help="a directory of llama.cpp shared libraries to load instead of llama-cpp-python's own "
                    "(LLAMA_CPP_LIB_PATH), e.g. a build for another ISA; the header prints what it uses")
    ap.add_argument("--paired-rounds", type=int, default=5,
                    help="smollm2 on CPU: rounds of llama.cpp and the workbench alternated at bs 1 "
                    "(fp32 vs F32, Q4_1 vs Q4_1); the ratios are taken per round (0: skip)")
    ap.add_argument("--paired-backends", nargs="+", default=["auto", "torch-compile"],
                    help="compile backends of the workbench rows in the alternated rounds (default: auto, "
                    "what runs by default, and torch-compile)")
    ap.add_argument("--paired-dynamo", action="store_true",
                    help="in the alternated rounds, also time fp32 and Q4_1 exact with every decode step "
                    "through Dynamo (compile_model.static_decode_batch_sizes=[]): the static graph's effect")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # the header lines too reach a log before a kill
    if args.llama_cpp_lib:  # read when llama_cpp is first imported (below, lazily)
        os.environ["LLAMA_CPP_LIB_PATH"] = str(Path(args.llama_cpp_lib).resolve())

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: CUDA is not available on this machine")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    spec, gguf = args.model, None  # gguf: the model's GGUF file, which the llama.cpp and Q4_1 rows need
    if spec.startswith("shape:"):  # not a spec resolve_spec knows: a config of decode_peers.SHAPES
        name = spec.split(":", 1)[1]
        if name not in SHAPES:
            sys.exit(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
        loaded = load_model(f"tiny:{name}", dtype=dtype, device=device, tiny_registry=SHAPES)
    else:
        resolved = resolve_spec(spec)
        gguf = resolved.path if resolved.kind == "gguf" else None
        # a GGUF model at the benchmark's dtype: its weights dequantized (the Q4_1 rows load it as stored)
        loaded = load_model(spec, dtype=dtype, device=device, gguf_weights="dequantize")
    model = loaded.model.eval()
    backends = args.backends or (["auto", "torch-simple", "torch-compile", "torch-cudagraph", "torch-opt"]
                                 if device.type == "cuda" else ["torch-simple", "torch-compile"])
    attention = {"insert_cached_attention.backend": args.attention} if args.attention else {}

    gen = torch.Generator().manual_seed(0)
    vocab = int(loaded.config.vocab_size)
    prompts = {b: torch.randint(100, vocab, (b, args.prompt_len), generator=gen).tolist() for b in args.batch_sizes}

    copy_bw, gemv_bw = copy_bandwidth(device), gemv_bandwidth(device, dtype)
    step_bytes = weight_bytes_per_step(model)
    print(f"device {device} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
          f"{', ' + torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}), "
          f"torch {torch.__version__}, dtype {dtype}, model {spec} ({loaded.source})")
    if device.type == "cpu":
        print(cpu_header(args.no_llama_cpp))
    print(f"copy bandwidth {copy_bw / 1e9:.1f} GB/s, GEMV bandwidth {gemv_bw / 1e9:.1f} GB/s, "
          f"weights read per decode step {step_bytes / 2**20:.0f} MiB")

    log = RowLog()
    log.add_all(hf_rows(model, prompts, device, args))
    gc.collect()
    if args.no_llama_cpp:
        log.add(Row(LLAMA_CPP, 0, None, "skipped (--no-llama-cpp)"))
    else:
        for b in args.batch_sizes:
            log.add_all(llama_cpp_rows(spec, gguf, dtype, prompts[b], args.new_tokens, device))
    log.add_all(workbench_rates(loaded, device, args.batch_sizes, prompts, args.new_tokens, backends,
                                extra_overrides=attention))
    q4 = None  # set below for smollm2 on CPU at fp32; the alternated rounds reuse it
    if gguf is not None and dtype == torch.float32 and device.type == "cpu":
        del model
        gc.collect()
        q4 = load_model(spec, device=device)  # the file's own Q4_1/Q8_0 weights, kept quantized
        for act in args.q4_activations:  # linear_weight_layout.int4_activations: the default, exact, or int8
            label = "workbench int4 (Q4_1)" + {"auto": ", default act", "fp32": "", "int8": ", int8 act"}[act]
            log.add_all(workbench_rates(q4, device, args.batch_sizes, prompts, args.new_tokens, backends,
                                        label=label, step_bytes=q4.parameter_bytes, peer_dtype=False,
                                        extra_overrides={**attention, "linear_weight_layout.int4_activations": act}))
    print_table(log.rows, step_bytes, copy_bw, gemv_bw)
    print_q4_ratios(log.rows)
    one = prompts.get(1) or [prompts[args.batch_sizes[0]][0]]  # the bs 1 prompt
    if (args.paired_rounds and q4 is not None and not args.no_llama_cpp
            and llama_cpp_unavailable(spec, one, device) is None):
        print_paired_rounds(gguf, loaded, q4, one, args.new_tokens, args.paired_rounds, device, args.paired_dynamo,
                            args.paired_backends, args.q4_activations)
    print("command: " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]))


def cpu_header(no_llama_cpp: bool) -> str:
    """The CPU model, its ISA flags, the workbench kernels' build in use and llama.cpp's (its own
    system info): which code each row ran."""
    from workbench.ops import cpu_kernels
    from workbench.ops.cpu_kernels import isa

    flags = sorted(f for f in isa.cpu_features() if f.startswith(("avx", "fma", "f16c", "amx", "asimd", "sve")))
    lines = [f"cpu {isa.cpu_model() or platform.machine()}; flags {' '.join(flags)}",
             f"workbench: {cpu_kernels.describe()} (WORKBENCH_CPU_ISA={isa.requested()})"]
    if not no_llama_cpp and importlib.util.find_spec("llama_cpp") is not None:
        import llama_cpp

        info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
        where = os.environ.get("LLAMA_CPP_LIB_PATH") or "llama-cpp-python's own build"
        lines.append(f"llama.cpp: {info} ({where})")
    return "\n".join(lines)


def llama_cpp_rows(spec: str, gguf: Optional[Path], dtype: torch.dtype, prompts: List[List[int]], new: int,
                   device: torch.device) -> Iterator[Row]:
    """llama.cpp on the packaged GGUF ``gguf`` (its own 4-bit dtype: shown, not a like-for-like peer)
    and on an F32 copy of it (the same weights as the workbench's fp32 model)."""
    b = len(prompts)
    why = llama_cpp_unavailable(spec, prompts, device)
    if why is not None:
        yield Row(LLAMA_CPP, b, None, why)
        return
    if dtype == torch.float32:
        f32 = float32_gguf(gguf)
        yield Row(f"{LLAMA_CPP} F32", b, llama_cpp_decode_rate(f32, prompts, new),
                  f"{f32.name}: the same fp32 weights", gguf_tensor_bytes(f32))
    else:
        yield Row(f"{LLAMA_CPP} F32", b, None, f"skipped: the benchmark runs {dtype}, the F32 copy is fp32")
    yield Row(f"{LLAMA_CPP} packaged", b, llama_cpp_decode_rate(gguf, prompts, new),
              f"{gguf.name}: 4-bit, not counted as a peer", gguf_tensor_bytes(gguf), peer_dtype=False)


def print_paired_rounds(src: Path, fp32, q4, prompts: List[List[int]], new: int, rounds: int,
                        device: torch.device, dynamo_too: bool = False,
                        backends: Sequence[str] = ("auto", "torch-compile"),
                        activations: Sequence[str] = ("auto", "fp32", "int8")) -> None:
    """bs 1 head to head, alternated: each round times llama.cpp F32, the workbench fp32 rows,
    llama.cpp Q4_1 and the workbench Q4_1 rows (one per compile backend of ``backends``: ``auto`` is
    what a user gets by default) one after the other (best of 2 each), and the ratios are taken
    within the round. This VM's memory bandwidth drifts by 30 % within minutes; rows timed minutes
    apart (the table above) compare states as much as engines, a round compares within one.
    ``src``: the packaged GGUF file."""
    f32 = float32_gguf(src)
    base = {"initialize_cache.max_batch_size": 1, "initialize_cache.max_seq_len": len(prompts[0]) + new}
    runs: Dict[str, Workbench] = {}
    for backend in backends:
        overrides = {**base, "compile_model.backend": backend}
        runs[f"fp32 {backend}"] = Workbench(fp32, device=device, numerics=False, overrides=overrides)
        for act in activations:
            name = {"auto": "default act", "fp32": "exact", "int8": "int8 act"}[act]
            runs[f"Q4_1 {name} {backend}"] = Workbench(
                q4, device=device, numerics=False, overrides={**overrides, "linear_weight_layout.int4_activations": act})
    if dynamo_too:  # the same pipelines with no static decode graph: every step through Dynamo
        no_static = {**base, "compile_model.backend": "torch-compile", "compile_model.static_decode_batch_sizes": []}
        runs["fp32 dynamo"] = Workbench(fp32, device=device, numerics=False, overrides=no_static)
        runs["Q4_1 exact dynamo"] = Workbench(
            q4, device=device, numerics=False, overrides={**no_static, "linear_weight_layout.int4_activations": "fp32"})
    for wb in runs.values():
        wb.run()
        wb.generate(prompts, max_new_tokens=4, stop_token_ids=[])

    ratios: Dict[str, List[float]] = {k: [] for k in runs}
    print(f"\nbs 1, alternated rounds (tok/s; ratio within the round), {rounds} rounds:")
    for i in range(rounds):
        l32 = llama_cpp_decode_rate(f32, prompts, new, repeats=2)
        w = {k: best_decode_rate(runs[k], prompts, new, 2) for k in runs if k.startswith("fp32")}
        lq = llama_cpp_decode_rate(src, prompts, new, repeats=2)
        for k in runs:
            if not k.startswith("fp32"):
                w[k] = best_decode_rate(runs[k], prompts, new, 2)
        for k, v in w.items():
            ratios[k].append(v / (l32 if k.startswith("fp32") else lq))
        print(f"  round {i + 1}: llama.cpp F32 {l32:6.1f}  " + "  ".join(
            f"{k} {v:6.1f} ({v / l32:.2f}x)" for k, v in w.items() if k.startswith("fp32")) +
            f" | llama.cpp Q4_1 {lq:6.1f}  " + "  ".join(
            f"{k} {v:6.1f} ({v / lq:.2f}x)" for k, v in w.items() if not k.startswith("fp32")))
    for k, r in ratios.items():
        peer = "llama.cpp F32" if k.startswith("fp32") else "llama.cpp Q4_1"
        print(f"workbench {k} bs 1: median {statistics.median(r):.2f}x {peer} "
              f"(rounds {min(r):.2f}-{max(r):.2f}x)")
    for name in ("fp32", "Q4_1 exact") if dynamo_too and "torch-compile" in backends else ():
        r = [a / b for a, b in zip(ratios[f"{name} torch-compile"], ratios[f"{name} dynamo"])]
        print(f"workbench {name}: static decode graph vs every step through Dynamo: median {statistics.median(r):.3f}x "
              f"(rounds {min(r):.3f}-{max(r):.3f}x)")

if __name__ == "__main__":
    main()
