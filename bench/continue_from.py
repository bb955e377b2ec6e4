"""Continue exact training from a swarm's checkpoint: is the swarm's state on a worse path than exact training's?

A swarm's validation loss at step S says how far it is; not whether what it learned by then (its parameters and
AdamW's moments) will keep it behind. This loads each stage's checkpoint of step S written by a swarm run
(`bench/convergence.py --log-dir D --every S ...` keeps them), trains on in one process exactly, on the windows of
the swarm's trainers (skipping the micro-batches its first S steps roughly took), and prints the validation loss
every 10 steps; then the same from the exact run's own state at step S, and from each part of the swarm's state
put into the exact one (its parameters; each stage's first or second moment), to tell which part it is.

On configs/tiny.yaml at batch 16 (2026-12-07): from exact runs' step 10 (the reference's and in other orders)
exact training reaches 2.68-2.73 at step 50; from the 2 x 2 swarm's step 10, 2.91-2.99 in three runs, and the
swarm's first moment of either stage alone put into the exact state 2.81-2.86 (README, Learning).

    .venv/bin/python bench/convergence.py --steps 10 --every 10 --at 10 --orderings 0 --log-dir /tmp/run
    .venv/bin/python bench/continue_from.py /tmp/run --step 10 --steps 40 [--parts]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.checkpoint.store import StageCheckpoints  # noqa: E402
from swarm.config import RunConfig  # noqa: E402
from swarm.reference import ReferenceTrainer  # noqa: E402
from swarm.state import OPTIM, PARAM  # noqa: E402

State = list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]  # per stage: (parameters, moments)


def swarm_state(config: RunConfig, log_dir: Path, step: int) -> State:
    """Each stage's (parameters, moments) from a server's checkpoint of `step`."""
    state = []
    for stage in range(config.stages.num_stages):
        for server in sorted((log_dir / "checkpoints").glob(f"server-{stage}-*")):
            store = StageCheckpoints(server, config.run_id, stage, config.checkpoint.keep)
            path = store.dir / f"step{step:010d}"
            if (path / "manifest.json").exists():
                _, _, tensors = store.load(path, state_hash=config.state_hash())
                state.append(({k[len(PARAM):]: t for k, t in tensors.items() if k.startswith(PARAM)},
                              {k[len(OPTIM):]: t for k, t in tensors.items() if k.startswith(OPTIM)}))
                break
        else:
            raise SystemExit(f"no checkpoint of stage {stage} at step {step} under {log_dir / 'checkpoints'}")
    return state


def curve(config: RunConfig, trainers: int, step: int, state: State, steps: int) -> list[float]:
    """Validation loss every 10 steps of exact training from `state` at `step`."""
    reference = ReferenceTrainer(config, trainers=trainers)
    for (module, optimizer), (params, moments) in zip(zip(reference.stages, reference.optimizers), state):
        module.load_state_dict(params)
        optimizer.load_moments(dict(moments), step)
    for _ in range(step):  # (a step of the swarm took a micro-batch of each trainer's, about)
        for sampler in reference.samplers:
            sampler.next_batch()
    losses = []
    for i in range(1, steps + 1):
        reference.train_step()
        if i % 10 == 0:
            losses.append(round(reference.evaluate(), 4))
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log_dir", help="a swarm run's --log-dir (its checkpoints/ folder)")
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--step", type=int, default=10)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--parts", action="store_true", help="also each part of the swarm's state in the exact one")
    args = p.parse_args()
    config = RunConfig.load(args.config)
    swarm = swarm_state(config, Path(args.log_dir), args.step)
    exact = ReferenceTrainer(config, trainers=args.trainers)
    for _ in range(args.step):
        exact.train_step()
    own = [({k: v.clone() for k, v in m.state_dict().items()}, {k: v.clone() for k, v in o.moments().items()})
           for m, o in zip(exact.stages, exact.optimizers)]
    runs = {"the swarm's state": swarm, "exact training's own": own}
    if args.parts:
        runs["the swarm's parameters, exact moments"] = [(s[0], o[1]) for s, o in zip(swarm, own)]
        for stage in range(len(own)):
            for slot in ("exp_avg", "exp_avg_sq"):
                mixed = [(o[0], dict(o[1])) for o in own]
                mixed[stage][1].update({k: v for k, v in swarm[stage][1].items() if k.endswith("/" + slot)})
                runs[f"exact, with stage {stage}'s {slot} from the swarm"] = mixed
    for name, state in runs.items():
        losses = curve(config, args.trainers, args.step, state, args.steps)
        print(f"from {name} at step {args.step}: validation loss every 10 steps {losses}", flush=True)


if __name__ == "__main__":
    main()
