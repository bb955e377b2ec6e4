"""swarm-export: our stages, renamed to Hugging Face GPT-2's, load in transformers and give our logits."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from swarm.checkpoint.signing import (
    RUN_KIND,
    fingerprint,
    key_digest,
    key_path,
    load_or_create_key,
    public_key_of,
    sign_checkpoint,
)
from swarm.checkpoint.store import RunCheckpoints, StageCheckpoints
from swarm.checkpoint.verify import STATE_NAME
from swarm.config import ModelConfig, MoEConfig, RunConfig, StagesConfig
from swarm.experts import ExpertHost, ExpertState
from swarm.export import CONFIG_FILE, SWARM_CONFIG_FILE, WEIGHTS_FILE, export, load_exported, main, to_hf_state
from swarm.model import StageModule, build_stage
from swarm.model.gpt import make_expert

pytestmark = pytest.mark.timeout(60)

CONFIG = RunConfig(
    run_id="tiny",
    model=ModelConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=32, seed=3),
    stages=StagesConfig(num_stages=2),
).validate()


def perturbed_stages(config: RunConfig) -> list[StageModule]:
    """Every stage, every parameter moved off its init (biases 0 and LayerNorm 1 would hide mistakes)."""
    gen = torch.Generator().manual_seed(0)
    stages = [build_stage(config, k).eval() for k in range(config.stages.num_stages)]
    with torch.no_grad():
        for stage in stages:
            for p in stage.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return stages


def our_logits(stages: list[StageModule], idx: torch.Tensor) -> torch.Tensor:
    # The last stage's forward returns the loss; its blocks and head give the logits without targets.
    h = idx
    for stage in stages[:-1]:
        h = stage(h)
    last = stages[-1]
    for block in last.blocks:
        h = block(h)
    return last.head(h)


def stage_params(stages: list[StageModule]) -> dict[int, dict[str, torch.Tensor]]:
    return {stage.index: stage.state_dict() for stage in stages}


@pytest.fixture(scope="module")
def stages() -> list[StageModule]:
    return perturbed_stages(CONFIG)


def test_exported_model_gives_our_logits(stages: list[StageModule], tmp_path: Path):
    export(CONFIG, stage_params(stages), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([CONFIG_FILE, WEIGHTS_FILE])  # no temp files left
    model, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    model.eval()
    assert not any(info.get(key) for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    assert model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr()  # the head stays untied

    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, CONFIG.model.vocab_size, (3, CONFIG.model.seq_len), generator=gen)
    with torch.no_grad():
        ours = our_logits(stages, idx)
        theirs = model(idx).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)


def test_config_json_describes_our_architecture(stages: list[StageModule], tmp_path: Path):
    export(CONFIG, stage_params(stages), tmp_path)
    cfg = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert cfg["architectures"] == ["GPT2LMHeadModel"]
    assert (cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["n_positions"], cfg["vocab_size"]) == (4, 2, 32, 16, 64)
    assert cfg["n_inner"] == 4 * 32 and cfg["activation_function"] == "gelu" and cfg["tie_word_embeddings"] is False
    assert cfg["dtype"] == "float32"


def test_block_indices_become_global(stages: list[StageModule]):
    state = to_hf_state(CONFIG, stage_params(stages))
    # Stage 1's local block 0 is layer 2; Conv1D weights are stored [in, out].
    torch.testing.assert_close(state["transformer.h.2.attn.c_attn.weight"], stages[1].blocks[0].attn.qkv.weight.t())
    assert {name.split(".")[2] for name in state if name.startswith("transformer.h.")} == {"0", "1", "2", "3"}


def test_missing_tensor_is_named(stages: list[StageModule]):
    params = stage_params(stages)
    del params[1]["blocks.1.mlp.down.bias"]
    with pytest.raises(ValueError, match=r"missing stage 1: blocks\.1\.mlp\.down\.bias"):
        to_hf_state(CONFIG, params)


def test_missing_stage_is_named(stages: list[StageModule]):
    params = stage_params(stages)
    del params[0]
    with pytest.raises(ValueError, match=r"missing stage 0: embed\.tok\.weight"):
        to_hf_state(CONFIG, params)


def test_unused_tensor_is_named(stages: list[StageModule]):
    params = stage_params(stages)
    params[0]["blocks.2.ln1.weight"] = torch.ones(32)  # stage 0 holds blocks 0 and 1 only
    with pytest.raises(ValueError, match=r"unused stage 0: blocks\.2\.ln1\.weight"):
        to_hf_state(CONFIG, params)
    with pytest.raises(ValueError, match=r"stage\(s\) \[2\]"):
        to_hf_state(CONFIG, {**stage_params(stages), 2: {}})


def test_wrong_shape_is_named(stages: list[StageModule]):
    params = stage_params(stages)
    params[0]["embed.pos.weight"] = torch.zeros(32, 32)  # a seq_len of 32 where the config says 16
    with pytest.raises(ValueError, match=r"stage 0: embed\.pos\.weight has shape \[32, 32\].*\[16, 32\]"):
        to_hf_state(CONFIG, params)


def test_cli_refuses_a_non_empty_out(tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match=r"swarm-export: error: --out .* is not empty \(pass --force"):
        main(["--checkpoint-dir", str(tmp_path), "--out", str(out)])


def write_run_checkpoint(root: Path, config: RunConfig, stages: list[StageModule], step: int,
                         sign: bool = True) -> Path:
    """A run checkpoint as the coordinator writes it: one stage checkpoint per stage, copied into run/, and signed
    with the coordinator's key in `root` (made if absent) unless `sign` is False."""
    stage_dirs = {}
    for stage in stages:
        tensors = {f"param/{name}": t for name, t in stage.state_dict().items()}
        tensors["optim/0/step"] = torch.tensor(float(step))  # optimizer state is not part of the export
        _, _, stage_dirs[stage.index] = StageCheckpoints(root, config.run_id, stage.index, keep=2).write(
            tensors, step=step + stage.index, num_stages=len(stages), state_hash=config.state_hash(),
            round_id="round", group=1)
    path = RunCheckpoints(root, config.run_id, keep=2).write(config.to_yaml(), config.state_hash(), stage_dirs)[2]
    if sign:
        sign_checkpoint(path, load_or_create_key(key_path(root, config.run_id)), kind=RUN_KIND, run_id=config.run_id)
    return path


