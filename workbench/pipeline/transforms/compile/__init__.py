"""Compile (stage ``compile``): how the finished graph runs.

compile_model.py      compile_model (torch-simple, torch-compile, CUDA graphs: the runner)
multi_stream.py       multi_stream_moe, multi_stream_mla_attn, multi_stream_gemm
fuse_causal_conv.py   fuse_causal_conv_activation
aux_branch.py         moving one branch onto the aux stream (run_on_aux), the multi_stream transform base
aux_streams.py        the auxiliary-stream markers multi_stream puts in the graph
cuda_only.py          the config base of transforms that only act on CUDA
"""
