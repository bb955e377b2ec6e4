"""What robust averaging costs when nobody attacks, and what it holds back when someone does.

Honest members' contributions are real mean gradients: a one-stage copy of the model of
configs/small.yaml (about 25M parameters) on micro-batches of the embedded corpus, each member
holding a different number of samples (1 to 4 micro-batches). A round's vector is cut into n equal
parts as an all-reduce does; each member reduces one part. Printed, per group size n, side by side
in one run:

- reducer time: a member's part reduced by the plain weighted mean and by CenteredClip
  (swarm/averaging/robust.py), median over the parts, and the ratio;
- what changed: the honest contributions CenteredClip clipped (0 means it returned the mean), and
  the largest difference from the weighted mean relative to the mean's norm (float rounding);
- under attack: one more member sends its gradient times 10**6 claiming 10**9 samples; the
  distance of each aggregate from the honest mean, relative to the honest mean's norm.

With --rounds, whole averaging rounds of real StageAveragers (bench/averaging.py's, n = 3 and 4,
stage 1 of the config) are timed with `averaging.aggregation` mean, then centered_clip.

    .venv/bin/python bench/robust.py            # n = 3, 4, 8
    .venv/bin/python bench/robust.py --quick    # n = 3, 4 on configs/tiny.yaml
    .venv/bin/python bench/robust.py --rounds   # and whole rounds (a few minutes more)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from swarm.averaging.averager import MAX_MEMBER_BATCHES
from swarm.averaging.robust import aggregate, coordinate_median, sanitize
from swarm.config import RunConfig
from swarm.data import BatchSampler, load_tokenizer, load_tokens
from swarm.model import build_stage

SCALE, CLAIM = 1e6, 1e9
MICRO_BATCHES = (1, 2, 3, 4)  # what members hold, in turn: honest weights differ up to 4x


def member_gradients(config: RunConfig, n: int, seed: int) -> tuple[list[torch.Tensor], list[float]]:
    """n honest members' mean gradients (flat) and sample counts, from real micro-batches of the corpus."""
    one_stage = RunConfig.from_dict({**config.to_dict(), "stages": {**config.to_dict()["stages"], "num_stages": 1}})
    model = build_stage(one_stage, 0)
    tokens = load_tokens(config.data, "train", load_tokenizer(config.data))
    sampler = BatchSampler(tokens, config.model.seq_len, config.optimizer.micro_batch_size, seed)
    grads, weights = [], []
    for i in range(n):
        model.zero_grad()
        samples = 0
        for _ in range(MICRO_BATCHES[i % len(MICRO_BATCHES)]):
            x, y = sampler.next_batch()
            (model(x, y) * x.shape[0]).backward()
            samples += x.shape[0]
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]) / samples)
        weights.append(float(samples))
    return grads, weights


def parts_of(vectors: list[torch.Tensor], n: int) -> list[list[torch.Tensor]]:
    """parts[j][i]: part j (reduced by member j) of member i's vector."""
    return [list(chunk) for chunk in zip(*(v.tensor_split(n) for v in vectors))]


def timed(call, repeats: int = 3) -> tuple[float, torch.Tensor]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - started)
    return min(times), result


def measure(config: RunConfig, n: int, max_weight: float) -> dict:
    grads, weights = member_gradients(config, n, seed=n)
    honest_mean = sum(g * w for g, w in zip(grads, weights)) / sum(weights)
    mean_times, clip_times, clipped, worst = [], [], 0, 0.0
    robust_parts = []
    for parts in parts_of(grads, n):
        t_mean, mean = timed(lambda parts=parts: aggregate(parts, weights, "mean"))
        t_clip, robust = timed(lambda parts=parts: aggregate(parts, weights, "centered_clip"))
        mean_times.append(t_mean)
        clip_times.append(t_clip)
        robust_parts.append(robust)
        clipped += count_clipped(parts)
        worst = max(worst, float((robust - mean).abs().max()))
    liar = grads[0] * SCALE
    attacked = []
    for method in ("mean", "centered_clip"):
        pieces = []
        for parts in parts_of(grads + [liar], n + 1):
            counted = [sanitize(p, w, max_weight) for p, w in zip(parts, weights + [CLAIM])]
            pieces.append(aggregate([p for p, _ in counted], [w for _, w in counted], method))
        attacked.append(float((torch.cat(pieces) - honest_mean).norm() / honest_mean.norm()))
    return {"n": n, "mean_ms": 1000 * statistics.median(mean_times), "clip_ms": 1000 * statistics.median(clip_times),
            "clipped": clipped, "worst": worst / float(honest_mean.abs().max()),
            "attacked_mean": attacked[0], "attacked_clip": attacked[1]}


def count_clipped(parts: list[torch.Tensor], clip_factor: float = 4.0) -> int:
    """How many contributions to a part lie beyond CenteredClip's radius (the ones it would clip)."""
    xs = torch.stack(parts)
    k = len(xs)
    if k < 3:
        return 0
    start = coordinate_median(xs)
    norms = (xs - start).norm(dim=1)
    return int((norms > clip_factor * norms.median()).sum())


def rounds(config: RunConfig, sizes: list[int], repeats: int) -> None:
    import averaging as round_bench  # bench/averaging.py, next to this file

    for n in sizes:
        results = {}
        for method in ("mean", "centered_clip"):
            base = RunConfig.from_dict({**config.to_dict(), "run_id": f"robust-{method}"})
            base.averaging.aggregation = method
            base.averaging.target_group_size = max(base.averaging.target_group_size, n)
            results[method] = round_bench.measure(base, n, repeats)["ours_round"]
        print(f"n={n}: whole round with mean {results['mean']:.2f}s, with centered_clip "
              f"{results['centered_clip']:.2f}s, ratio {results['centered_clip'] / results['mean']:.2f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="default configs/small.yaml; --quick: configs/tiny.yaml")
    p.add_argument("--sizes", type=int, nargs="+", help="group sizes (default 3 4 8; --quick: 3 4)")
    p.add_argument("--rounds", action="store_true", help="also time whole averaging rounds (n = 3, 4)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per size and method with --rounds")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    config = RunConfig.load(args.config or ("configs/tiny.yaml" if args.quick else "configs/small.yaml"))
    sizes = args.sizes or ([3, 4] if args.quick else [3, 4, 8])
    max_weight = float(MAX_MEMBER_BATCHES * config.optimizer.batch_size)
    torch.manual_seed(0)
    print(f"{args.config or 'default config'}: {config.model.n_layer} layers x {config.model.d_model}; weights capped "
          f"at {max_weight:g} samples; the liar sends its gradient x {SCALE:g} claiming {CLAIM:g} samples", flush=True)
    for n in sizes:
        r = measure(config, n, max_weight)
        print(f"n={n}: reducer time per part mean {r['mean_ms']:.1f} ms, centered_clip {r['clip_ms']:.1f} ms "
              f"(x{r['clip_ms'] / r['mean_ms']:.1f}); honest contributions clipped {r['clipped']}, largest difference "
              f"from the mean {r['worst']:.1e} of its largest value; with a liar, distance from the honest mean / "
              f"its norm: mean {r['attacked_mean']:.3g}, centered_clip {r['attacked_clip']:.3g}", flush=True)
    if args.rounds:
        rounds(config, [3, 4], args.repeats)


if __name__ == "__main__":
    main()
