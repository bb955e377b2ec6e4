"""Export a trained run as a Hugging Face GPT-2 model: ``swarm-export --checkpoint-dir DIR --out OUT``.

Our GPT is GPT-2's architecture (pre-norm blocks, learned absolute positions, biased
projections, LayerNorm eps 1e-5, attention scaled by 1/sqrt(head_dim), no bias on the LM head)
with two differences that the exported config states: the MLP uses exact (erf) GELU where GPT-2
uses its tanh approximation, and the LM head is not tied to the token embedding. Hugging Face's
``Conv1D`` stores weights as [in, out], the transpose of ``nn.Linear``'s, so those are transposed.

The output directory holds ``model.safetensors`` and ``config.json`` and loads with
``transformers.GPT2LMHeadModel.from_pretrained(OUT)``. GPT-2 has no mixture of experts: a run with
``model.moe`` is exported in swarm's own form instead, ``model.safetensors`` named as
``swarm.model.GPT`` names its parameters, with every expert inside its block (the experts of a run
with expert servers come from their checkpoints in the run checkpoint), and ``swarm.yaml``, the run's
config with ``model.moe.expert_servers`` off; :func:`load_exported` loads it into a GPT.

The pure functions (:func:`hf_config`, :func:`to_hf_state`, :func:`to_swarm_state`) do no I/O;
:func:`main` reads the newest run checkpoint that verifies and that the coordinator signed
(swarm.checkpoint.signing): checked against the public half of the key it keeps beside its
checkpoints (``<root>/<run_id>/coordinator.key``), or against ``--signer FINGERPRINT`` (what the
coordinator logs as "signing checkpoints as ...") for checkpoints copied elsewhere. A run checkpoint
copied into the coordinator's directory by any other way is skipped, and the next newest tried.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import torch
from safetensors.torch import save_file

from swarm.config import ConfigError, RunConfig
from swarm.model import GPT, Block, Embedding, Head, StageModule
from swarm.model.gpt import INIT_STD, make_expert
from swarm.model.moe import Expert, MoEFeedForward
from swarm.model.stages import stage_layers

if TYPE_CHECKING:
    from swarm.checkpoint.store import RunCheckpoints

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
SWARM_CONFIG_FILE = "swarm.yaml"  # beside the weights of a mixture-of-experts model (swarm's own form)
# The exporter only reads checkpoints; a keep this large means it could never prune one.
READ_ONLY_KEEP = 2**31 - 1

# Our GPT's names (GPT.state_dict(), a block's relative to blocks.<i>) -> Hugging Face GPT-2's,
# and whether HF stores the tensor transposed (its Conv1D is [in, out], nn.Linear is [out, in]).
_OUTER_NAMES = {
    "embed.tok.weight": ("transformer.wte.weight", False),
    "embed.pos.weight": ("transformer.wpe.weight", False),
    "head.ln.weight": ("transformer.ln_f.weight", False),
    "head.ln.bias": ("transformer.ln_f.bias", False),
    "head.proj.weight": ("lm_head.weight", False),
}
_BLOCK_NAMES = {
    "ln1.weight": ("ln_1.weight", False),
    "ln1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True),  # q, k, v stacked in the same order as HF's split
    "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.out.weight": ("attn.c_proj.weight", True),
    "attn.out.bias": ("attn.c_proj.bias", False),
    "ln2.weight": ("ln_2.weight", False),
    "ln2.bias": ("ln_2.bias", False),
    "mlp.up.weight": ("mlp.c_fc.weight", True),
    "mlp.up.bias": ("mlp.c_fc.bias", False),
    "mlp.down.weight": ("mlp.c_proj.weight", True),
    "mlp.down.bias": ("mlp.c_proj.bias", False),
}


def hf_config(config: RunConfig) -> dict:
    """The ``config.json`` of a GPT2LMHeadModel with our model's architecture and sizes."""
    m = config.model
    dropout = float(m.dropout)  # ours drops at the same three places as GPT-2: embeddings, attention, residuals
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": m.vocab_size,
        "n_positions": m.seq_len,
        "n_embd": m.d_model,
        "n_layer": m.n_layer,
        "n_head": m.n_head,
        "n_inner": m.mlp_ratio * m.d_model,
        "activation_function": "gelu",  # exact GELU, as F.gelu; GPT-2's own "gelu_new" is the tanh approximation
        "layer_norm_epsilon": 1e-5,  # nn.LayerNorm's default, which our model uses
        "scale_attn_weights": True,  # 1/sqrt(head_dim), as scaled_dot_product_attention
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": False,  # the head and the embedding live on different stages
        "embd_pdrop": dropout,
        "attn_pdrop": dropout,
        "resid_pdrop": dropout,
        "initializer_range": INIT_STD,
        # GPT-2's defaults (50256) name a token of its own vocabulary; ours has no special tokens.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "use_cache": True,
    }