def coordinator_fingerprint(root: Path, run_id: str = "tiny") -> str:
    return fingerprint(public_key_of(load_or_create_key(key_path(root, run_id))))


def test_cli_exports_the_newest_run_checkpoint(stages: list[StageModule], tmp_path: Path, capsys):
    root, out = tmp_path / "ckpt", tmp_path / "out"
    write_run_checkpoint(root, CONFIG, perturbed_stages(CONFIG), step=5)  # older, other weights
    newest = write_run_checkpoint(root, CONFIG, stages, step=7)
    main(["--checkpoint-dir", str(root), "--out", str(out)])
    printed = capsys.readouterr().out
    assert "run tiny (stage 0 step 7, stage 1 step 8)" in printed and str(newest) in printed and str(out) in printed
    assert f"signed by the coordinator {coordinator_fingerprint(root)}" in printed
    exported = load_file(out / WEIGHTS_FILE)
    expected = to_hf_state(CONFIG, stage_params(stages))
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name], tensor, atol=0, rtol=0)


def test_cli_skips_a_run_checkpoint_that_does_not_verify(stages: list[StageModule], tmp_path: Path, capsys):
    root, out = tmp_path / "ckpt", tmp_path / "out"
    write_run_checkpoint(root, CONFIG, stages, step=5)
    newest = write_run_checkpoint(root, CONFIG, perturbed_stages(CONFIG), step=7)
    state = newest / "stage1" / STATE_NAME
    data = state.read_bytes()
    state.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit off: only the sha256 tells
    main(["--checkpoint-dir", str(root), "--out", str(out), "--run-id", "tiny"])
    assert "stage 0 step 5, stage 1 step 6" in capsys.readouterr().out
    torch.testing.assert_close(load_file(out / WEIGHTS_FILE)["lm_head.weight"], stages[1].head.proj.weight.detach())

    (newest.parent / "step0000000005" / "stage0" / STATE_NAME).write_bytes(b"")
    with pytest.raises(SystemExit, match=r"error: none of the 2 run checkpoint\(s\) of run tiny .* verifies"):
        main(["--checkpoint-dir", str(root), "--out", str(tmp_path / "out2")])


