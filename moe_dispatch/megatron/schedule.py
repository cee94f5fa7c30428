"""One training step of a Megatron-Core ``GPTModel`` through Megatron's own pipeline schedule
(``get_forward_backward_func``), shared by the tests and benchmarks that compare dispatchers
and overlap settings on the same model and data."""

from __future__ import annotations

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func


def run_gpt_step(model, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Forward and backward of ``batches`` (micro-batches of token ids ``[B, S]`` int64, on the
    model's device) through Megatron's schedule, with the mean of the logits as the loss.

    The schedule is whatever the model's config selects: with
    ``overlap_moe_expert_parallel_comm=True`` it is the combined-1F1B schedule that splits each
    layer into attention / dispatch / experts / combine nodes (``build_schedule_plan``).

    Returns:
        the per-micro-batch losses (fp32 scalars, detached); gradients land in the parameters.
    """
    micro_batch_size, seq_len = batches[0].shape
    positions = torch.arange(seq_len, device=batches[0].device).unsqueeze(0).expand(micro_batch_size, -1)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, model, return_schedule_plan=False):
        tokens = next(data_iterator)
        run = model.build_schedule_plan if return_schedule_plan else model
        return run(tokens, positions, None, labels=tokens), loss_func

    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=seq_len,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )
    return [o["loss"] for o in out]