def to_hf_state(config: RunConfig, stage_params: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Rename every stage's parameters to Hugging Face GPT-2's; ValueError if any is missing, extra or misshapen.

    ``stage_params[k]`` is stage k's ``state_dict()`` (stage-local block indices, no ``param/`` prefix).
    """
    num_stages = config.stages.num_stages
    extra_stages = sorted(set(stage_params) - set(range(num_stages)))
    if extra_stages:
        raise ValueError(f"the run has stages 0..{num_stages - 1}, got parameters for stage(s) {extra_stages}")
    hf_state: dict[str, torch.Tensor] = {}
    missing, unused = [], []
    for k in range(num_stages):
        stage = _shape_only_stage(config, k)
        expected = stage.state_dict()
        params = stage_params.get(k, {})
        missing += [f"stage {k}: {name}" for name in expected if name not in params]
        unused += [f"stage {k}: {name}" for name in params if name not in expected]
        for name, tensor in params.items():
            if name not in expected:
                continue
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise ValueError(
                    f"stage {k}: {name} has shape {list(tensor.shape)}, the run config makes it "
                    f"{list(expected[name].shape)}"
                )
            # A part added to our model but not to the table below stops here, never silently dropped.
            hf_name, transposed = _hf_name(stage.full_model_name(name))
            if hf_name in hf_state:  # a mapping bug, not bad input: two of our tensors for one of HF's
                raise ValueError(f"stage {k}: {name} maps to {hf_name}, which another tensor already filled")
            tensor = tensor.detach().to("cpu")
            hf_state[hf_name] = (tensor.t() if transposed else tensor).contiguous()
    if missing or unused:
        problems = [f"missing {', '.join(missing)}"] if missing else []
        problems += [f"unused {', '.join(unused)}"] if unused else []
        raise ValueError("the stage parameters do not match the run config: " + "; ".join(problems))
    return hf_state


def export(config: RunConfig, stage_params: dict[int, dict[str, torch.Tensor]], out: Path) -> None:
    """Write ``out/model.safetensors`` and ``out/config.json`` (each to a temporary file, then renamed)."""
    state = to_hf_state(config, stage_params)
    cfg = hf_config(config)
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) == 1:
        cfg["dtype"] = str(dtypes.pop()).removeprefix("torch.")
    out.mkdir(parents=True, exist_ok=True)
    # The weights go first: a config.json is only ever next to complete weights.
    _write_atomically(out / WEIGHTS_FILE, lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
    text = json.dumps(cfg, indent=2) + "\n"
    _write_atomically(out / CONFIG_FILE, lambda tmp: tmp.write_text(text))


# --------------------------------------------------------------- mixture of experts: swarm's own form

def with_local_experts(config: RunConfig) -> RunConfig:
    """The run's config with every expert inside its block (model.moe.expert_servers off)."""
    moe = dataclasses.replace(config.model.moe, expert_servers=False)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, moe=moe)).validate()