def test_cli_names_the_runs_to_choose_from(stages: list[StageModule], tmp_path: Path):
    root = tmp_path / "ckpt"
    with pytest.raises(SystemExit, match=r"swarm-export: error: no run checkpoint in "):
        main(["--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "out")])
    for run_id in ("alpha", "beta"):
        write_run_checkpoint(root, RunConfig(run_id=run_id, model=CONFIG.model, stages=CONFIG.stages), stages, 1)
    with pytest.raises(SystemExit, match=r"holds several runs \(alpha, beta\): choose one with --run-id"):
        main(["--checkpoint-dir", str(root), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=r"no run checkpoint of run gamma"):
        main(["--checkpoint-dir", str(root), "--out", str(tmp_path / "out"), "--run-id", "gamma"])
    main(["--checkpoint-dir", str(root), "--out", str(tmp_path / "out"), "--run-id", "beta"])
    assert (tmp_path / "out" / CONFIG_FILE).is_file()


def moe_config(expert_servers: bool) -> RunConfig:
    config = RunConfig.from_yaml(CONFIG.to_yaml())
    config.run_id = "moe"
    config.model.moe = MoEConfig(every=2, num_experts=3, top_k=2, expert_servers=expert_servers)
    return config.validate()


def test_a_mixture_of_experts_exports_in_swarms_own_form_and_computes_what_its_stages_do(tmp_path: Path, capsys):
    config = moe_config(expert_servers=False)  # the experts live in the stages
    stages = perturbed_stages(config)
    root, out = tmp_path / "ckpt", tmp_path / "out"
    write_run_checkpoint(root, config, stages, step=3)
    main(["--checkpoint-dir", str(root), "--out", str(out)])
    assert "in swarm's own form" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted([SWARM_CONFIG_FILE, WEIGHTS_FILE])
    model = load_exported(out).eval()
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, config.model.vocab_size, (2, config.model.seq_len), generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), our_logits(stages, idx), rtol=1e-5, atol=1e-5)


def expert_host(config: RunConfig) -> ExpertHost:
    """Every expert of the run on one host, each parameter moved off its init."""
    host = ExpertHost(config, range(config.model.moe.num_experts))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for module in host.modules.values():
            for p in module.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return host


def test_a_run_with_expert_servers_exports_each_expert_from_its_checkpoint(tmp_path: Path):
    config = moe_config(expert_servers=True)  # the stages hold the routers, the experts are the hosts'
    stages, host = perturbed_stages(config), expert_host(config)
    root, out = tmp_path / "ckpt", tmp_path / "out"
    stage_dirs = {}
    for stage in stages:
        tensors = {f"param/{name}": t for name, t in stage.state_dict().items()}
        _, _, stage_dirs[stage.index] = StageCheckpoints(root, config.run_id, stage.index, keep=2).write(
            tensors, step=5, num_stages=len(stages), state_hash=config.state_hash(), round_id="r", group=1)
    expert_dirs = {}
    for e in (0, 2):  # expert 1: no host of it wrote a checkpoint
        info, tensors = ExpertState(host, e).state_dict()
        _, _, expert_dirs[e] = StageCheckpoints(root, config.run_id, e, keep=2, part="expert").write(
            tensors, step=9, num_stages=3, state_hash=config.state_hash(), round_id=info.round_id, group=1)
    path = RunCheckpoints(root, config.run_id, keep=2).write(config.to_yaml(), config.state_hash(), stage_dirs,
                                                             expert_dirs)[2]
    sign_checkpoint(path, load_or_create_key(key_path(root, config.run_id)), kind=RUN_KIND, run_id=config.run_id)

    with pytest.raises(SystemExit, match=r"experts \[1\] have no checkpoint in it .* --init-missing-experts"):
        main(["--checkpoint-dir", str(root), "--out", str(out)])
    assert not out.exists()
    main(["--checkpoint-dir", str(root), "--out", str(out), "--init-missing-experts"])
    exported = load_file(out / WEIGHTS_FILE)
    model = load_exported(out)  # strict: every parameter of the whole model, none more
    for layer in config.model.moe_layers():
        for e in (0, 2):  # from the checkpoints: the hosts' parameters, unflattened in order
            for name, p in host.modules[layer, e].named_parameters():
                torch.testing.assert_close(exported[f"blocks.{layer}.mlp.experts.{e}.{name}"], p.detach(),
                                           rtol=0, atol=0)
        for name, p in make_expert(config.model, layer, 1).named_parameters():  # as the run initialized it
            torch.testing.assert_close(exported[f"blocks.{layer}.mlp.experts.1.{name}"], p.detach(), rtol=0, atol=0)
    for stage in stages:  # the routers and every other parameter, from the stages
        for name, p in stage.named_parameters():
            torch.testing.assert_close(exported[stage.full_model_name(name)], p.detach(), rtol=0, atol=0)
    idx = torch.randint(0, config.model.vocab_size, (2, config.model.seq_len))
    assert torch.isfinite(model(idx)).all()


def copied_in(root: Path, config: RunConfig, stages: list[StageModule], step: int, signer_root: Path | None) -> Path:
    """A run checkpoint made elsewhere (signed by the coordinator of `signer_root`, or not at all if None) and
    copied into the coordinator's run/ by hand: its manifest and every file verify."""
    elsewhere = signer_root if signer_root is not None else root.parent / f"elsewhere-{step}"
    made = write_run_checkpoint(elsewhere, config, stages, step, sign=signer_root is not None)
    return Path(shutil.copytree(made, root / config.run_id / "run" / made.name))


def test_cli_exports_only_a_run_checkpoint_the_coordinator_signed(stages: list[StageModule], tmp_path: Path, capsys,
                                                                   caplog):
    root = tmp_path / "ckpt"
    signed = write_run_checkpoint(root, CONFIG, stages, step=5)
    zeros = [build_stage(CONFIG, k) for k in range(2)]
    for stage in zeros:
        for p in stage.parameters():
            p.data.zero_()
    unsigned = copied_in(root, CONFIG, zeros, step=7, signer_root=None)
    foreign = copied_in(root, CONFIG, zeros, step=9, signer_root=tmp_path / "other-coordinator")
    assert RunCheckpoints(root, "tiny", keep=9).newest_verified()[1] == foreign  # every one of them verifies
    mine = coordinator_fingerprint(root)

    main(["--checkpoint-dir", str(root), "--out", str(tmp_path / "out")])
    printed = capsys.readouterr()
    assert f"(stage 0 step 5, stage 1 step 6) from {signed}" in printed.out
    assert f"signed by the coordinator {mine}" in printed.out
    assert f"checkpoint {unsigned} is not signed" in caplog.text
    assert f"is signed by {coordinator_fingerprint(tmp_path / 'other-coordinator')}, not by the coordinator ({mine})" \
        in caplog.text
    torch.testing.assert_close(load_file(tmp_path / "out" / WEIGHTS_FILE)["lm_head.weight"],
                               stages[1].head.proj.weight.detach())

    # Copied elsewhere (no coordinator.key there): the fingerprint the coordinator logged names the signer.
    copy = tmp_path / "copy"
    shutil.copytree(root / "tiny" / "run", copy / "tiny" / "run")
    main(["--checkpoint-dir", str(copy), "--out", str(tmp_path / "out2"), "--signer", mine.upper()])
    assert f"stage 0 step 5, stage 1 step 6) from {copy / 'tiny' / 'run' / signed.name}" in capsys.readouterr().out
    whole = key_digest(public_key_of(load_or_create_key(key_path(root, "tiny"))))
    main(["--checkpoint-dir", str(copy), "--out", str(tmp_path / "out3"), "--signer", whole])
    assert "stage 0 step 5" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"no coordinator key .*coordinator.key to check .* pass --signer"):
        main(["--checkpoint-dir", str(copy), "--out", str(tmp_path / "out4")])
    wrong = "0123456789abcdef"
    with pytest.raises(SystemExit, match=r"none of the 3 run checkpoint\(s\) of run tiny .* verifies as the "
                       rf"coordinator's \(fingerprint {wrong}\): run checkpoint step0000000009: .* is signed by .*, "
                       rf"not by the coordinator \({wrong}\)"):
        main(["--checkpoint-dir", str(root), "--out", str(tmp_path / "out5"), "--signer", wrong])
    with pytest.raises(SystemExit, match=r"--signer 'xyz' is not a key fingerprint"):
        main(["--checkpoint-dir", str(root), "--out", str(tmp_path / "out5"), "--signer", "xyz"])
    assert not (tmp_path / "out4").exists() and not (tmp_path / "out5").exists()


