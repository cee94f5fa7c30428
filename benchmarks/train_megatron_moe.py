"""Train a small GPT whose MoE layers are Megatron-Core ``MoELayer``s, once with the alltoall
dispatcher and once with moe_dispatch's flex backend "custom", from the same seed and data, the
two runs interleaved step by step in one world (their seconds per step side by side).

Real client, real input: Megatron-Core's ``GPTModel`` (local, non-Transformer-Engine spec; every
layer an MoE layer with a learned top-k router and load-balancing loss) reads byte-level tokens
of the Python standard library's own source files on this machine, through Megatron's own
pipeline schedule (``get_forward_backward_func``). Each data-parallel rank draws its own
micro-batches, the same ones in both runs.

The default is the configuration of Megatron-Bridge's MoE communication-overlap guidance:
4 ranks, pipeline parallel 2 with 2 virtual stages (the interleaved schedule), expert parallel
2, ``overlap_moe_expert_parallel_comm=True`` (Megatron's combined-1F1B schedule overlaps one
micro-batch's dispatch/combine with another's compute) and ``delay_wgrad_compute=True``
(expert weight gradients left to ``MoELayer.backward_dw()``), bf16 (fp32 optimizer copies),
shared-expert overlap off; hidden size 64, because a CPU without bf16 units multiplies bf16
matrices some 60x slower than fp32 ones. Each rank is a simulated node of its own, so each EP group of 2 spans
2 nodes: the cross-node traffic that EP overlap is meant to hide. The script counts, per rank
and dispatcher, the entries into Megatron's combined-1F1B schedule and the ``backward_dw()``
calls that changed an expert weight gradient (the wgrads really deferred). The earlier default,
EP 4 over 2 simulated nodes of 2, fp32, no overlap: ``--pp 1 --vpp 1 --ep 4 --ranks-per-node 2
--no-ep-overlap --no-delay-wgrad --dtype fp32 --hidden 256 --ffn-hidden 512 --micro-batch-size 4
--microbatches 1``.

The script prints the loss every ``--log-every`` steps under a progress bar, writes
``losses.csv``, ``summary.json`` and ``loss_curves.png`` into ``--out``, and exits non-zero unless

- the two loss curves agree: the largest difference of their trailing ``--smooth``-step means
  is at most ``--tolerance`` (per-step differences are reported too: the two dispatchers sum a
  token's expert outputs in different orders, which changes bf16 rounding, and training
  amplifies that chaotically, so single steps drift while the curves stay together; fp32 on CPU
  without padding gives bitwise equal curves);
- the loss falls: mean of the last 10 steps < ``--min-drop`` x the mean of the first 10 (5 and 5
  of a 10-step run, and so on);
- with EP overlap, the combined-1F1B schedule ran on every rank for both dispatchers, and with
  ``--delay-wgrad`` every ``backward_dw()`` call of "custom" changed its experts' gradients.
  alltoall defers nothing on these (non-Transformer-Engine) experts: Megatron leaves expert
  wgrad deferral to TE's ``GroupedLinear``, so its ``backward_dw()`` calls change no gradient;
  that is reported, not failed.

CPU (default when not launched by torchrun): a gloo world of ``--ranks`` processes through
``moe_dispatch.megatron.cpu`` (debugging only, not a training path). GPUs: ``torchrun
--nproc-per-node 8 benchmarks/train_megatron_moe.py --ep 4`` (NCCL; nodes from LOCAL_WORLD_SIZE).

Usage:
  python benchmarks/train_megatron_moe.py                         # 200 steps
  python benchmarks/train_megatron_moe.py --steps 60 --log-every 10 --out /tmp/train
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import math
import os
import pathlib
import sys
import sysconfig
import time

import torch
import torch._dynamo
import torch.distributed as dist

from moe_dispatch.testing.launch import launch_ranks
from moe_dispatch.testing.models import moe_config_fields
from moe_dispatch.tools.quiet import NOTE as QUIET_NOTE
from moe_dispatch.tools.quiet import filter_known_warnings

DISPATCHERS = ("alltoall", "custom")


def _flag(default, help: str | None = None, **argparse_kwargs):
    """A :class:`RunConfig` field that the flag ``--<name>`` (dashes for underscores) sets, of
    ``default``'s type (a bool: ``--name`` / ``--no-name``); ``argparse_kwargs`` go to argparse."""
    return dataclasses.field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclasses.dataclass
