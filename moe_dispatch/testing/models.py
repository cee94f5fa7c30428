"""The Megatron-Core model configuration that tests and benchmarks build their small MoE models from."""

from __future__ import annotations

import torch


def moe_config_fields(
    *, layers=1, hidden=16, heads=2, experts=4, topk=2, ffn=32, dtype=torch.float32, **fields
) -> dict:
    """The keywords of a Megatron-Core ``TransformerConfig`` (or of a Megatron-Bridge model provider,
    one of its subclasses) for a small MoE model: ``layers`` layers of width ``hidden`` with ``heads``
    attention heads, each an MoE layer of ``experts`` experts chosen top-``topk``, FFN width ``ffn``
    (experts' and dense; all these ints), parameters in ``dtype`` (a ``torch.dtype``; Megatron's
    ``bf16`` / ``fp16`` flags set to match). ``fields`` add to these or override them
    (``expert_model_parallel_size``, ``use_cpu_initialization``, ...). Plain values only: importing
    this module imports no Megatron."""
    return {
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_moe_experts": experts,
        "moe_router_topk": topk,
        "ffn_hidden_size": ffn,
        "moe_ffn_hidden_size": ffn,
        "params_dtype": dtype,
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        **fields,
    }