def test_cli_refuses_unsigned_run_checkpoints_unless_told_to_trust_them(stages: list[StageModule], tmp_path: Path,
                                                                         capsys, caplog):
    root = tmp_path / "ckpt"
    written = write_run_checkpoint(root, CONFIG, stages, step=5, sign=False)  # as versions that did not sign
    with pytest.raises(SystemExit, match=r"no coordinator key .* or --trust-unsigned"):
        main(["--checkpoint-dir", str(root), "--out", str(tmp_path / "out")])
    coordinator_fingerprint(root)  # the coordinator, upgraded, made its key: still nothing it signed
    with pytest.raises(SystemExit, match=r"verifies as the coordinator's \(fingerprint [0-9a-f]{16}\): run "
                       r"checkpoint step0000000005 is not signed by the coordinator; .* pass --trust-unsigned"):
        main(["--checkpoint-dir", str(root), "--out", str(tmp_path / "out")])
    main(["--checkpoint-dir", str(root), "--out", str(tmp_path / "out"), "--trust-unsigned"])
    assert f"from {written} to {tmp_path / 'out'}, NOT signed (--trust-unsigned)" in capsys.readouterr().out
    assert "is not signed: exported as --trust-unsigned says" in caplog.text

    # --trust-unsigned accepts no signature, not a bad one: a manifest changed after signing stays refused.
    signed = write_run_checkpoint(root, CONFIG, stages, step=7)
    manifest = signed / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"created": ', b'"created": 1'))
    main(["--checkpoint-dir", str(root), "--out", str(tmp_path / "out"), "--trust-unsigned", "--force"])
    assert f"from {written}" in capsys.readouterr().out
    assert "the signature does not match the checkpoint's manifest" in caplog.text


def test_cli_does_not_import_hivemind(stages: list[StageModule], tmp_path: Path):
    root = tmp_path / "ckpt"
    write_run_checkpoint(root, CONFIG, stages, step=5)
    code = ("import sys; from swarm.export import main; main(sys.argv[1:]); "
            "assert 'hivemind' not in sys.modules, 'swarm-export imported hivemind'")
    done = subprocess.run([sys.executable, "-c", code, "--checkpoint-dir", str(root), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert "signed by the coordinator" in done.stdout
