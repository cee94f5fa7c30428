"""Train a small GPT whose MoE layers are Megatron-Core ``MoELayer``s, once with the alltoall
dispatcher and once with moe_dispatch's flex backend "custom", from the same seed and data, the
two runs interleaved step by step in one world (their seconds per step side by side).

Real client, real input: Megatron-Core's ``GPTModel`` (local, non-Transformer-Engine spec; every
layer an MoE layer with a learned top-k router and load-balancing loss) reads byte-level tokens
of the Python standard library's own source files on this machine. Each rank draws its own
micro-batches (data parallel for the dense weights, expert parallel for the experts), the
same ones in both runs. The script prints the loss every ``--log-every`` steps under a progress
bar, writes ``losses.csv``, ``summary.json`` and ``loss_curves.png`` into ``--out``, and exits
non-zero unless

- the two loss curves agree: the largest difference of their trailing ``--smooth``-step means
  is at most ``--tolerance`` (per-step differences are reported too: on CPU without padding the
  curves are bitwise equal; padding rows or GPU atomics change fp32 rounding by an ulp, and
  training amplifies that chaotically, so single steps drift while the curves stay together);
- the loss falls: mean of the last 10 steps < ``--min-drop`` x the mean of the first 10 (5 and 5
  of a 10-step run, and so on).

CPU (default when not launched by torchrun): a gloo world of ``--ranks`` processes (default 4
= 2 simulated nodes x 2, EP 4) through ``moe_dispatch.megatron.cpu`` (debugging only, not a
training path). GPUs: ``torchrun --nproc-per-node 8 benchmarks/train_megatron_moe.py --ep 8``
(NCCL; nodes from LOCAL_WORLD_SIZE).

Usage:
  python benchmarks/train_megatron_moe.py                         # 300 steps, ~3-5 min on 2 cores
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

DISPATCHERS = ("alltoall", "custom")


@dataclasses.dataclass
class RunConfig:
    """Everything that defines a training run (both dispatchers use the same one)."""

    steps: int
    seq_len: int
    micro_batch_size: int
    hidden: int
    layers: int
    heads: int
    experts: int
    topk: int
    ffn_hidden: int
    lr: float
    warmup: int
    aux_loss_coeff: float
    clip_grad: float
    seed: int
    log_every: int
    ep: int
    ranks_per_node: int
    simulated_nodes: bool  # CPU: declare ranks_per_node; torchrun: derived from LOCAL_WORLD_SIZE
    corpus_bytes: int
    data_dir: str
    pad_multiple: int


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


def sample_batch(corpus: torch.Tensor, cfg: RunConfig, step: int, rank: int) -> torch.Tensor:
    """``[B, S + 1]`` int64 windows of the corpus, drawn from (seed, step, rank) only."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + rank)
    starts = torch.randint(0, corpus.numel() - cfg.seq_len - 1, (cfg.micro_batch_size,), generator=gen)
    return torch.stack([corpus[s : s + cfg.seq_len + 1] for s in starts.tolist()]).long()


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------


