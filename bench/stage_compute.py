"""One stage's compute: plain PyTorch vs the server's per-micro-batch path, side by side in one run.

    plain     the stage module, forward + backward, data already on the device, in the compute dtype
              (autocast; float32 weights), gradients accumulating
    server    StageBackend as a request sees it: input on the host, forward_at (graph kept), backward
              from the kept graph, output and input gradient back on the host
    recompute the same without the activation cache: the backward runs the forward again (what the
              server did before the cache)
    compiled  (--compile) plain, through torch.compile: whether compiling a stage would pay

Stage 0 of 2 of each shape (embedding and half the blocks), built by `build_stage`. Timings are
interleaved (plain, server, recompute, plain, ...) so a change in the machine's load hits all three;
the figure of merit is the median of server / plain.

    .venv/bin/python bench/stage_compute.py                                   # CPU: configs/small.yaml, float32
    .venv/bin/python bench/stage_compute.py --device cuda --shapes small large   # GPU: bfloat16 by default
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from swarm.activations import ActivationCache
from swarm.backend import StageBackend, autocast, resolve_compute_dtype
from swarm.config import RunConfig
from swarm.model import build_stage
from swarm.optim import StageOptimizer

ROOT = Path(__file__).resolve().parent.parent
GOALS = {"cpu": 0.95, "cuda": 0.9}  # server / plain, from the issue


def shape_config(name: str) -> RunConfig:
    config = RunConfig.load(ROOT / "configs" / "small.yaml")
    if name == "large":  # the second shape: d_model 2048, 4 blocks per stage, seq 1024, micro-batch 8
        config.model.d_model, config.model.n_head, config.model.n_layer, config.model.seq_len = 2048, 16, 8, 1024
        config.optimizer.micro_batch_size = 8
    elif name != "small":
        raise SystemExit(f"unknown shape {name!r}: small or large")
    config.stages.num_stages = 2
    config.optimizer.batch_size = 1 << 30  # never step: this measures compute, not the optimizer
    return config.validate()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Plain:
    """The stage as a single-process trainer would run it (`compiled`: through torch.compile)."""

    def __init__(self, config: RunConfig, device: torch.device, dtype: torch.dtype, x: torch.Tensor,
                 grad: torch.Tensor, compiled: bool = False):
        self.module = build_stage(config, 0).to(device)
        if compiled:  # the blocks, where the compute is; the input checks would break the graph anyway
            for block in self.module.blocks:
                block.compile()
        self.device, self.dtype = device, dtype
        self.x, self.grad = x.to(device), grad.to(device)

    def __call__(self) -> None:
        with autocast(self.device, self.dtype):
            out = self.module(self.x)
        out.backward(self.grad)


class Server:
    """The stage as StageBackend serves one micro-batch: host tensors in, host tensors out."""

    def __init__(self, config: RunConfig, device: torch.device, dtype: torch.dtype, x: torch.Tensor,
                 grad: torch.Tensor, cache: bool):
        module = build_stage(config, 0)
        self.backend = StageBackend(module, StageOptimizer(module, config.optimizer), device, compute_dtype=dtype,
                                    cache=ActivationCache(1 << 40) if cache else None)
        self.x, self.grad, self.count = x, grad, 0
        self.cache = cache

    def __call__(self) -> None:
        self.count += 1
        key = ("bench", str(self.count)) if self.cache else None
        out, step = self.backend.forward_at(self.x, keep=key)
        result = self.backend.backward(self.x, self.grad, forward_step=step, key=key)
        assert result.cached == self.cache, "the kept graph was not used" if self.cache else "a graph was kept"


def time_once(fn, device: torch.device) -> float:
    sync(device)
    started = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - started


def check_gradients(config: RunConfig, device: torch.device, dtype: torch.dtype, x: torch.Tensor,
                    grad: torch.Tensor) -> float:
    """Largest |server gradient - plain gradient| / max |plain gradient| over the stage's parameters,
    one micro-batch each: the server path must compute the same thing, not just fast."""
    plain = Plain(config, device, dtype, x, grad)
    server = Server(config, device, dtype, x, grad, cache=True)
    plain()
    server()
    worst = 0.0
    for p, q in zip(server.backend.optimizer.params, plain.module.parameters()):
        scale = float(q.grad.abs().max()) or 1.0
        worst = max(worst, float((p.grad - q.grad).abs().max()) / scale)
    return worst


def measure(shape: str, device: torch.device, dtype: torch.dtype, repeats: int, warmup: int,
            compiled: bool = False) -> dict:
    config = shape_config(shape)
    m, n = config.model, config.optimizer.micro_batch_size
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, m.vocab_size, (n, m.seq_len), generator=generator)
    grad = torch.randn(n, m.seq_len, m.d_model, generator=generator)
    mismatch = check_gradients(config, device, dtype, x, grad)
    runners = {"plain": Plain(config, device, dtype, x, grad),
               "server": Server(config, device, dtype, x, grad, cache=True),
               "recompute": Server(config, device, dtype, x, grad, cache=False)}
    if compiled:  # whether torch.compile pays for this stage: plain compiled / plain
        runners["compiled"] = Plain(config, device, dtype, x, grad, compiled=True)
    params = sum(p.numel() for p in runners["plain"].module.parameters())
    for _ in range(warmup):
        for fn in runners.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, fn in runners.items():
            times[name].append(time_once(fn, device))
    # each round's ratio: the three ran one after the other, under the same load
    ratios = {name: statistics.median(p / t for p, t in zip(times["plain"], times[name]))
              for name in runners if name != "plain"}
    median = {name: statistics.median(ts) for name, ts in times.items()}
    flops = 6 * params * n * m.seq_len  # forward + backward, as the issue counts them
    return {
        "shape": shape, "device": str(device), "dtype": str(dtype).removeprefix("torch."), "params": params,
        "micro_batch": n, "seq_len": m.seq_len, "d_model": m.d_model,
        "samples_per_second": {name: n / t for name, t in median.items()},
        "tflops": {name: flops / t / 1e12 for name, t in median.items()},
        "ratio_server": ratios["server"], "ratio_recompute": ratios["recompute"],
        "ratio_compiled": ratios.get("compiled"),
        "gradient_mismatch": mismatch, "repeats": repeats,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", help="compute dtype: auto (bfloat16 on CUDA), float32 or bfloat16")
    p.add_argument("--shapes", nargs="+", default=["small"], help="small (configs/small.yaml) and/or large")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="also time the plain stage under torch.compile")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = resolve_compute_dtype(args.dtype, device)
    goal = GOALS.get(device.type)
    results = []
    for shape in args.shapes:
        r = measure(shape, device, dtype, args.repeats, args.warmup, args.compile)
        results.append(r)
        sps, tf = r["samples_per_second"], r["tflops"]
        print(f"{shape} stage ({r['params'] / 1e6:.1f}M params, micro-batch {r['micro_batch']} x seq {r['seq_len']}, "
              f"{r['dtype']} on {r['device']}): plain {sps['plain']:.1f} samples/s ({tf['plain']:.2f} TFLOP/s), "
              f"server {sps['server']:.1f}, recompute {sps['recompute']:.1f}; "
              f"server / plain {r['ratio_server']:.3f} (goal >= {goal}), recompute / plain {r['ratio_recompute']:.3f}; "
              f"gradient mismatch {r['gradient_mismatch']:.1e}", flush=True)
        if r["ratio_compiled"] is not None:
            print(f"  torch.compile: plain compiled {sps['compiled']:.1f} samples/s, compiled / plain "
                  f"{r['ratio_compiled']:.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