class RunConfig:
    """Everything that defines a training run (both dispatchers use the same one). The fields with
    a default are the command-line flags of their names; the first three are derived."""

    ranks_per_node: int  # --ranks-per-node on CPU, LOCAL_WORLD_SIZE under torchrun; at most --ep
    simulated_nodes: bool  # CPU: declare ranks_per_node; torchrun: derived from LOCAL_WORLD_SIZE
    corpus_bytes: int  # --corpus-mb
    steps: int = _flag(200)
    seq_len: int = _flag(64)
    micro_batch_size: int = _flag(2, "sequences per micro-batch")
    microbatches: int = _flag(4, "micro-batches per data-parallel rank and step (>= --pp)")
    hidden: int = _flag(64)
    layers: int = _flag(4)
    heads: int = _flag(4)
    experts: int = _flag(8)
    topk: int = _flag(2)
    ffn_hidden: int = _flag(128)
    lr: float = _flag(3e-3)
    warmup: int = _flag(20)
    aux_loss_coeff: float = _flag(1e-2)
    clip_grad: float = _flag(1.0)
    pad_multiple: int = _flag(1, "custom backend: pad expert blocks (>1 fuses the permute into dispatch)")
    seed: int = _flag(1234)
    log_every: int = _flag(25, "print the loss every N steps")
    pp: int = _flag(2, "pipeline-parallel size")
    vpp: int = _flag(2, "virtual pipeline stages per rank (1: no interleaving)")
    ep: int = _flag(2, "expert-parallel size")
    ep_overlap: bool = _flag(
        True,
        "overlap_moe_expert_parallel_comm (Megatron's combined-1F1B schedule; needs bf16, and --vpp > 1 when --pp > 1)",
    )
    delay_wgrad: bool = _flag(
        True, "delay_wgrad_compute: expert weight gradients in MoELayer.backward_dw() (needs --ep-overlap)"
    )
    dtype: str = _flag("bf16", "parameters and activations", choices=("bf16", "fp32"))
    data_dir: str = _flag(
        sysconfig.get_paths()["stdlib"], "folder of Python sources (default: this interpreter's standard library)"
    )


# ---------------------------------------------------------------------------------------------
# data: byte-level tokens of the standard library's .py files
# ---------------------------------------------------------------------------------------------


def load_corpus(data_dir: str, max_bytes: int) -> torch.Tensor:
    """Bytes of the ``.py`` files under ``data_dir`` (sorted paths, whole files until
    ``max_bytes``) as a uint8 tensor; the same on every rank and run."""
    root = pathlib.Path(data_dir)
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    if not files:
        raise FileNotFoundError(f"no .py files under --data-dir {data_dir}: pass a folder of Python sources")
    chunks, total = [], 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).clone()


