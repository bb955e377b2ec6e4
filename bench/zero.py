"""Sharded optimizer state (averaging.zero) vs unsharded averaging, side by side in one run.

Every part runs real StageAveragers on n DHT peers on 127.0.0.1, each peer with its own BackgroundLoop
and P2P replica (the ProgressChannel a sharded averager requires) and holding one averager with
averaging.zero on and one with it off (the same stage, under two run ids, so the two groups never
meet). Both are fed the same gradients and stepped the same way; codec "none" for both (zero requires
it). In bytes and loss all n peers live in this one process; in time, by default, each peer is a
process of its own, as each server is in a swarm (--in-process: all in this one). Parts (--parts,
default all):

bytes  stage 1 of configs/small.yaml (~6.3M parameters; averaging.zero.chunk_elements as configured,
       or --chunk-elements: at the default 2**11, 3079 chunks),
       n = 2, 3, 4 and r = 1, 2: after one real round each, the bytes of AdamW moments every member
       holds sharded (``optimizer.shards.nbytes``) over those it holds unsharded (torch AdamW's
       ``optimizer.state_bytes()``): max and mean over the members, next to the goal 1.05 x r/n.
       Chunks are placed by rendezvous hashing, so with few chunks the max can exceed the goal.
time   the same stage, n members: rounds on random gradients (the same on both sides), medians over
       --repeats after a warm-up round each, the two sides alternating; r = 2 by default (--replicas).
       By default every member is a process of its own (multiprocessing "spawn"): its DHT peer
       (joining the first member's), loop, P2P replica, ProgressChannel and its two averagers; this
       process only sends commands over pipes. For each round every member draws its gradient sums
       from the round's seed and its index (the same on both sides), hands them to the averager and
       waits until it sees the stage's full batch and all n members; once all have, every member is
       told to step at once, and each reports its numbers. With --in-process all n members live in
       this process as in bytes (each round stepped from n threads started together on a barrier):
       then the n members' sharded collectives, which run in each server's own process (its P2P loop
       and averaging thread), share one interpreter lock, while hivemind's all-reduce runs in each
       member's forked averaging process, so this mode handicaps the sharded side; it is kept for
       comparison. Printed, the same in both modes:
       "round" is what swarm_averaging_round_seconds observes (the max over members of the delta
       of its sum; the sharded round is observed in the same histogram): for zero, flattening
       the gradient, matchmaking (hivemind forms the group) and the collective (reduce-scatter,
       norm, steps of the owned chunks, all-gather of updates); unsharded, matchmaking and
       hivemind's all-reduce. "step" is the whole step as a server's compute thread sees it: from
       handing the batch to the round (StageAverager.step()) until the step that applies it
       returned (the max over members). Goal: zero / unsharded <= 1.1. Also: when the group formed
       after the last member joined (swarm_averaging_round_start_seconds, the min over members),
       what each member sent (zero: the tensors' bytes it sent, measured; unsharded: the
       swarm_averaging_bytes_sent estimate, 2(n-1)/n x the gradient), the largest parameter
       difference between the two sides after the same rounds (zero is exact AdamW, so it should be
       at float rounding level; each member compares its own two replicas), and whether the members'
       replicas of each side agree after every round (the sum and the sum of squares of their
       parameters, in float64: "identical", or how far apart, relative; the unsharded side differs
       at float rounding level, hivemind's all-reduce not giving every member the same bits).
       Only with members in processes, a "cpu" line: the CPU seconds one member used during its
       whole step in its own process (all threads: the compute thread, the P2P loop, the sharded
       collective, AdamW) and in the processes under it (the p2p daemon, which relays every message,
       and hivemind's DHT and averaging processes, where the unsharded all-reduce runs); mean over
       members, median over rounds. n x (the two numbers' sum) / the machine's cores bounds the whole
       step's time from below; on 2 cores both sides are CPU-bound.
       Caveat: zero sends (r+1)(n-1)/n x the gradient (every owner of a chunk gets every member's
       gradient, so co-owners can cross-check the primary), i.e. more than the all-reduce when r > 1.
       A round that fails (either side) is reported and the pair measured once more on fresh groups;
       a member process that dies or does not answer within REPLY_TIMEOUT fails that n.
loss   configs/tiny.yaml as one stage (the whole ~0.87M-parameter model, num_stages = 1; 423 chunks at
       2**11), n = 2, 3 (--loss-sizes; --quick: 2) servers, r = 2, batch = n x micro-batch: each step every
       server gets one micro-batch of real data (the stdlib corpus, the same micro-batches for both
       sides), computes its gradient on its own replica, and the group takes one step; after --steps
       steps, the validation loss (ReferenceTrainer's windows) of member 0's parameters, zero /
       unsharded (goal <= 1.01). Beside it, a single StageOptimizer fed every micro-batch (the exact
       math both sides should follow), the training-loss trajectories, and how far apart the
       parameters are (max abs after each step, relative L2 at the end). Both sides follow the
       reference to float rounding (~1e-6) until tiny's loss spikes (n = 3: a gradient norm of ~120
       at step 14, just after the warm-up reached lr 3e-3); from there rounding differences grow to
       ~1e-2, the unsharded side's as much as zero's, so past that step the ratio measures that
       chaos as much as zero: compare it with unsharded/reference, printed beside it. (n = 2 drifts
       apart from about step 16 too.) A failed round restarts that n's training on fresh groups once.

    .venv/bin/python bench/zero.py                  # n = 2, 3, 4; 3 timed rounds; loss n = 2, 3, 30 steps
    .venv/bin/python bench/zero.py --quick          # n = 2, 3; 1 timed round; loss n = 2, 10 steps
    .venv/bin/python bench/zero.py --parts bytes time --replicas 1 2
    .venv/bin/python bench/zero.py --parts time --in-process   # time with every member in this process
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from zero_apart import measure_stage_apart
from zero_rig import (
    ATTEMPTS,
    DRIFT,
    LOSS_REPLICAS,
    MB,
    PARTS,
    STAGE,
    Peer,
    Replica,
    alternating,
    derived,
    flatten,
    group,
    max_diff,
    max_param_diff,
    medians,
    one_round,
    random_grads,
    running_peers,
)

from swarm.config import RunConfig
from swarm.data import BatchSampler, eval_batches, load_tokenizer, load_tokens, sampler_seed
from swarm.logs import setup_logging
from swarm.model import build_stage
from swarm.optim import StageOptimizer
from swarm.reference import EVAL_BATCHES


# bytes and time
def measure_stage(base: RunConfig, n: int, replica_counts: list[int], timed: set[int], repeats: int,
                  do_bytes: bool) -> Iterator[dict]:
    """Per r, the bytes and times of n members (fresh groups per r; a failed round is retried once with fresh
    groups, after saying so: a round that failed leaves the replicas apart)."""
    with running_peers(f"zerobench-n{n}", n) as peers:
        for r in replica_counts:
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    yield measure_pair(base, peers, r, r in timed, repeats, do_bytes, f"a{attempt}")
                    break
                except Exception as e:  # noqa: BLE001 - say so, then retry or give up on this r
                    print(f"n={n} r={r}: attempt {attempt} of {ATTEMPTS} FAILED: {type(e).__name__}: {e}", flush=True)


def measure_pair(base: RunConfig, peers: list[Peer], r: int, timed: bool, repeats: int, do_bytes: bool,
                 tag: str) -> dict:
    """An unsharded and a sharded (r replicas) group on the same peers, fed the same gradients."""
    n = len(peers)
    with contextlib.ExitStack() as stack:
        plain = group(peers, derived(base, f"zerobench-n{n}-r{r}-{tag}-plain", zero=False), STAGE, stack)
        zero = group(peers, derived(base, f"zerobench-n{n}-r{r}-{tag}-zero", zero=True, replicas=r), STAGE, stack)
        sides = {"plain": plain, "zero": zero}
        each = -(-base.optimizer.batch_size // n)  # the group holds a full batch between them
        samples = [each] * n
        generator = torch.Generator().manual_seed(1000 * n + r)
        grads = random_grads(plain, generator)  # warm-up: connections, first allocations
        spreads = {"plain": [one_round(plain, grads, samples, f"unsharded n={n} warm-up")["spread"]],
                   "zero": [one_round(zero, grads, samples, f"zero n={n} r={r} warm-up")["spread"]]}
        result: dict = {"n": n, "r": r, "chunks": zero[0].averager.optimizer.shards.layout.num_chunks}
        if do_bytes:
            result.update(held_bytes(plain, zero))
        if timed:
            runs: dict[str, list[dict]] = {"plain": [], "zero": []}
            for i in range(repeats):
                grads = random_grads(plain, generator)
                for name in alternating(i):
                    runs[name].append(one_round(sides[name], grads, samples, f"{name} n={n} r={r}"))
                    spreads[name].append(runs[name][-1]["spread"])
            result.update(medians(runs))
        result["param_diff"] = max(max_param_diff(p, z) for p, z in zip(plain, zero))
        result["zero_torch_state_bytes"] = max(z.averager.optimizer.state_bytes() for z in zero)
        result.update({f"{name}_spread": max(values) for name, values in spreads.items()})
        return result



def held_bytes(plain: list[Replica], zero: list[Replica]) -> dict:
    unsharded = [p.averager.optimizer.state_bytes() for p in plain]
    sharded = [z.averager.optimizer.shards.nbytes for z in zero]
    gauges = [z.metric("swarm_optimizer_state_bytes") for z in zero]
    ratios = [s / u for s, u in zip(sharded, unsharded)]
    return {"unsharded_bytes": unsharded, "sharded_bytes": sharded, "ratios": ratios, "max_ratio": max(ratios),
            "mean_ratio": statistics.mean(ratios),
            "chunks_held": [len(z.averager.optimizer.shards.chunks) for z in zero],
            "gauge_matches": gauges == [float(s) for s in sharded]}


# loss
@torch.no_grad()
def val_loss(module: torch.nn.Module, tokens: torch.Tensor, config: RunConfig) -> float:
    """Mean validation loss over ReferenceTrainer's fixed windows."""
    module.eval()
    total, count = 0.0, 0
    try:
        for x, y in eval_batches(tokens, config.model.seq_len, config.optimizer.micro_batch_size, EVAL_BATCHES):
            total += module(x, targets=y).item() * x.shape[0]
            count += x.shape[0]
    finally:
        module.train()
    return total / count


