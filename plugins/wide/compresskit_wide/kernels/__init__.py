"""WIDE's kernels, one file per op; each holds the op's Triton kernel(s), its wrapper
(``triton_*``), its pure-PyTorch reference (``torch_*``) and, where it has one, its dense
fallback (``dense_*``):

* ``gemm_out``: output-width masked GEMM (q; gate and up with the SwiGLU fused in);
* ``gemm_reduce``: reduction-width masked GEMM (o, down) and the input-group masking;
* ``attention_decode`` / ``attention_prefill``: routed attention;
* ``router``: the inference-time routing decision;
* ``layout``: the routing layout (tokens sorted per group, active groups) the prefill kernels read.

``ops`` dispatches them by backend and registers each as a PyTorch operator (what the runtime's
blocks, the layers and the executor call); ``policy`` holds, as
data, where "auto" takes each kernel and the tile tables; ``autotune`` the autotuner's wiring;
``common`` the helpers several ops share. Nothing is imported here: import the module you need.
"""