def to_swarm_state(config: RunConfig, stage_params: dict[int, dict[str, torch.Tensor]],
                   expert_params: dict[int, dict[str, torch.Tensor]] | None = None,
                   init_missing_experts: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's parameters as swarm.model.GPT names them with its experts in their blocks; ValueError
    if any is missing, extra or misshapen.

    ``stage_params[k]``: stage k's ``state_dict()``. ``expert_params[e]``: expert e's checkpoint tensors
    (swarm.experts.ExpertState: ``<block>.parameters`` flat, in the expert's parameter order), for a run with
    expert servers. An expert with none is an error, unless `init_missing_experts`: then it is made as the run
    made it before any step (its seeded initialization), which is what an expert no host ever trained is.
    """
    cfg = config.model
    expected = _shape_only_model(with_local_experts(config).model).state_dict()
    state: dict[str, torch.Tensor] = {}
    unused = []
    for k, params in sorted(stage_params.items()):
        layers = stage_layers(cfg.n_layer, config.stages.num_stages, k) if 0 <= k < config.stages.num_stages else None
        for name, tensor in params.items():
            full = _full_name(name, layers) if layers is not None else None
            if full is None or full not in expected or full in state:
                unused.append(f"stage {k}: {name}")
                continue
            state[full] = tensor
    if cfg.moe.expert_servers:
        experts = expert_params or {}
        unused += [f"expert {e}" for e in sorted(experts) if not 0 <= e < cfg.moe.num_experts]
        missing = [e for e in range(cfg.moe.num_experts) if e not in experts]
        if missing and not init_missing_experts:
            raise ValueError(f"experts {missing} have no checkpoint in it (no host of theirs wrote one); "
                             "--init-missing-experts exports them as initialized")
        for e in range(cfg.moe.num_experts):
            for layer in cfg.moe_layers():
                module = make_expert(cfg, layer, e) if e in missing else _expert_module(cfg, e, experts[e], layer)
                for name, tensor in module.state_dict().items():
                    state[f"blocks.{layer}.mlp.experts.{e}.{name}"] = tensor
    missing_names = [name for name in expected if name not in state]
    if missing_names or unused:
        problems = [f"missing {', '.join(missing_names)}"] if missing_names else []
        problems += [f"unused {', '.join(unused)}"] if unused else []
        raise ValueError("the checkpoints do not match the run config: " + "; ".join(problems))
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{name} has shape {list(tensor.shape)}, the run config makes it "
                             f"{list(expected[name].shape)}")
    return {name: tensor.detach().to("cpu").contiguous() for name, tensor in state.items()}


def export_swarm(config: RunConfig, state: dict[str, torch.Tensor], out: Path) -> None:
    """Write ``out/model.safetensors`` and ``out/swarm.yaml`` (each to a temporary file, then renamed)."""
    text = with_local_experts(config).to_yaml()
    out.mkdir(parents=True, exist_ok=True)
    _write_atomically(out / WEIGHTS_FILE, lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
    _write_atomically(out / SWARM_CONFIG_FILE, lambda tmp: tmp.write_text(text))


def load_exported(out: Path) -> GPT:
    """The GPT a mixture-of-experts export holds (swarm's own form), every parameter loaded."""
    from safetensors.torch import load_file

    config = RunConfig.load(Path(out) / SWARM_CONFIG_FILE)
    model = GPT(config.model)
    model.load_state_dict(load_file(str(Path(out) / WEIGHTS_FILE)), strict=True)
    return model


def _expert_module(cfg, expert: int, tensors: dict[str, torch.Tensor], layer: int) -> Expert:
    """Expert `expert` of block `layer` with the parameters its checkpoint holds (flat, in parameter order)."""
    flat = tensors.get(f"{layer}.parameters")
    with torch.device("meta"):
        module = Expert(cfg.d_model, cfg.expert_hidden)
    shapes = [(name, p.shape) for name, p in module.named_parameters()]
    total = sum(shape.numel() for _, shape in shapes)
    if flat is None or flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"expert {expert}: its checkpoint's {layer}.parameters is "
                         f"{'missing' if flat is None else list(flat.shape)}, the run config makes it [{total}]")
    params, offset = {}, 0
    for name, shape in shapes:
        params[name] = flat[offset:offset + shape.numel()].view(shape)
        offset += shape.numel()
    module = Expert(cfg.d_model, cfg.expert_hidden)
    module.load_state_dict(params, strict=True)
    return module


def _shape_only_model(cfg) -> torch.nn.Module:
    """The names and shapes of GPT(cfg)'s parameters, on the meta device (no memory, no init)."""
    with torch.device("meta"):
        blocks = [Block(cfg, MoEFeedForward(cfg.d_model, [Expert(cfg.d_model, cfg.expert_hidden)
                                                          for _ in range(cfg.moe.num_experts)],
                                            cfg.moe.top_k, cfg.moe.capacity_factor, layer=i))
                  if cfg.is_moe_layer(i) else Block(cfg) for i in range(cfg.n_layer)]
        return torch.nn.ModuleDict({"embed": Embedding(cfg), "blocks": torch.nn.ModuleList(blocks),
                                    "head": Head(cfg)})


def _full_name(name: str, layers: range) -> str | None:
    """A stage's parameter name as the whole GPT names it (``blocks.j`` -> the global index); None if its block
    index is not the stage's."""
    parts = name.split(".")
    if parts[0] == "blocks":
        if len(parts) < 2 or not parts[1].isdigit() or int(parts[1]) >= len(layers):
            return None
        parts[1] = str(layers[int(parts[1])])
    return ".".join(parts)


def _hf_name(full_name: str) -> tuple[str, bool]:
    """The HF GPT-2 name of one of our GPT's parameters, and whether HF stores it transposed."""
    if full_name in _OUTER_NAMES:
        return _OUTER_NAMES[full_name]
    kind, _, rest = full_name.partition(".")
    index, _, inner = rest.partition(".")
    if kind == "blocks" and index.isdigit() and inner in _BLOCK_NAMES:
        hf_inner, transposed = _BLOCK_NAMES[inner]
        return f"transformer.h.{index}.{hf_inner}", transposed
    raise ValueError(f"no Hugging Face GPT-2 name for our parameter {full_name}")


def _shape_only_stage(config: RunConfig, k: int) -> StageModule:
    # Built on the meta device: the names and shapes of build_stage(config, k), with no memory or init.
    cfg = config.model
    with torch.device("meta"):
        stage = StageModule(
            cfg,
            k,
            config.stages.num_stages,
            blocks=[Block(cfg) for _ in range(config.layers_per_stage)],
            embed=Embedding(cfg) if k == 0 else None,
            head=Head(cfg) if k == config.stages.num_stages - 1 else None,
        )
    return stage


def _write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # (safetensors creates its file readable by its owner only)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="swarm-export",
        description="Export the newest verified run checkpoint as a Hugging Face GPT-2 model "
        "(model.safetensors and config.json, for transformers.GPT2LMHeadModel.from_pretrained); a mixture of "
        "experts in swarm's own form (model.safetensors and swarm.yaml, for swarm.export.load_exported).",
    )
    p.add_argument("--checkpoint-dir", type=Path, help="the coordinator's checkpoint root (default: as the "
                   "coordinator's, $XDG_CACHE_HOME/swarm/checkpoints or ~/.cache/swarm/checkpoints)")
    p.add_argument("--out", type=Path, required=True, help="directory to write; must be absent or empty")
    p.add_argument("--run-id", help="the run to export (needed when the checkpoint root holds several)")
    p.add_argument("--force", action="store_true", help="overwrite the model files in a non-empty --out")
    p.add_argument("--signer", metavar="FINGERPRINT", help="export only a run checkpoint signed by this key: the "
                   "fingerprint the coordinator logs ('signing checkpoints as ...'; 16 hex digits, or the 64 of its "
                   "key's sha256). Default: the key in <checkpoint-dir>/<run_id>/coordinator.key")
    p.add_argument("--init-missing-experts", action="store_true", help="a mixture-of-experts run: export an expert "
                   "with no checkpoint in the run checkpoint (no host of it wrote one) as the run initialized it, "
                   "instead of refusing")
    p.add_argument("--trust-unsigned", action="store_true", help="also accept a run checkpoint with no signature "
                   "at all (written by a version that did not sign checkpoints yet); a warning says so")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    # Not swarm.logs.setup_logging: that one tames hivemind, which the export never imports (seconds saved).
    logging.basicConfig(level=logging.WARNING, format="swarm-export: %(levelname)s: %(message)s")
    out: Path = args.out
    if out.exists() and not out.is_dir():
        _fail(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        _fail(f"--out {out} is not empty (pass --force to overwrite its model files)")
    found = _load_newest(args.checkpoint_dir, args.run_id, args.signer, args.trust_unsigned)
    config, source = found.config, found.source
    moe = config.model.moe is not None
    try:
        if moe:  # GPT-2 has no experts to put them in: swarm's own form
            export_swarm(config, to_swarm_state(config, found.stage_params, found.expert_params,
                                                args.init_missing_experts), out)
        else:
            export(config, found.stage_params, out)
    except ValueError as e:
        _fail(f"checkpoint {source} does not fit its own run config: {e}")
    except OSError as e:
        _fail(f"cannot write {out}: {e}")
    steps = [f"stage {k} step {found.steps[k]}" for k in sorted(found.steps)]
    steps += [f"expert {e} step {found.expert_steps[e]}" for e in sorted(found.expert_steps)]
    signed = f"signed by the coordinator {found.signer}" if found.signer else "NOT signed (--trust-unsigned)"
    form = " in swarm's own form (a mixture of experts: load it with swarm.export.load_exported)" if moe else ""
    print(f"exported run {config.run_id} ({', '.join(steps)}) from {source} to {out}{form}, {signed}", flush=True)


@dataclasses.dataclass
class _Found:
    """What the newest run checkpoint that verifies holds, and where it is."""

    config: RunConfig
    stage_params: dict[int, dict[str, torch.Tensor]]
    expert_params: dict[int, dict[str, torch.Tensor]]
    steps: dict[int, int]
    expert_steps: dict[int, int]
    source: Path
    signer: str | None  # its signer's fingerprint; None: unsigned, and trusted


def _load_newest(root: Path | None, run_id: str | None, signer: str | None, trust_unsigned: bool) -> _Found:
    """The run config, every stage's parameters and step (and every expert's in it), of the newest run checkpoint
    that verifies and is signed by the coordinator."""
    from swarm.checkpoint.errors import CheckpointError
    from swarm.checkpoint.store import RunCheckpoints, default_root, find_run_ids

    root = default_root() if root is None else root
    if not root.is_dir():
        _fail(f"--checkpoint-dir {root} is not a directory")
    try:
        run_id = run_id or _only_run(root, find_run_ids(root))
        store = RunCheckpoints(root, run_id, keep=READ_ONLY_KEEP)
    except (CheckpointError, ValueError) as e:
        _fail(str(e))
    written = store.entries()
    if not written:
        _fail(f"no run checkpoint of run {run_id} in {root} (the coordinator writes them under {store.dir})")
    expect, named = _expected_signer(root, run_id, signer, trust_unsigned)
    found, reasons = _newest_signed(store, expect, trust_unsigned)
    if found is None:
        if any(unsigned for _, unsigned in reasons):
            hint = ("; a run checkpoint with no signature was written by a version that did not sign, or put there "
                    "by hand: pass --trust-unsigned to export one anyway")
        else:
            hint = ""
        _fail(f"none of the {len(written)} run checkpoint(s) of run {run_id} in {root} verifies as the coordinator's "
              f"({named}): " + "; ".join(reason for reason, _ in reasons) + hint)
    run, stages, experts, source, signed_by = found
    ignored: list[str] = []
    try:
        config = RunConfig.from_yaml(run.config_yaml, ignored)
    except ConfigError as e:
        _fail(f"checkpoint {source} holds a run config this version cannot read: {e}")
    unknown_model = [key for key in ignored if key.startswith("model.")]
    if unknown_model:  # the run's model may differ from the one this version would export
        _fail(f"checkpoint {source} is of a model with settings this version does not know "
              f"({', '.join(unknown_model)}): export it with the swarm version that trained it")
    if ignored:
        logging.getLogger(__name__).warning("ignoring run config keys this version does not know: %s",
                                            ", ".join(ignored))
    params = {k: {name.removeprefix("param/"): t for name, t in tensors.items() if name.startswith("param/")}
              for k, (_, tensors) in stages.items()}
    return _Found(config, params, {e: tensors for e, (_, tensors) in experts.items()},
                  {k: manifest.step for k, (manifest, _) in stages.items()},
                  {e: manifest.step for e, (manifest, _) in experts.items()}, source, signed_by)


def _expected_signer(root: Path, run_id: str, signer: str | None, trust_unsigned: bool) -> tuple[object, str]:
    """Whose signature a run checkpoint must bear (a public key, a fingerprint, or None: not checked), and
    how to name it in messages."""
    from swarm.checkpoint.errors import CheckpointError
    from swarm.checkpoint.signing import fingerprint, is_fingerprint, key_path, load_public_key

    if signer is not None:
        if not is_fingerprint(signer.lower()):
            _fail(f"--signer {signer!r:.80} is not a key fingerprint: the 16 hex digits the coordinator logs as "
                  "'signing checkpoints as ...', or the 64 of its key's sha256")
        return signer.lower(), f"fingerprint {signer.lower()}"
    path = key_path(root, run_id)
    if not path.exists():
        if trust_unsigned:
            logging.getLogger(__name__).warning("no %s and no --signer: signatures are not checked", path)
            return None, "unchecked"
        _fail(f"no coordinator key {path} to check the run checkpoints' signatures with: pass --signer "
              "FINGERPRINT (the coordinator logs it at start: 'signing checkpoints as ...'), or --trust-unsigned")
    try:
        public = load_public_key(path)
    except CheckpointError as e:
        _fail(f"{e} (or pass --signer FINGERPRINT)")
    return public, f"fingerprint {fingerprint(public)}"


def _newest_signed(store: RunCheckpoints, expect: object, trust_unsigned: bool
                   ) -> tuple[tuple | None, list[tuple[str, bool]]]:
    """The newest run checkpoint in `store` signed by `expect` (or, if `trust_unsigned`, not signed at all)
    whose every file verifies, as (run manifest, stages, path, signer fingerprint or None); and why each
    newer one was skipped, with whether it was unsigned."""
    from swarm.checkpoint.errors import CheckpointError
    from swarm.checkpoint.signing import RUN_KIND, UnsignedCheckpoint, verify_signature

    log = logging.getLogger(__name__)
    reasons: list[tuple[str, bool]] = []
    for path in store.entries():
        signed_by = None
        if expect is not None:
            try:
                signed_by = verify_signature(path, kind=RUN_KIND, run_id=store.run_id, expect=expect)
            except UnsignedCheckpoint as e:
                if not trust_unsigned:
                    reasons.append((f"run checkpoint {path.name} is not signed by the coordinator", True))
                    log.warning("skipping run checkpoint %s: %s", path, e)
                    continue
            except CheckpointError as e:
                reasons.append((f"run checkpoint {path.name}: {e}", False))
                log.warning("skipping run checkpoint %s: %s", path, e)
                continue
        try:
            run, _, stages, experts = store.load(path)
        except CheckpointError as e:
            reasons.append((f"run checkpoint {path.name} does not verify: {e}", False))
            log.warning("skipping run checkpoint %s: %s", path, e)
            continue
        if signed_by is None:
            log.warning("run checkpoint %s is not signed: exported as --trust-unsigned says", path)
        return (run, stages, experts, path, signed_by), reasons
    return None, reasons


def _only_run(root: Path, run_ids: list[str]) -> str:
    if len(run_ids) == 1:
        return run_ids[0]
    if not run_ids:
        _fail(f"no run checkpoint in {root} (the coordinator writes them to <checkpoint-dir>/<run_id>/run/)")
    _fail(f"{root} holds several runs ({', '.join(sorted(run_ids))}): choose one with --run-id")


def _fail(message: str) -> NoReturn:
    sys.exit(f"swarm-export: error: {message}")