def grads_on(replica: Replica, x: torch.Tensor, y: torch.Tensor) -> tuple[list[torch.Tensor], float]:
    """Gradient sums of one micro-batch on the replica's own parameters (as a server's backward), and its loss."""
    loss = replica.module(x, targets=y)
    grads = torch.autograd.grad(loss * x.shape[0], replica.params)
    return list(grads), float(loss.detach())


def measure_loss(base: RunConfig, n: int, steps: int, tag: str) -> dict:
    base = RunConfig.from_dict(base.to_dict())
    base.stages.num_stages = 1  # the whole model is the one stage: its validation loss needs nothing else
    micro = base.optimizer.micro_batch_size
    tokenizer = load_tokenizer(base.data)
    train = load_tokens(base.data, "train", tokenizer)
    val = load_tokens(base.data, "val", tokenizer)
    sampler = BatchSampler(train, base.model.seq_len, micro, seed=sampler_seed(base.data.seed, 0))
    plain_config = derived(base, f"zerobench-loss-n{n}-{tag}-plain", zero=False, batch_size=n * micro)
    zero_config = derived(base, f"zerobench-loss-n{n}-{tag}-zero", zero=True, replicas=LOSS_REPLICAS,
                          batch_size=n * micro)
    # the exact math both should follow: one StageOptimizer on all the micro-batches (as test_zero.py checks)
    reference = StageOptimizer(build_stage(plain_config, 0), plain_config.optimizer)
    result: dict = {"n": n, "steps": steps, "batch_size": n * micro, "r": LOSS_REPLICAS}
    with running_peers(f"zerobench-loss-n{n}-{tag}", n) as peers, contextlib.ExitStack() as stack:
        sides = {"plain": group(peers, plain_config, 0, stack), "zero": group(peers, zero_config, 0, stack)}
        result["chunks"] = sides["zero"][0].averager.optimizer.shards.layout.num_chunks
        result["initial_val"] = val_loss(reference.module, val, base)
        losses: dict[str, list[float]] = {"plain": [], "zero": [], "reference": []}
        rounds: dict[str, list[float]] = {"plain": [], "zero": []}
        drift: dict[str, list[float]] = {"zero-plain": [], "plain-reference": [], "zero-reference": []}
        norms = []
        for step in range(steps):
            batches = [sampler.next_batch() for _ in range(n)]  # one micro-batch per server, the same on every side
            for name, side in sides.items():
                computed = [grads_on(r, x, y) for r, (x, y) in zip(side, batches)]
                losses[name].append(statistics.mean(loss for _, loss in computed))
                timing = one_round(side, [g for g, _ in computed], [micro] * n, f"{name} step {step + 1}")
                rounds[name].append(timing["round"])
            mine = []
            for x, y in batches:
                loss = reference.module(x, targets=y)
                (loss * x.shape[0]).backward()
                reference.add_samples(x.shape[0])
                mine.append(float(loss.detach()))
            losses["reference"].append(statistics.mean(mine))
            norms.append(reference.step()["grad_norm"])
            plain, zero = sides["plain"][0].params, sides["zero"][0].params
            for key, (one, other) in {"zero-plain": (zero, plain), "plain-reference": (plain, reference.params),
                                      "zero-reference": (zero, reference.params)}.items():
                drift[key].append(max_diff(one, other))
        for name, side in sides.items():
            result[f"{name}_val"] = val_loss(side[0].module, val, base)
            result[f"{name}_round"] = statistics.median(rounds[name])
            result[f"{name}_in_sync"] = max(max_param_diff(side[0], r) for r in side[1:])
            result[f"{name}_steps"] = [r.averager.step_count for r in side]
        result["reference_val"] = val_loss(reference.module, val, base)
        flat = {"plain": flatten(sides["plain"][0].params), "zero": flatten(sides["zero"][0].params),
                "reference": flatten(reference.params)}
        for key in drift:
            one, other = key.split("-")
            result[f"rel_l2 {key}"] = float((flat[one] - flat[other]).norm() / flat[other].norm())
    result.update({"train": losses, "drift": drift, "reference_grad_norms": norms})
    return result