def sample_batch(corpus: torch.Tensor, cfg: RunConfig, step: int, index: int) -> torch.Tensor:
    """``[B, S + 1]`` int64 windows of the corpus, drawn from (seed, step, index) only; ``index``
    numbers the micro-batches of a step over the data-parallel ranks."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + index)
    starts = torch.randint(0, corpus.numel() - cfg.seq_len - 1, (cfg.micro_batch_size,), generator=gen)
    return torch.stack([corpus[s : s + cfg.seq_len + 1] for s in starts.tolist()]).long()


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------


def build_model(cfg: RunConfig, dispatcher: str, device: torch.device) -> list:
    """This rank's model chunks (one per virtual pipeline stage) of a Megatron-Core ``GPTModel``
    (local spec, every layer MoE, RMSNorm, RoPE, no dropout, ``cfg.dtype``) with the
    ``dispatcher`` ("alltoall" or "custom"); identical weights for both dispatchers."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    import moe_dispatch.megatron as mdm

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.dtype]
    overlap = {"overlap_moe_expert_parallel_comm": cfg.ep_overlap, "delay_wgrad_compute": cfg.delay_wgrad}
    shape = {name: getattr(cfg, name) for name in ("layers", "hidden", "heads", "experts", "topk")}
    config = TransformerConfig(
        **moe_config_fields(**shape, ffn=cfg.ffn_hidden, dtype=dtype),
        moe_aux_loss_coeff=cfg.aux_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        moe_shared_expert_overlap=False,
        expert_model_parallel_size=cfg.ep,
        pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.vpp if cfg.vpp > 1 else None,
        pipeline_dtype=dtype,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        init_method_std=0.02,
        normalization="RMSNorm",
        **(overlap if dispatcher == "alltoall" else {}),
    )
    if dispatcher == "custom":
        mdm.configure(
            config,
            ranks_per_node=cfg.ranks_per_node if cfg.simulated_nodes else None,
            pad_multiple=cfg.pad_multiple,
            **overlap,
        )
    chunks = []
    for vp in range(cfg.vpp):
        # dense weights: the same in both runs, distinct per stage
        torch.manual_seed(cfg.seed + 101 * (vp * cfg.pp + ps.get_pipeline_model_parallel_rank()))
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=get_gpt_layer_local_spec(num_experts=cfg.experts),
                vocab_size=256,
                max_sequence_length=cfg.seq_len,
                position_embedding_type="rope",
                share_embeddings_and_output_weights=False,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                **({"vp_stage": vp} if cfg.vpp > 1 else {}),
            ).to(device)
        )
    # experts: distinct per layer and global expert (CPU initialisation gives every EP rank the same)
    ep_rank, local = ps.get_expert_model_parallel_rank(), cfg.experts // cfg.ep
    with torch.no_grad():
        for layer in (layer for chunk in chunks for layer in chunk.decoder.layers):
            for local_idx, expert in enumerate(layer.mlp.experts.local_experts):
                for which, linear in enumerate((expert.linear_fc1, expert.linear_fc2)):
                    gen = torch.Generator().manual_seed(
                        cfg.seed * 7919 + layer.layer_number * 1_000_003 + (ep_rank * local + local_idx) * 31 + which
                    )
                    linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * 0.02)
    # "custom" + delay_wgrad_compute: the backend made the local experts defer their wgrads as it built them
    return chunks


class ScheduleProbe:
    """Counts entries into Megatron's combined-1F1B schedule (the EP-overlap path: with
    ``overlap_moe_expert_parallel_comm`` every schedule step goes through it, a forward and a
    backward overlapped, or one of them alone in warm-up and cool-down), by the dispatcher whose
    step is running."""

    NAMES = ("combined_1f1b_schedule_for_interleaved_pipelining", "combined_1f1b_schedule_for_no_pipelining")

    def __init__(self) -> None:
        from megatron.core.pipeline_parallel import schedules

        self.counts = {d: 0 for d in DISPATCHERS}
        self.current: str | None = None
        for name in self.NAMES:
            setattr(schedules, name, self._counting(getattr(schedules, name)))

    def _counting(self, fn):
        def counted(*args, **kwargs):
            self.counts[self.current] += 1
            return fn(*args, **kwargs)

        return counted


class WgradProbe:
    """Counts a model's ``MoELayer.backward_dw()`` calls for the routed experts, and how many of
    them changed an expert weight gradient (the wgrads deferred to it ran there)."""

    def __init__(self, chunks: list) -> None:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        self.calls = self.changed = 0
        for layer in (m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)):
            layer.backward_dw = self._counting(layer.backward_dw, list(layer.experts.parameters()))

    def _counting(self, backward_dw, weights: list):
        def counted(routed_experts: bool = True, shared_experts: bool = False):
            before = [None if w.grad is None else w.grad.clone() for w in weights] if routed_experts else None
            backward_dw(routed_experts=routed_experts, shared_experts=shared_experts)
            if routed_experts:
                self.calls += 1
                self.changed += any(
                    (w.grad is not None) if b is None else not torch.equal(b, w.grad) for b, w in zip(before, weights)
                )

        return counted


@dataclasses.dataclass
class Run:
    """One dispatcher's model chunks, their fp32 copies the optimizer updates (the parameters
    themselves when they are fp32), the optimizer and the backward_dw counter."""

    chunks: list
    params: list
    master: list
    opt: torch.optim.Optimizer
    wgrad: WgradProbe


