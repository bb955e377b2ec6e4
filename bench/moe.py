"""MoE benchmarks on configs/moe.yaml, in parts (--part, default dense):

dense  MoE vs dense, with the same parameters active per token and the same samples: the reference
       trainer, side by side (below).
swarm  the MoE swarm (experts on expert servers, swarm-local) vs the MoE reference trainer: validation
       loss after the same steps (goal: swarm / reference <= 1.03) and samples/s of each
       (bench/moe_swarm.py says how).
churn  training with one of 4 expert servers SIGKILLed (and replaced) every 30 s vs undisturbed:
       samples/s (goal: churn / no churn >= 0.8), trainer crashes (goal 0), failed and lost expert
       calls (bench/moe_churn.py says how; also runnable by itself).
all    the three, one after the other.

dense:

    moe    the config as given (configs/moe.yaml: 8 experts of hidden 256, top 2, in blocks 1 and 3)
    dense  the same config without model.moe: every block has the dense MLP (configs/moe.yaml's dense
           twin is configs/tiny.yaml, whose MLP hidden size 512 = top_k x expert_hidden)

Both single-process reference trainers (swarm.reference) start from the same seed and draw the same
micro-batches (same sampler seed and micro-batch size), and their steps are interleaved (moe,
dense, moe, ...) so a change in the machine's load hits both. Printed for each: parameters in all
and active per token (those outside experts, plus top_k experts of each MoE block), the training
loss (cross-entropy, the mean of the last 5 steps), the validation loss on the same windows, and
training samples/s; for MoE also its aux loss (summed over its MoE blocks; 1 per block when
balanced) and the share of top-k slots dropped by capacity. The MoE loss is the cross-entropy alone,
comparable with the dense one; the aux term is only in its objective.

Run times measured on 2 cores (the swarm and churn parts print their own run time; "others" is
what other programs on the machine took meanwhile, which both print):

    .venv/bin/python bench/moe.py                     # dense: 120 steps (25-70 s)
    .venv/bin/python bench/moe.py --steps 30 --json /tmp/moe-bench.json
    .venv/bin/python bench/moe.py --part swarm        # 100 steps: 110-123 s (184 s on a busy machine)
    .venv/bin/python bench/moe.py --part swarm --quick          # 30 steps: 125 s on a busy machine
    .venv/bin/python bench/moe.py --part churn --quick          # 2000 samples per run, a kill every 12 s:
                                                                # 387-418 s
    .venv/bin/python bench/moe.py --part churn        # 4800 samples per run, a kill every 30 s: 753 s
                                                      # (833 s on a busy machine)
    .venv/bin/python bench/moe.py --part all          # the three: about 16 minutes

--part all --quick runs dense at 120 steps, swarm and churn quick (about 10 minutes). --log-dir keeps
the swarm and churn programs' logs (one folder per part with --part all); --json writes every
part's figures (--part dense: what it always wrote).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import moe_churn
import moe_swarm
from moe_churn import add_arguments as add_churn_arguments

from swarm.config import RunConfig
from swarm.model import MoEFeedForward
from swarm.reference import FINAL_LOSS_WINDOW, ReferenceTrainer

ROOT = Path(__file__).resolve().parent.parent


def parameter_counts(trainer: ReferenceTrainer, top_k: int) -> tuple[int, int]:
    """(all parameters, parameters active for one token: experts count top_k per MoE block)."""
    experts_apart = sum(p.numel() for e in trainer.experts for p in e.parameters())  # model.moe.expert_servers
    total = sum(p.numel() for stage in trainer.stages for p in stage.parameters()) + experts_apart
    active = total
    blocks = [m for stage in trainer.stages for m in stage.modules() if isinstance(m, MoEFeedForward)]
    for module in blocks:
        experts = module.experts if module.experts is not None else trainer.experts[:module.num_experts]
        size = sum(p.numel() for p in experts[0].parameters())  # experts are all one size
        active -= (module.num_experts - top_k) * size
    return total, active


def measure(config: RunConfig, steps: int, eval_batches: int) -> dict:
    if config.model.moe is None:
        raise SystemExit("the config has no model.moe section: nothing to compare")
    dense_config = copy.deepcopy(config)
    dense_config.model.moe = None
    dense_config.validate()
    trainers = {"moe": ReferenceTrainer(config), "dense": ReferenceTrainer(dense_config)}
    seconds = {name: 0.0 for name in trainers}
    history: dict[str, list[dict]] = {name: [] for name in trainers}
    for _ in range(steps):
        for name, trainer in trainers.items():
            started = time.perf_counter()
            history[name].append(trainer.train_step())
            seconds[name] += time.perf_counter() - started
    results = {}
    for name, trainer in trainers.items():
        stats = history[name]
        total, active = parameter_counts(trainer, config.model.moe.top_k)
        last = stats[-FINAL_LOSS_WINDOW:]
        r = {
            "params": total,
            "active_params": active,
            "initial_loss": stats[0]["loss"],
            "final_loss": sum(s["loss"] for s in last) / len(last),
            "val_loss": trainer.evaluate(eval_batches),
            "samples": sum(s["samples"] for s in stats),
            "train_seconds": seconds[name],
        }
        r["samples_per_second"] = r["samples"] / seconds[name]
        if "aux_loss" in stats[0]:
            r["initial_aux_loss"] = stats[0]["aux_loss"]
            r["final_aux_loss"] = sum(s["aux_loss"] for s in last) / len(last)
            r["dropped"] = sum(s["dropped"] for s in stats) / len(stats)
        results[name] = r
    moe = config.model.moe
    return {"config": {"n_layer": config.model.n_layer, "d_model": config.model.d_model,
                       "num_stages": config.stages.num_stages, "moe_layers": config.model.moe_layers(),
                       "num_experts": moe.num_experts, "top_k": moe.top_k, "expert_hidden": config.model.expert_hidden,
                       "dense_hidden": config.model.mlp_ratio * config.model.d_model,
                       "capacity_factor": moe.capacity_factor, "aux_loss_weight": moe.aux_loss_weight,
                       "batch_size": config.optimizer.batch_size,
                       "micro_batch_size": config.optimizer.micro_batch_size},
            "steps": steps, **results,
            "val_loss_ratio": results["moe"]["val_loss"] / results["dense"]["val_loss"],
            "speed_ratio": results["moe"]["samples_per_second"] / results["dense"]["samples_per_second"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["dense", "swarm", "churn", "all"], default="dense",
                   help="what to measure (default dense: MoE vs dense reference trainers)")
    p.add_argument("--config", default=str(ROOT / "configs" / "moe.yaml"))
    p.add_argument("--quick", action="store_true", help="swarm: 30 steps; churn: fewer samples, a kill every 12 s")
    p.add_argument("--steps", type=int, help="dense: steps (default 120); swarm: steps (default 100, 30 with --quick)")
    p.add_argument("--eval-batches", type=int, default=20, help="dense: validation micro-batches (the same windows "
                   "for both)")
    p.add_argument("--expert-servers", type=int, default=2, help="swarm: expert servers of swarm-local (default 2)")
    add_churn_arguments(p)
    p.add_argument("--log-dir", help="swarm, churn: keep the programs' logs here (default: a temporary directory)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    parts = ["dense", "swarm", "churn"] if args.part == "all" else [args.part]
    out = {}
    for part in parts:
        logs = args.log_dir if args.log_dir is None or len(parts) == 1 else str(Path(args.log_dir) / part)
        started = time.monotonic()
        if part == "dense":
            out[part] = r = measure(RunConfig.load(args.config), args.steps or 120, args.eval_batches)
            report_dense(args.config, r)
        elif part == "swarm":
            out[part] = r = moe_swarm.measure(args.config, args.steps or (30 if args.quick else 100),
                                              args.expert_servers, logs)
            moe_swarm.report(r)
        else:
            every, samples = moe_churn.defaults(args)
            out[part] = r = moe_churn.run(args.config, every, samples, args.in_flight, log_dir=logs)
            moe_churn.report(r)
        if parts != ["dense"]:  # --part dense prints what it always printed
            print(f"({part}: {time.monotonic() - started:.0f} s)\n", flush=True)
    if args.json:
        result = out["dense"] if parts == ["dense"] else out  # --part dense writes what it always wrote
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")


def report_dense(config_path: str, r: dict) -> None:
    c = r["config"]
    print(f"{config_path}: {c['n_layer']} blocks x d_model {c['d_model']}, MoE blocks {c['moe_layers']} with "
          f"top {c['top_k']} of {c['num_experts']} experts (hidden {c['expert_hidden']}) vs dense MLP hidden "
          f"{c['dense_hidden']}; {r['steps']} steps of {c['batch_size']} samples each", flush=True)
    for name in ("moe", "dense"):
        s = r[name]
        extra = ""
        if "final_aux_loss" in s:
            extra = (f"; aux loss {s['initial_aux_loss']:.3f} -> {s['final_aux_loss']:.3f}, "
                     f"{100 * s['dropped']:.1f}% of slots dropped")
        print(f"  {name:5s} {s['params'] / 1e6:.2f}M params ({s['active_params'] / 1e6:.2f}M active per token): "
              f"train loss {s['initial_loss']:.3f} -> {s['final_loss']:.3f}, val loss {s['val_loss']:.4f}, "
              f"{s['samples_per_second']:.1f} samples/s{extra}", flush=True)
    print(f"  moe / dense: val loss {r['val_loss_ratio']:.3f}, samples/s {r['speed_ratio']:.3f}", flush=True)


if __name__ == "__main__":
    main()