# printing
def report_stage(r: dict, timed: bool) -> None:
    n, reps = r["n"], r["r"]
    if "ratios" in r:
        goal = 1.05 * min(reps, n) / n
        ok = "yes" if r["max_ratio"] <= goal else "NO"
        print(f"bytes n={n} r={reps}: sharded/unsharded per member "
              f"[{', '.join(f'{x:.3f}' for x in r['ratios'])}], max {r['max_ratio']:.3f}, mean {r['mean_ratio']:.3f}; "
              f"goal 1.05 x r/n = {goal:.3f}: max <= goal {ok} (chunks held {r['chunks_held']} of {r['chunks']}; "
              f"unsharded {r['unsharded_bytes'][0] / MB:.1f} MB each; "
              f"swarm_optimizer_state_bytes gauge {'matches' if r['gauge_matches'] else 'DIFFERS'})", flush=True)
    if timed:
        ratio, step_ratio = r["zero_round"] / r["plain_round"], r["zero_step"] / r["plain_step"]
        print(f"time n={n} r={reps}: round zero {r['zero_round']:.3f}s, unsharded {r['plain_round']:.3f}s, "
              f"zero/unsharded {ratio:.2f} (goal <= 1.1: {'yes' if ratio <= 1.1 else 'NO'}); "
              f"whole step zero {r['zero_step']:.3f}s, unsharded {r['plain_step']:.3f}s, "
              f"zero/unsharded {step_ratio:.2f}; matchmaking (group formed after the last member joined): "
              f"zero {r['zero_formed'] * 1000:.0f} ms (it forms in the round: sharded rounds do not form ahead), "
              f"unsharded {r['plain_formed'] * 1000:.0f} ms (formed ahead); the rest of the round (collective / "
              f"all-reduce): zero {r['zero_round'] - r['zero_formed']:.3f}s, unsharded "
              f"{r['plain_round'] - r['plain_formed']:.3f}s, zero/unsharded "
              f"{(r['zero_round'] - r['zero_formed']) / (r['plain_round'] - r['plain_formed']):.2f}; "
              f"sent per member: zero {r['zero_sent'] / MB:.1f} MB "
              f"(measured), unsharded {r['plain_sent'] / MB:.1f} MB (estimate)", flush=True)
    if timed and "zero_cpu_own" in r:
        print(f"cpu n={n} r={reps}: per member during its whole step (mean over members, median over rounds): "
              f"zero {r['zero_cpu_own']:.2f}s in its process + {r['zero_cpu_children']:.2f}s in the processes under "
              f"it, unsharded {r['plain_cpu_own']:.2f}s + {r['plain_cpu_children']:.2f}s "
              f"(under it: its p2p daemon, its DHT's and averagers' processes)", flush=True)
    print(f"check n={n} r={reps}: max |param zero - param unsharded| after the same rounds {r['param_diff']:.2e}; "
          f"members' replicas (parameter sum, sum of squares) after every round: zero {agree(r['zero_spread'])}, "
          f"unsharded {agree(r['plain_spread'])}; "
          f"torch AdamW state on the zero side {r['zero_torch_state_bytes']} bytes", flush=True)