def make_run(cfg: RunConfig, dispatcher: str, device: torch.device) -> Run:
    """Model, fp32 optimizer copies and AdamW for ``dispatcher``."""
    chunks = build_model(cfg, dispatcher, device)
    for chunk in chunks:
        chunk.train()
    params = [p for chunk in chunks for p in chunk.parameters()]
    master = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_() for p in params]
    opt = torch.optim.AdamW(master, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    return Run(chunks, params, master, opt, WgradProbe(chunks))


def reduce_gradients(run: Run, cfg: RunConfig) -> float:
    """Moves the gradients onto the fp32 copies, averages them for the mean loss over
    data-parallel ranks (dense: all-reduce over the DP group; experts: their tokens' gradients
    already arrived through combine's backward, so only the expert-DP replicas are summed) and
    clips to ``cfg.clip_grad``; returns the norm over all stages and experts."""
    from megatron.core import parallel_state as ps

    dp_group = ps.get_data_parallel_group()
    expert_dp_group = ps.get_expert_data_parallel_group()
    dp_size = dist.get_world_size(dp_group)
    dense, experts = [], []
    for param, master in zip(run.params, run.master):
        if param.grad is None:
            continue
        if master is not param:
            master.grad, param.grad = param.grad.float(), None
        (dense if getattr(param, "allreduce", True) else experts).append(master.grad)
    for grads, group in ((dense, dp_group), (experts, expert_dp_group)):
        if not grads:
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        if dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        flat /= dp_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    device = run.master[0].device
    squares = [sum(float(g.pow(2).sum()) for g in grads) for grads in (dense, experts)]
    dense_sq, expert_sq = (torch.tensor([v], dtype=torch.float64, device=device) for v in squares)
    dist.all_reduce(expert_sq, group=ps.get_expert_model_parallel_group())
    total = dense_sq + expert_sq
    dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())  # each stage holds its own layers
    norm = math.sqrt(float(total))
    if cfg.clip_grad > 0 and norm > cfg.clip_grad:
        for g in dense + experts:
            g.mul_(cfg.clip_grad / (norm + 1e-6))
    return norm


