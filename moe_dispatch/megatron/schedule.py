"""One training step of a Megatron-Core ``GPTModel`` through Megatron's own pipeline schedule
(``get_forward_backward_func``), shared by the tests and benchmarks that compare dispatchers
and overlap settings on the same model and data."""

from __future__ import annotations

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func


def run_gpt_step(model, batches: list[torch.Tensor], labels: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Forward and backward of ``batches`` through Megatron's schedule, with the mean per-token
    cross-entropy of each micro-batch as its loss.

    The schedule is whatever the model's config and parallel state select: no pipelining, 1F1B
    (pipeline parallel), or the interleaved one (a list of virtual-pipeline model chunks); with
    ``overlap_moe_expert_parallel_comm=True`` its combined-1F1B form, which splits each layer
    into attention / dispatch / experts / combine nodes (``build_schedule_plan``).

    Args:
        model: this rank's ``GPTModel``, or the list of its model chunks (one per virtual
            pipeline stage, in stage order) for the interleaved schedule.
        batches: micro-batches of token ids ``[B, S]`` int64 on the model's device; every chunk
            reads each of them once. ``S`` may differ between micro-batches only with the
            config's ``variable_seq_lengths=True``.
        labels: the target token ids of each micro-batch, shaped as its tokens (default: the
            tokens themselves).

    Returns:
        the per-micro-batch losses (fp32 scalars, detached) on the last pipeline stage, in
        micro-batch order; an empty list on the other stages. Gradients land in the parameters
        (each micro-batch's loss scaled by 1 / ``len(batches)``, as Megatron does).

    Raises:
        ValueError: ``labels`` does not match ``batches`` in number or shapes.
    """
    labels = batches if labels is None else labels
    if len(labels) != len(batches) or any(t.shape != y.shape for t, y in zip(batches, labels)):
        raise ValueError(
            f"labels must be one tensor per micro-batch shaped as its tokens; got {len(labels)} labels of shapes "
            f"{[tuple(y.shape) for y in labels]} for {len(batches)} batches of shapes "
            f"{[tuple(t.shape) for t in batches]}"
        )
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    micro_batch_size = batches[0].shape[0]

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach().clone()}  # Megatron divides `loss` in place by the micro-batches

    def forward_step(data_iterator, model, return_schedule_plan=False):
        tokens, targets = next(data_iterator)
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand(tokens.shape[0], -1)
        run = model.build_schedule_plan if return_schedule_plan else model
        return run(tokens, positions, None, labels=targets), loss_func

    # the interleaved schedule takes one iterator per chunk; each chunk reads every micro-batch
    iterators = [iter(list(zip(batches, labels))) for _ in chunks]
    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks,
        num_microbatches=len(batches),
        seq_length=max(t.shape[1] for t in batches),
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )
    return [o["loss"] for o in out]