def agree(spread: float) -> str:
    return "identical" if spread == 0 else f"differ by {spread:.1e} (relative)"


def report_loss(r: dict) -> None:
    ratio = r["zero_val"] / r["plain_val"]
    train, drift, last = r["train"], r["drift"], min(5, r["steps"])

    def apart(key: str) -> str:
        """The last step's largest parameter difference, and the first step after which it exceeded DRIFT."""
        step = next((i + 1 for i, d in enumerate(drift[key]) if d > DRIFT), None)
        name = key.replace("plain", "unsharded")
        return f"{name} {drift[key][-1]:.1e} (> {DRIFT:g} from step {step})" if step else \
            f"{name} {drift[key][-1]:.1e} (<= {DRIFT:g} throughout)"

    norms = r["reference_grad_norms"]
    spike = max(range(len(norms)), key=norms.__getitem__)
    print(f"loss n={r['n']} (configs tiny as one stage, {r['chunks']} chunks, r={r['r']}, batch {r['batch_size']}, "
          f"{r['steps']} steps): validation loss zero {r['zero_val']:.5f}, unsharded {r['plain_val']:.5f}, "
          f"one-optimizer reference {r['reference_val']:.5f} (initial {r['initial_val']:.4f}); "
          f"zero/unsharded {ratio:.5f} (goal <= 1.01: {'yes' if ratio <= 1.01 else 'NO'}), "
          f"zero/reference {r['zero_val'] / r['reference_val']:.5f}, "
          f"unsharded/reference {r['plain_val'] / r['reference_val']:.5f}", flush=True)
    print(f"  train loss: first {train['reference'][0]:.4f}; mean of the last {last}: zero "
          f"{statistics.mean(train['zero'][-last:]):.4f}, unsharded {statistics.mean(train['plain'][-last:]):.4f}, "
          f"reference {statistics.mean(train['reference'][-last:]):.4f}; max |zero - unsharded| over the steps "
          f"{max(abs(a - b) for a, b in zip(train['zero'], train['plain'])):.2e}; largest reference grad norm "
          f"{norms[spike]:.1f} at step {spike + 1}", flush=True)
    print(f"  parameters, max |difference| after the last step: {apart('zero-plain')}, {apart('zero-reference')}, "
          f"{apart('plain-reference')}; relative L2: zero-unsharded {r['rel_l2 zero-plain']:.2e}, zero-reference "
          f"{r['rel_l2 zero-reference']:.2e}, unsharded-reference {r['rel_l2 plain-reference']:.2e}", flush=True)
    print(f"  replicas in sync (max |p_i - p_0|): zero {r['zero_in_sync']:.1e}, unsharded {r['plain_in_sync']:.1e}; "
          f"steps per member zero {r['zero_steps']}, unsharded {r['plain_steps']}; median round zero "
          f"{r['zero_round']:.3f}s, unsharded {r['plain_round']:.3f}s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--config", default="configs/small.yaml", help="bytes and time: its stage 1")
    p.add_argument("--loss-config", default="configs/tiny.yaml", help="loss: the whole model as one stage")
    p.add_argument("--sizes", type=int, nargs="+", help="group sizes for bytes and time (default 2 3 4; --quick: 2 3)")
    p.add_argument("--replicas", type=int, nargs="+", default=[2], help="r of the timed rounds (default 2)")
    p.add_argument("--repeats", type=int, help="timed rounds of each side per size (default 3; --quick: 1)")
    p.add_argument("--loss-sizes", type=int, nargs="+", help="servers in the loss part (default 2 3; --quick: 2)")
    p.add_argument("--steps", type=int, help="steps of the loss part (default 30; --quick: 10)")
    p.add_argument("--chunk-elements", type=int, help="averaging.zero.chunk_elements (default: the configs')")
    p.add_argument("--in-process", action="store_true",
                   help="time: all members in this one process (default: each in a process of its own)")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="time, members in processes: torch.set_num_threads in each (default: torch's own)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", help="also write every result here")
    args = p.parse_args()
    setup_logging("WARNING")
    sizes = args.sizes or ([2, 3] if args.quick else [2, 3, 4])
    repeats = args.repeats or (1 if args.quick else 3)
    steps = args.steps or (10 if args.quick else 30)
    loss_sizes = args.loss_sizes or ([2] if args.quick else [2, 3])
    started = time.monotonic()
    out: dict = {"stage": [], "loss": []}
    if "bytes" in args.parts or "time" in args.parts:
        base = RunConfig.load(args.config)
        if args.chunk_elements:
            base.averaging.zero.chunk_elements = args.chunk_elements
        base.averaging.target_group_size = max(base.averaging.target_group_size, max(sizes))
        timed = set(args.replicas) if "time" in args.parts else set()
        in_process = timed if args.in_process else set()  # timed here, with the bytes; else in member processes
        replica_counts = sorted(({1, 2} if "bytes" in args.parts else set()) | in_process)
        params = sum(p.numel() for p in build_stage(base, STAGE).parameters())
        where = "members in this one process" if args.in_process else "members in separate processes"
        print(f"{args.config}: stage {STAGE} has {params / 1e6:.2f}M parameters; chunks of "
              f"{base.averaging.zero.chunk_elements} elements; codec none; "
              + (f"medians of {repeats} timed rounds, r in {sorted(timed)}, {where}" if timed else "no timing"),
              flush=True)
        for n in sizes:
            try:
                if replica_counts:
                    for r in measure_stage(base, n, replica_counts, in_process, repeats, "bytes" in args.parts):
                        report_stage(r, r["r"] in in_process)
                        out["stage"].append(r)
                if timed and not args.in_process:
                    for r in measure_stage_apart(base, n, sorted(timed), repeats, args.torch_threads):
                        report_stage(r, True)
                        out["stage"].append(r)
            except Exception as e:  # noqa: BLE001 - say so, go on with the next size
                print(f"n={n}: FAILED: {type(e).__name__}: {e}", flush=True)
    if "loss" in args.parts:
        base = RunConfig.load(args.loss_config)
        if args.chunk_elements:
            base.averaging.zero.chunk_elements = args.chunk_elements
        base.averaging.target_group_size = max(base.averaging.target_group_size, max(loss_sizes))
        for n in loss_sizes:
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    r = measure_loss(base, n, steps, f"a{attempt}")
                except Exception as e:  # noqa: BLE001 - say so, then train again from the start on fresh groups
                    print(f"loss n={n}: attempt {attempt} of {ATTEMPTS} FAILED: {type(e).__name__}: {e}", flush=True)
                    continue
                report_loss(r)
                out["loss"].append(r)
                break
    print(f"done in {time.monotonic() - started:.0f}s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=float) + "\n")


if __name__ == "__main__":
    main()
