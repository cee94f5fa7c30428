"""Overlap benchmark in Megatron's own schedule: step time of a small Megatron-Core GPTModel
(every layer a MoELayer, flex backend "custom") with EP overlap off and on.

Per iteration, every rank times three runs of one training step (``--micro-batches``
micro-batches through Megatron's schedule, ``moe_dispatch.megatron.schedule.run_gpt_step``), the same weights and data:

  off   the plain schedule, experts compute their weight gradients at once
  on    Megatron's combined-1F1B schedule: ``overlap_moe_expert_parallel_comm`` +
        ``delay_wgrad_compute``, experts with delayed weight gradients
        (``moe_dispatch.megatron.enable_delayed_wgrad(model, run_wgrad=...)``)
  comm  the "off" step again with every dispatch/combine of the Buffer (forward and
        backward) timed: the communication time of a step (GPU: synchronised around each)

hidden = (off - on) / comm: the fraction of the step's communication time that the overlap
removes (the figure of ``bench_overlap.py``, there ``1 - (on - compute) / comm`` with
``compute = off - comm``). Times: max over ranks, median over iterations.

CPU (default): spawns a gloo world (``--world-size`` ranks, one simulated node each) with
``moe_dispatch.megatron.cpu``. Megatron's streams are no-ops there, so only what our Buffer
runs asynchronously overlaps: with ``--run-wgrad dispatch_backward`` (the CPU default) the
experts' weight gradients run while the dispatch backward's combine is in flight. GPU:
``torchrun --nproc-per-node 8 benchmarks/bench_megatron_overlap.py --hidden 2048 ...`` (NCCL;
``--run-wgrad backward_dw`` is the default there: Megatron's streams overlap).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import torch
import torch.distributed as dist

from moe_dispatch.testing.launch import launch_ranks, retain_freed_memory
from moe_dispatch.testing.models import moe_config_fields
from moe_dispatch.tools.quiet import NOTE as QUIET_NOTE
from moe_dispatch.tools.quiet import filter_known_warnings

MODES = ("off", "on", "comm")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _CommTimer:
    """Accumulates the wall time of the Buffer's dispatch/combine calls and of their backward
    passes while ``active`` (GPU: synchronising before and after each)."""

    def __init__(self) -> None:
        from moe_dispatch import buffer
        from moe_dispatch.runtime import autograd

        self.active, self.seconds = False, 0.0
        targets = [(buffer.Buffer, "dispatch"), (buffer.Buffer, "combine")]
        targets += [(getattr(autograd, n), "backward") for n in ("DispatchFn", "CombineFn", "ReplayDispatchFn")]
        for owner, name in targets:
            self._wrap(owner, name)

    def _wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.active:
                return original(*args, **kwargs)
            _sync()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                _sync()
                self.seconds += time.perf_counter() - start

        setattr(owner, name, staticmethod(timed) if name == "backward" else timed)


def _build(args, overlap: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    import moe_dispatch.megatron as mdm

    shape = {name: getattr(args, name) for name in ("layers", "hidden", "heads", "experts", "topk", "ffn")}
    cfg = TransformerConfig(
        **moe_config_fields(
            **shape,
            dtype=torch.bfloat16,
            use_cpu_initialization=True,
            add_bias_linear=False,
            expert_model_parallel_size=dist.get_world_size(),
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
    )
    mdm.configure(
        cfg, ranks_per_node=args.ranks_per_node, overlap_moe_expert_parallel_comm=overlap, delay_wgrad_compute=overlap
    )
    torch.manual_seed(args.seed)
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=args.experts),
        vocab_size=args.vocab,
        max_sequence_length=args.seq_len,
        position_embedding_type="rope",
    )
    if torch.cuda.is_available():
        model = model.cuda()
    if overlap:
        mdm.enable_delayed_wgrad(model, run_wgrad=args.run_wgrad)
    return model


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict | None:
    filter_known_warnings()
    import torch._dynamo
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from moe_dispatch.megatron.schedule import run_gpt_step

    torch._dynamo.config.disable = True
    if not torch.cuda.is_available():
        import moe_dispatch.megatron.cpu as mcpu

        mcpu.enable()
        retain_freed_memory()  # as a caching allocator would: no page faults for memory freed and reused
    ps.initialize_model_parallel(expert_model_parallel_size=world_size)
    model_parallel_cuda_manual_seed(args.seed)
    models = {"off": _build(args, False), "on": _build(args, True)}
    models["comm"] = models["off"]
    timer = _CommTimer()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    batches = [
        torch.randint(0, args.vocab, (args.micro_batch_size, args.seq_len), generator=gen).to(device)
        for _ in range(args.micro_batches)
    ]

    times = {m: [] for m in MODES}
    comm_ms = []
    for it in range(args.warmup + args.iters):
        for mode in MODES:
            model = models[mode]
            MoEAuxLossAutoScaler.main_loss_backward_scale = None
            dist.barrier()
            _sync()
            timer.active, timer.seconds = mode == "comm", 0.0
            start = time.perf_counter()
            run_gpt_step(model, batches)
            _sync()
            elapsed = torch.tensor([time.perf_counter() - start, timer.seconds], dtype=torch.float64)
            timer.active = False
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            for p in model.parameters():
                p.grad = None
            if it >= args.warmup:
                times[mode].append(float(elapsed[0]) * 1e3)
                if mode == "comm":
                    comm_ms.append(float(elapsed[1]) * 1e3)
    med = {m: statistics.median(v) for m, v in times.items()}
    comm = statistics.median(comm_ms)
    result = {
        "step_ms": med,
        "comm_ms": comm,
        "hidden_fraction": (med["off"] - med["on"]) / comm,
        "spread_ms": {m: [min(v), max(v)] for m, v in times.items()},
    }
    return result if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="CPU world size (torchrun sets it on GPU)")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="CPU: simulated ranks per node")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512, help="expert FFN width")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument(
        "--run-wgrad",
        choices=("backward_dw", "dispatch_backward"),
        default=None,
        help="who runs the delayed expert wgrads (default: dispatch_backward on CPU, backward_dw on GPU)",
    )
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=pathlib.Path, default=pathlib.Path("bench_results/megatron_overlap.json"))
    args = parser.parse_args(argv)
    print(QUIET_NOTE, flush=True)
    if args.run_wgrad is None:
        args.run_wgrad = "backward_dw" if torch.cuda.is_available() else "dispatch_backward"

    if "LOCAL_WORLD_SIZE" in os.environ:  # torchrun: the launched nodes decide
        args.ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    result = launch_ranks(args.world_size, _rank, args)
    if result is None:
        return 0
    m = result["step_ms"]
    print(f"Megatron combined-1F1B EP overlap, {args.micro_batches} micro-batches, run_wgrad={args.run_wgrad}")
    print(
        f"  step off {m['off']:.1f} ms | on {m['on']:.1f} ms | comm {result['comm_ms']:.1f} ms "
        f"(in an off step of {m['comm']:.1f} ms)"
    )
    print(f"  hidden = (off - on) / comm = {result['hidden_fraction']:.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "config": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
                "torch": torch.__version__,
                "result": result,
            },
            indent=2,
        )
    )
    print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