def build_model(cfg: RunConfig, dispatcher: str, device: torch.device):
    """Megatron-Core ``GPTModel`` (local spec, every layer MoE, fp32, RMSNorm, RoPE, no dropout)
    with the ``dispatcher`` ("alltoall" or "custom"); identical weights for both dispatchers."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    import moe_dispatch.megatron as mdm

    config = TransformerConfig(
        num_layers=cfg.layers,
        hidden_size=cfg.hidden,
        num_attention_heads=cfg.heads,
        ffn_hidden_size=cfg.ffn_hidden,
        moe_ffn_hidden_size=cfg.ffn_hidden,
        num_moe_experts=cfg.experts,
        moe_router_topk=cfg.topk,
        moe_aux_loss_coeff=cfg.aux_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=cfg.ep,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        init_method_std=0.02,
        normalization="RMSNorm",
    )
    if dispatcher == "custom":
        mdm.configure(
            config, ranks_per_node=cfg.ranks_per_node if cfg.simulated_nodes else None, pad_multiple=cfg.pad_multiple
        )
    torch.manual_seed(cfg.seed)  # dense weights: the same on every rank and in both runs
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=cfg.experts),
        vocab_size=256,
        max_sequence_length=cfg.seq_len,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    ).to(device)
    # experts: distinct per global expert (CPU initialisation would give every EP rank the same)
    ep_rank, local = ps.get_expert_model_parallel_rank(), cfg.experts // cfg.ep
    with torch.no_grad():
        for name, param in model.named_parameters():
            if getattr(param, "allreduce", True) or ".local_experts." not in name:
                continue
            local_idx = int(name.split(".local_experts.")[1].split(".")[0])
            gen = torch.Generator().manual_seed(
                cfg.seed * 7919 + (ep_rank * local + local_idx) * 31 + (1 if "fc2" in name else 0)
            )
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return model


def reduce_gradients(model, cfg: RunConfig) -> float:
    """Averages gradients for the mean loss over data-parallel ranks (dense: all-reduce over the
    DP group; experts: their tokens' gradients already arrived through combine's backward, so
    only the expert-DP replicas are summed) and clips to ``cfg.clip_grad``; returns the norm."""
    from megatron.core import parallel_state as ps

    dp_group = ps.get_data_parallel_group()
    expert_dp_group = ps.get_expert_data_parallel_group()
    dp_size = dist.get_world_size(dp_group)
    dense = [p.grad for p in model.parameters() if p.grad is not None and getattr(p, "allreduce", True)]
    experts = [p.grad for p in model.parameters() if p.grad is not None and not getattr(p, "allreduce", True)]
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
    device = (dense or experts)[0].device
    dense_sq = sum(float(g.float().pow(2).sum()) for g in dense)
    expert_sq = torch.tensor([sum(float(g.float().pow(2).sum()) for g in experts)], dtype=torch.float64, device=device)
    dist.all_reduce(expert_sq, group=ps.get_expert_model_parallel_group())
    norm = math.sqrt(dense_sq + float(expert_sq))
    if cfg.clip_grad > 0 and norm > cfg.clip_grad:
        for g in dense + experts:
            g.mul_(cfg.clip_grad / (norm + 1e-6))
    return norm


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
    over ranks and rank 0's seconds per step (a step ends with an all-reduce, so they are the
    slowest rank's)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    import moe_dispatch.megatron as mdm

    mdm.clear_buffers()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    runs = {}
    for dispatcher in DISPATCHERS:
        model = build_model(cfg, dispatcher, device)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
        runs[dispatcher] = (model, opt)
    rank, world = dist.get_rank(), dist.get_world_size()
    positions = torch.arange(cfg.seq_len, device=device).unsqueeze(0).expand(cfg.micro_batch_size, -1)
    causal = torch.triu(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool, device=device), 1)[None, None]
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
        model, opt = runs[dispatcher]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = sample_batch(corpus, cfg, step, rank).to(device)
        tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        per_token = model(tokens, positions, causal, labels=labels)
        loss = per_token.float().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = reduce_gradients(model, cfg)
        opt.step()
        mean_loss = loss.detach().reshape(1).double()
        dist.all_reduce(mean_loss)
        return float(mean_loss) / world, grad_norm

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
    """The figures of both runs and the two checks (curves agree, loss falls)."""
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
    }
    summary["curves_agree"] = summary["max_abs_smoothed_diff"] <= tolerance
    summary["loss_falls"] = all(summary["final_loss"][k] < min_drop * summary["initial_loss"][k] for k in results)
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
        f"H={cfgd['hidden']}, EP {cfgd['ep']} ({summary['ranks'] // cfgd['ranks_per_node']} nodes x "
        f"{cfgd['ranks_per_node']})",
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
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import moe_dispatch.megatron  # noqa: F401  (installs the "custom" backend)

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        import moe_dispatch.megatron.cpu as mcpu

        mcpu.enable(redirect_cuda_tensors=False)
        # Megatron wraps dispatch_preprocess in torch.compile: on CPU it only costs compile time
        torch._dynamo.config.disable = True
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    ps.initialize_model_parallel(expert_model_parallel_size=cfg.ep)
    model_parallel_cuda_manual_seed(cfg.seed)
    corpus = load_corpus(cfg.data_dir, cfg.corpus_bytes)
    console = None
    if rank == 0:
        from rich.console import Console

        console = Console(force_terminal=args_dict["force_terminal"], width=110)
        console.print(
            f"corpus: {corpus.numel() / 1e6:.1f} MB of Python sources under {cfg.data_dir}; "
            f"{world_size} ranks, EP {cfg.ep}, {world_size // cfg.ranks_per_node} node(s) x "
            f"{cfg.ranks_per_node}, device {device.type}"
        )
    results = train_both(cfg, corpus, device, console)
    ps.destroy_model_parallel()
    return results if rank == 0 else None


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags (see ``--help``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--ffn-hidden", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--aux-loss-coeff", type=float, default=1e-2)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument(
        "--pad-multiple",
        type=int,
        default=1,
        help="custom backend: pad expert blocks (>1 fuses the permute into dispatch)",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-every", type=int, default=25, help="print the loss every N steps")
    p.add_argument("--ranks", type=int, default=4, help="CPU world size (ignored under torchrun)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="simulated node size on CPU")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: all ranks)")
    p.add_argument("--corpus-mb", type=float, default=4.0)
    p.add_argument(
        "--data-dir",
        default=sysconfig.get_paths()["stdlib"],
        help="folder of Python sources (default: this interpreter's standard library)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="largest allowed difference of the two curves' trailing means (nats)",
    )
    p.add_argument("--smooth", type=int, default=20, help="window of the trailing means compared")
    p.add_argument(
        "--min-drop",
        type=float,
        default=0.75,
        help="final loss (mean of the last 10 steps) must be below this fraction of the initial one",
    )
    p.add_argument("--out", default="bench_results/train/")
    p.add_argument("--timeout-s", type=float, default=3600.0)
    args = p.parse_args(argv)
    return args


def main(argv=None) -> int:
    """Runs both trainings (spawned CPU world, or this torchrun process), writes the outputs and
    returns 0 when the curves agree and the loss falls, 1 otherwise, 2 on bad flags."""
    args = parse_args(argv)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.ranks
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if under_torchrun else args.ranks_per_node
    ep = args.ep or world
    if world % ep or args.experts % ep or world % local:
        print(
            f"error: need --ep ({ep}) dividing the world ({world}) and --experts ({args.experts}), and the node "
            f"size ({local}) dividing the world",
            file=sys.stderr,
        )
        return 2
    cfg = RunConfig(
        steps=args.steps,
        seq_len=args.seq_len,
        micro_batch_size=args.micro_batch_size,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        experts=args.experts,
        topk=args.topk,
        ffn_hidden=args.ffn_hidden,
        lr=args.lr,
        warmup=args.warmup,
        aux_loss_coeff=args.aux_loss_coeff,
        clip_grad=args.clip_grad,
        seed=args.seed,
        log_every=args.log_every,
        ep=ep,
        ranks_per_node=min(local, ep),
        simulated_nodes=not under_torchrun,
        corpus_bytes=int(args.corpus_mb * 1e6),
        data_dir=args.data_dir,
        pad_multiple=args.pad_multiple,
    )
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
    verdict = "PASS" if summary["curves_agree"] and summary["loss_falls"] else "FAIL"
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
    print(f"wall: total {total:.1f} s; outputs in {out}/ (loss_curves.png, losses.csv, summary.json)")
    print(f"{verdict}: curves agree {summary['curves_agree']}, loss falls {summary['loss_falls']}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