def optimizer_step(run: Run, lr: float) -> None:
    """AdamW on the fp32 copies, then the model's parameters from them."""
    for group in run.opt.param_groups:
        group["lr"] = lr
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        for param, master in zip(run.params, run.master):
            if param is not master:
                param.copy_(master)


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warm-up, then cosine decay to 10% of ``cfg.lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_both(cfg: RunConfig, corpus: torch.Tensor, device: torch.device, console) -> dict:
    """Both training runs in one world, interleaved: each step runs once per dispatcher on the same
    batch, which of them goes first alternating, every rank lined up (a barrier) before each timed
    step, so machine noise falls on both alike. Returns, per dispatcher, the per-step mean losses
    over data-parallel ranks and micro-batches, rank 0's seconds per step (a step ends with an
    all-reduce, so they are the slowest rank's) and this rank's schedule and backward_dw counts."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    import moe_dispatch.megatron as mdm
    from moe_dispatch.megatron.schedule import run_gpt_step

    mdm.clear_buffers()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    runs = {dispatcher: make_run(cfg, dispatcher, device) for dispatcher in DISPATCHERS}
    schedule = ScheduleProbe()
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    results = {d: {"losses": [], "step_s": []} for d in DISPATCHERS}
    progress = task = None
    if console is not None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(
            TextColumn("[bold]steps"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(" ".join(f"{d} {{task.fields[{d}]:.4f}}" for d in DISPATCHERS)),
            TimeElapsedColumn(),
            console=console,
        )
        progress.start()
        task = progress.add_task("steps", total=cfg.steps, **{d: float("nan") for d in DISPATCHERS})

    def one_step(step: int, dispatcher: str) -> tuple[float, float]:
        run = runs[dispatcher]
        schedule.current = dispatcher
        batches = [
            sample_batch(corpus, cfg, step, dp_rank * cfg.microbatches + i).to(device) for i in range(cfg.microbatches)
        ]
        tokens = [b[:, :-1].contiguous() for b in batches]
        labels = [b[:, 1:].contiguous() for b in batches]
        losses = run_gpt_step(run.chunks, tokens, labels)  # empty but on the last pipeline stage
        grad_norm = reduce_gradients(run, cfg)
        optimizer_step(run, lr_at(step, cfg))
        loss_sum = torch.tensor([sum(float(loss) for loss in losses)], dtype=torch.float64, device=device)
        dist.all_reduce(loss_sum)
        return float(loss_sum) / (dp_size * cfg.microbatches), grad_norm

    try:
        for step in range(cfg.steps):
            order = DISPATCHERS if step % 2 == 0 else DISPATCHERS[::-1]
            norms = {}
            for dispatcher in order:
                dist.barrier()
                start = time.perf_counter()
                loss, norms[dispatcher] = one_step(step, dispatcher)
                results[dispatcher]["step_s"].append(time.perf_counter() - start)
                results[dispatcher]["losses"].append(loss)
            if progress is not None:
                progress.update(task, advance=1, **{d: results[d]["losses"][-1] for d in DISPATCHERS})
                if (step + 1) % cfg.log_every == 0 or step == 0:
                    for d in DISPATCHERS:
                        progress.console.print(
                            f"{d:>8} step {step + 1:4d}  loss {results[d]['losses'][-1]:.4f}  "
                            f"grad-norm {norms[d]:.3f}  lr {lr_at(step, cfg):.2e}  "
                            f"{results[d]['step_s'][-1] * 1e3:.0f} ms"
                        )
    finally:
        if progress is not None:
            progress.stop()
    dist.barrier()
    for d in DISPATCHERS:
        results[d]["counts"] = {
            "combined_1f1b_calls": schedule.counts[d],
            "backward_dw_calls": runs[d].wgrad.calls,
            "backward_dw_changed_expert_grads": runs[d].wgrad.changed,
        }
    return results


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each step (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def step_ratio(custom: list[float], alltoall: list[float]) -> dict:
    """Custom's seconds per step over alltoall's: of the means, and the median with p10-p90 of the
    per-step ratios (the two ran back to back on each step, so they shared its noise)."""
    ratios = sorted(c / a for c, a in zip(custom, alltoall))

    def at(q: float) -> float:
        return ratios[min(len(ratios) - 1, int(q * len(ratios)))]

    return {"of_means": sum(custom) / sum(alltoall), "median": at(0.5), "p10": at(0.1), "p90": at(0.9)}


def summarize(cfg: RunConfig, results: dict, tolerance: float, min_drop: float, smooth: int, meta: dict) -> dict:
    """The figures of both runs and the checks: curves agree, loss falls, and (as configured) the
    EP-overlap schedule ran and "custom"'s expert wgrads were deferred. ``results[d]["counts"]``
    holds each count as a list by rank."""
    a, c = results["alltoall"]["losses"], results["custom"]["losses"]
    diffs = [abs(x - y) for x, y in zip(a, c)]
    smooth_diffs = [abs(x - y) for x, y in zip(trailing_mean(a, smooth), trailing_mean(c, smooth))]
    window = max(1, min(10, len(a) // 2))
    summary = {
        "config": dataclasses.asdict(cfg),
        **meta,
        "final_loss": {k: sum(v["losses"][-window:]) / window for k, v in results.items()},
        "initial_loss": {k: sum(v["losses"][:window]) / window for k, v in results.items()},
        "last_step_loss": {k: v["losses"][-1] for k, v in results.items()},
        "train_s": {k: sum(v["step_s"]) for k, v in results.items()},
        "s_per_step": {k: sum(v["step_s"]) / len(v["step_s"]) for k, v in results.items()},
        "step_ratio": step_ratio(results["custom"]["step_s"], results["alltoall"]["step_s"]),
        "max_abs_loss_diff": max(diffs),
        "max_abs_loss_diff_step": diffs.index(max(diffs)) + 1,
        "mean_abs_loss_diff": sum(diffs) / len(diffs),
        "bitwise_equal_curves": a == c,
        "max_abs_smoothed_diff": max(smooth_diffs),
        "smooth_window": smooth,
        "tolerance": tolerance,
        "min_drop": min_drop,
        "counts": {k: v["counts"] for k, v in results.items()},
    }
    summary["curves_agree"] = summary["max_abs_smoothed_diff"] <= tolerance
    summary["loss_falls"] = all(summary["final_loss"][k] < min_drop * summary["initial_loss"][k] for k in results)
    counts = summary["counts"]
    # as configured (None when not): every rank entered the combined-1F1B schedule, in both runs
    summary["ep_overlap_ran"] = (
        all(n > 0 for c in counts.values() for n in c["combined_1f1b_calls"]) if cfg.ep_overlap else None
    )
    # ... and every backward_dw call of "custom" changed its experts' gradients
    custom = counts["custom"]
    summary["custom_wgrads_deferred"] = (
        all(
            0 < calls == changed
            for calls, changed in zip(custom["backward_dw_calls"], custom["backward_dw_changed_expert_grads"])
        )
        if cfg.delay_wgrad
        else None
    )
    return summary


def write_outputs(out: pathlib.Path, results: dict, summary: dict) -> None:
    """Writes ``losses.csv``, ``summary.json`` and ``loss_curves.png`` (matplotlib, Agg) into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    a, c = results["alltoall"]["losses"], results["custom"]["losses"]
    with open(out / "losses.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "loss_alltoall", "loss_custom", "abs_diff"])
        for i, (x, y) in enumerate(zip(a, c)):
            writer.writerow([i + 1, f"{x:.6f}", f"{y:.6f}", f"{abs(x - y):.3e}"])
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    steps = list(range(1, len(a) + 1))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.plot(steps, a, label=f"alltoall (final {summary['final_loss']['alltoall']:.3f})", lw=1.6)
    top.plot(steps, c, label=f"custom / moe_dispatch (final {summary['final_loss']['custom']:.3f})", lw=1.0, ls="--")
    top.set_ylabel("train loss (nats/byte)")
    cfgd = summary["config"]
    top.set_title(
        f"Megatron-Core GPT, {cfgd['layers']} MoE layers x {cfgd['experts']} experts top-{cfgd['topk']}, "
        f"H={cfgd['hidden']}, {cfgd['dtype']}, {parallel_layout(cfgd, summary['ranks'])}",
        fontsize=9,
    )
    top.legend()
    top.grid(alpha=0.3)
    window = summary["smooth_window"]
    bottom.plot(steps, [abs(x - y) for x, y in zip(a, c)], color="tab:red", lw=0.8, label="per step")
    bottom.plot(
        steps,
        [abs(x - y) for x, y in zip(trailing_mean(a, window), trailing_mean(c, window))],
        color="black",
        lw=1.4,
        label=f"{window}-step means",
    )
    bottom.axhline(summary["tolerance"], color="gray", ls=":", lw=1.0, label="tolerance")
    bottom.set_ylabel("|difference|")
    bottom.legend(fontsize=7, loc="upper left")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------


def run_rank(rank: int, world_size: int, cfg: RunConfig, args_dict: dict) -> dict | None:
    """Both runs on one rank (the body of a spawned CPU rank or a torchrun process)."""
    filter_known_warnings()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import moe_dispatch.megatron  # noqa: F401  (installs the "custom" backend)

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        import moe_dispatch.megatron.cpu as mcpu

        mcpu.enable()  # with the tensors Megatron's schedules allocate on "cuda" (token counters)
        # Megatron wraps dispatch_preprocess in torch.compile: on CPU it only costs compile time
        torch._dynamo.config.disable = True
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    ps.initialize_model_parallel(
        pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.vpp if cfg.vpp > 1 else None,
        expert_model_parallel_size=cfg.ep,
    )
    model_parallel_cuda_manual_seed(cfg.seed)
    corpus = load_corpus(cfg.data_dir, cfg.corpus_bytes)
    console = None
    if rank == 0:
        from rich.console import Console

        console = Console(force_terminal=args_dict["force_terminal"], width=110)
        console.print(
            f"corpus: {corpus.numel() / 1e6:.1f} MB of Python sources under {cfg.data_dir}; "
            f"{parallel_layout(dataclasses.asdict(cfg), world_size)}; EP overlap {cfg.ep_overlap}, "
            f"delay_wgrad {cfg.delay_wgrad}, {cfg.dtype}, {cfg.microbatches} micro-batches of "
            f"{cfg.micro_batch_size} per data-parallel rank and step; device {device.type}"
        )
    results = train_both(cfg, corpus, device, console)
    counts = [None] * world_size
    dist.all_gather_object(counts, {d: results[d]["counts"] for d in DISPATCHERS})
    for d in DISPATCHERS:  # per rank, in rank order
        results[d]["counts"] = {key: [c[d][key] for c in counts] for key in counts[0][d]}
    ps.destroy_model_parallel()
    return results if rank == 0 else None


def parallel_layout(cfg: dict, world: int) -> str:
    """The parallel layout in words, e.g. "4 ranks: PP 2 x VPP 2, EP 2, DP 2; 4 node(s) x 1"."""
    return (
        f"{world} ranks: PP {cfg['pp']} x VPP {cfg['vpp']}, EP {cfg['ep']}, DP {world // cfg['pp']}; "
        f"{world // cfg['ranks_per_node']} node(s) x {cfg['ranks_per_node']}"
    )


# The flags that are not RunConfig fields: (flag, default, help)
RUN_FLAGS = (
    ("--ranks", 4, "CPU world size (ignored under torchrun)"),
    ("--ranks-per-node", 1, "simulated node size on CPU (default 1: each EP group spans nodes, as EP overlap assumes)"),
    ("--corpus-mb", 4.0, None),
    ("--tolerance", 0.05, "largest allowed difference of the two curves' trailing means (nats)"),
    ("--smooth", 20, "window of the trailing means compared"),
    ("--min-drop", 0.75, "final loss (mean of the last 10 steps) must be below this fraction of the initial one"),
    ("--out", "bench_results/train/", None),
    ("--timeout-s", 3600.0, None),
)


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags (see ``--help``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    for field in dataclasses.fields(RunConfig):
        if field.default is dataclasses.MISSING:
            continue  # derived
        kwargs = dict(field.metadata)
        if isinstance(field.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.setdefault("type", type(field.default))
        p.add_argument("--" + field.name.replace("_", "-"), default=field.default, **kwargs)
    for flag, default, text in RUN_FLAGS:
        p.add_argument(flag, type=type(default), default=default, help=text)
    args = p.parse_args(argv)
    return args


def flag_errors(args: argparse.Namespace, world: int, local: int) -> list[str]:
    """What is wrong with the parallel and overlap flags for a world of ``world`` ranks in nodes
    of ``local`` (empty when nothing is), each with its fix."""
    errors = []
    if world % (args.pp * args.ep) or args.experts % args.ep or world % local:
        errors.append(
            f"need --pp x --ep ({args.pp} x {args.ep}) dividing the world ({world}), --ep dividing --experts "
            f"({args.experts}), and the node size ({local}) dividing the world"
        )
    if args.layers % (args.pp * args.vpp):
        errors.append(f"--layers ({args.layers}) must be a multiple of --pp x --vpp ({args.pp} x {args.vpp})")
    if args.pp > 1 and args.microbatches % args.pp:
        errors.append(f"--microbatches ({args.microbatches}) must be a multiple of --pp ({args.pp})")
    if args.vpp > 1 and args.pp == 1:
        errors.append("--vpp > 1 needs --pp > 1 (virtual stages interleave pipeline stages)")
    if args.ep_overlap and args.dtype != "bf16":
        errors.append("--ep-overlap needs --dtype bf16 (Megatron runs the EP-overlap schedule in bf16/fp16 only)")
    if args.ep_overlap and args.pp > 1 and args.vpp == 1:
        errors.append(
            "--ep-overlap with --pp > 1 needs --vpp > 1: Megatron's non-interleaved pipeline schedule ignores "
            "overlap_moe_expert_parallel_comm"
        )
    if args.ep_overlap and args.ep == 1:
        errors.append("--ep-overlap needs --ep > 1 (there is no expert-parallel communication to overlap)")
    if args.delay_wgrad and not args.ep_overlap:
        errors.append("--delay-wgrad needs --ep-overlap (Megatron calls backward_dw() only in that schedule)")
    return errors


def main(argv=None) -> int:
    """Runs both trainings (spawned CPU world, or this torchrun process), writes the outputs and
    returns 0 when every check passes (curves agree, loss falls, overlap ran, wgrads deferred),
    1 otherwise, 2 on bad flags."""
    args = parse_args(argv)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.ranks
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if under_torchrun else args.ranks_per_node
    errors = flag_errors(args, world, local)
    if errors:
        print("\n".join(f"error: {e}" for e in errors), file=sys.stderr)
        return 2
    if not under_torchrun or int(os.environ["RANK"]) == 0:
        print(QUIET_NOTE, flush=True)
    derived = {
        "ranks_per_node": min(local, args.ep),
        "simulated_nodes": not under_torchrun,
        "corpus_bytes": int(args.corpus_mb * 1e6),
    }
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(RunConfig) if f.name not in derived}
    cfg = RunConfig(**derived, **flags)
    rank_args = {"force_terminal": None}
    start = time.perf_counter()
    if not under_torchrun:
        rank_args["force_terminal"] = sys.stdout.isatty() or None
    results = launch_ranks(world, run_rank, cfg, rank_args, timeout_s=args.timeout_s)
    if results is None:  # a rank other than 0 under torchrun
        return 0
    total = time.perf_counter() - start
    meta = {
        "ranks": world,
        "total_wall_s": total,
        "torch": torch.__version__,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "date": datetime.date.today().isoformat(),
    }
    try:
        import megatron.core.package_info as info

        meta["megatron_core"] = info.__shortversion__
    except ImportError:
        pass
    summary = summarize(cfg, results, args.tolerance, args.min_drop, max(1, args.smooth), meta)
    out = pathlib.Path(args.out)
    write_outputs(out, results, summary)
    checks = [
        c for c in ("curves_agree", "loss_falls", "ep_overlap_ran", "custom_wgrads_deferred") if summary[c] is not None
    ]
    verdict = "PASS" if all(summary[c] for c in checks) else "FAIL"
    print(
        f"\nfinal loss (mean of last 10 steps): alltoall {summary['final_loss']['alltoall']:.4f}, "
        f"custom {summary['final_loss']['custom']:.4f} (initial {summary['initial_loss']['alltoall']:.4f})"
    )
    print(
        f"max |loss difference| over {cfg.steps} steps: {summary['max_abs_loss_diff']:.3e} at step "
        f"{summary['max_abs_loss_diff_step']}; of the {summary['smooth_window']}-step means: "
        f"{summary['max_abs_smoothed_diff']:.3e} (tolerance {args.tolerance}); bitwise-equal curves: "
        f"{summary['bitwise_equal_curves']}"
    )
    per_step, ratio = summary["s_per_step"], summary["step_ratio"]
    print(
        f"seconds per step (interleaved, rank 0): alltoall {per_step['alltoall']:.3f}, custom "
        f"{per_step['custom']:.3f}; custom / alltoall {ratio['of_means']:.3f} of the means, per step "
        f"{ratio['median']:.3f} ({ratio['p10']:.3f}-{ratio['p90']:.3f}, median and p10-p90)"
    )
    for line in evidence_lines(summary["counts"], cfg.delay_wgrad):
        print(line)
    print(f"wall: total {total:.1f} s; outputs in {out}/ (loss_curves.png, losses.csv, summary.json)")
    print(f"{verdict}: " + ", ".join(f"{c.replace('_', ' ')} {summary[c]}" for c in checks))
    return 0 if verdict == "PASS" else 1


def evidence_lines(counts: dict, delay_wgrad: bool) -> list[str]:
    """The EP-overlap and (with ``delay_wgrad``) delayed-wgrad counts in words (per rank, both
    dispatchers)."""
    lines = [
        "Megatron's combined-1F1B (EP-overlap) schedule entered, per rank: "
        + "; ".join(f"{d} {counts[d]['combined_1f1b_calls']}" for d in DISPATCHERS)
    ]
    for d in DISPATCHERS[::-1] if delay_wgrad else ():
        calls, changed = sum(counts[d]["backward_dw_calls"]), sum(counts[d]["backward_dw_changed_expert_grads"])
        why = ""
        if d == "alltoall" and calls and not changed:
            why = " (Megatron defers expert wgrads only in TE's GroupedLinear; these experts are not TE's)"
        lines.append(
            f"expert wgrads deferred, {d}: {changed} of {calls} MoELayer.backward_dw() calls changed an expert "
            f"gradient{why}"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
