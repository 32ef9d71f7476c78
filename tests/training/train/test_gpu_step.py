"""The train step's GPU properties, checked on the CPU as far as a CPU can show them.

- no host sync: ``train_step`` runs under a counter of every operation that would make the host wait for a
  GPU (tests/fixtures/sync_counter.py), with masked variants, jitter on the device and clipping on;
- the σ and μ heads run in float32 under bf16 autocast: the logged log σ² equals a float64 evaluation of
  the head on the same features to float32 precision, where a bf16 head is off by up to 0.03 at −10;
- a step with a non-finite loss changes no weight and no optimizer moment, is counted, and training goes
  on (fused AdamW's ``found_inf`` and the ``foreach`` fallback alike); fused AdamW is what the step uses
  where torch has it, and it matches the ``foreach`` update;
- ``compile=true``: Dynamo captures the module once for every text length (dynamic shapes).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.ingest import augment as A
from pipeline.ingest.device_augment import hue_rows_by_position
from tests.fixtures.sync_counter import SyncCounter
from training.config import DataConfig, OptimConfig, TrainConfig
from training.model.param_groups import param_groups
from training.train.optimizer import GuardedUpdate, make_adamw
from training.train.step import setup_state, train_step

TOKENIZER = SimpleNamespace(vocab_size=64, pad_id=0, end_id=1, mask_id=2, start_id=None)


@pytest.fixture(autouse=True)
def one_thread():
    """Steps of a tiny model on one intra-op thread: on a shared 2-core machine two spinning OpenMP threads
    make a 0.1 s step take seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def state_for(loss: str = "prolip", fused: bool = True, **kw):
    """A single-process train state of the ``tiny`` model; ``fused=False`` swaps in the ``foreach`` AdamW."""
    cfg = TrainConfig(
        model="tiny",
        global_batch_size=8,
        samples_seen=64,
        loss={"name": loss},
        optim=OptimConfig(warmup_steps=1, grad_clip=kw.pop("grad_clip", 1.0)),
        **kw,
    )
    state = setup_state(cfg, TOKENIZER, torch.device("cpu"), 0)
    if not fused:
        o = cfg.optim
        groups = param_groups(state.module, o.weight_decay, o.lr, o.unc_lr_mult, o.unc_lr_mult_image)
        state.opt, is_fused = make_adamw(groups, o, fused=False)
        assert not is_fused
        state.update = GuardedUpdate(state.opt, False, state.module.parameters(), o.grad_clip)
        state.sched = torch.optim.lr_scheduler.LambdaLR(state.opt, state.sched.lr_lambdas[0])
    return state


def uint8_batch(seed: int = 0, length: int = 10, jitter: bool = True) -> dict[str, torch.Tensor]:
    """What the collate step hands the loop: uint8 crops, trimmed tokens, masked variants, pixel draws."""
    g, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    tokens = torch.randint(3, 64, (8, length), generator=g)
    tokens[:, -1] = TOKENIZER.end_id
    batch = {
        "images": torch.randint(0, 256, (8, 64, 64, 3), dtype=torch.uint8, generator=g),
        "tokens": tokens,
        "masked_tokens": torch.where(torch.rand(8, length, generator=g) < 0.75, TOKENIZER.mask_id, tokens),
        "keep_idx": torch.stack([torch.randperm(64, generator=g)[:16].sort().values for _ in range(8)]),
        "masked_index": torch.tensor([0, 3]),
    }
    if jitter:
        factors, order = A.draw_jitter(8, (0.32, 0.32, 0.32, 0.08), 0.8, rng)
        batch |= {"jitter": torch.from_numpy(factors), "jitter_order": torch.from_numpy(order)}
        rows = hue_rows_by_position(factors, order)  # as the collate step lists them on the host
        batch |= {f"hue_rows_{p}": torch.from_numpy(r) for p, r in enumerate(rows)}
        batch["gray"] = torch.from_numpy(A.draw_grayscale(8, 0.2, rng))
    return batch


@pytest.mark.parametrize("loss", ["prolip", "clip", "siglip"])
def test_train_step_never_syncs_the_host(loss: str) -> None:
    state = state_for(loss)
    train_step(state, uint8_batch(0))  # first step: optimizer state is created
    with SyncCounter() as sync:
        for seed in (1, 2):
            train_step(state, uint8_batch(seed))
    assert sync.events == [], "\n".join(sync.events)
    with SyncCounter() as control:  # the counter is not blind: the old count exchange is seen
        from training.train.distributed import exchange_counts

        exchange_counts([8, 1])
    assert any("tolist" in e for e in control.events)


def test_sigma_heads_are_float32_under_bf16_autocast() -> None:
    from training.train.step import autocast

    state = state_for("prolip", precision="bf16")
    model = state.module.model
    seen: dict[str, tuple] = {}
    for name, tower in (("image", model.visual), ("text", model.text)):
        tower.head.register_forward_hook(
            lambda m, args, out, name=name: seen.setdefault(name, (m, args, out))
        )
    batch = uint8_batch(0)
    with autocast(state.device, "bf16"):
        images = state.augment(batch)
        model.encode_image(images)
        model.encode_text(batch["tokens"])
    for name, (head, (_, h_unc), (mu, logvar)) in seen.items():
        assert mu.dtype == logvar.dtype == torch.float32
        w, b = head.logvar_proj.weight.detach().double(), head.logvar_proj.bias.detach().double()
        exact = torch.nn.functional.linear(h_unc.detach().double(), w, b)  # float64 on the same features
        assert float(exact.mean()) == pytest.approx(-10.0, abs=0.5)  # at the −10 init
        err = float((logvar.detach().double() - exact).abs().max())
        assert err < 5e-6, f"{name}: log σ² differs from float64 by {err:.1e} (float32 precision)"
        with torch.autocast("cpu", dtype=torch.bfloat16):  # what a bf16 head would have given
            rounded = head.logvar_proj(h_unc.to(torch.bfloat16)).detach().double()
        assert float((rounded - exact).abs().max()) > 1e-3, name
    # A whole bf16 step against the fp32 step from the same weights: σ² agrees far inside bf16's 1/16 grid.
    terms = {}
    for precision in ("fp32", "bf16"):
        st = state_for("prolip", precision=precision)
        _, feats = train_step(st, uint8_batch(0))
        terms[precision] = feats["logvar_v"].detach(), feats["logvar_t"].detach()
    for a, b in zip(terms["fp32"], terms["bf16"], strict=True):
        assert float((a - b).abs().max()) < 0.01


def _weights(state) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state.module.parameters()]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_a_nonfinite_step_is_skipped_and_counted(fused: bool) -> None:
    state = state_for("prolip", fused=fused)
    assert state.update.fused == fused
    train_step(state, uint8_batch(0))
    before, moments = (
        _weights(state),
        {k: v["exp_avg"].clone() for k, v in enumerate(state.opt.state.values())},
    )
    poisoned = uint8_batch(1)
    poisoned["images"] = torch.full((8, 3, 64, 64), float("nan"))  # a float batch passes the augment as is
    terms, feats = train_step(state, poisoned)
    assert not torch.isfinite(terms["total"]) and not torch.isfinite(feats["grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(state), strict=True))
    after = {k: v["exp_avg"] for k, v in enumerate(state.opt.state.values())}
    assert all(torch.equal(moments[k], after[k]) for k in moments)
    assert int(state.update.skipped) == 1 and state.step == 2  # counted; the step and schedule go on
    train_step(state, uint8_batch(2))
    assert int(state.update.skipped) == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, _weights(state), strict=True))


def test_fused_adamw_is_used_and_matches_foreach() -> None:
    state = state_for("clip", grad_clip=0.0)
    assert state.update.fused and state.opt.defaults["fused"]
    twin = state_for("clip", fused=False, grad_clip=0.0)
    for seed in range(3):
        train_step(state, uint8_batch(seed))
        train_step(twin, uint8_batch(seed))
    for a, b in zip(_weights(state), _weights(twin), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_compile_captures_one_graph_for_every_text_length(monkeypatch) -> None:
    """``compile=true`` with dynamic shapes: captions trimmed to 10, 12 and 7 tokens reuse one graph. The
    ``eager`` backend keeps Dynamo's capture and guards (what our code decides) without inductor's C++ build."""
    import torch._dynamo

    torch._dynamo.reset()
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: real(m, backend="eager", **kw))
    compiled, eager = state_for("prolip", compile=True), state_for("prolip")
    assert compiled.ddp is not compiled.module
    from torch._dynamo.utils import counters

    counters.clear()
    for length in (10, 12, 7):
        a, _ = train_step(compiled, uint8_batch(length, length))
        b, _ = train_step(eager, uint8_batch(length, length))
        torch.testing.assert_close(a["total"], b["total"], atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_config_rules_for_workers_and_batches() -> None:
    from pipeline.common.config import ConfigError
    from training.config import WorkersConfig

    uneven = TrainConfig(global_batch_size=100, scaling=WorkersConfig(num_workers=3, min_workers=2))
    assert uneven.world_sizes() == [2, 3]  # 3 does not divide 100: uneven local batches are allowed
    # A cap below the smallest world's local batch means micro-batches, not a refusal.
    capped = TrainConfig(
        global_batch_size=100, scaling=WorkersConfig(num_workers=3, min_workers=1, max_local_batch=60)
    )
    assert [capped.micro_batches(w) for w in capped.world_sizes()] == [2, 1, 1]
    with pytest.raises(ConfigError, match="global_batch_size"):
        TrainConfig(global_batch_size=2, scaling=WorkersConfig(num_workers=3))
    assert WorkersConfig().collective_timeout_s == 600
    assert DataConfig().pin_memory


@pytest.mark.gpu
@pytest.mark.parametrize("loss", ["prolip", "clip"])
def test_train_step_never_syncs_on_cuda(loss: str) -> None:
    """The same step on a GPU under CUDA's own check: ``set_sync_debug_mode("error")`` raises on any sync."""
    cfg = TrainConfig(model="tiny", global_batch_size=8, samples_seen=64, precision="bf16",
                      loss={"name": loss}, optim=OptimConfig(warmup_steps=1, grad_clip=1.0))  # fmt: skip
    state = setup_state(cfg, TOKENIZER, torch.device("cuda"), 0)
    assert state.update.fused
    batches = [{k: v.cuda() for k, v in uint8_batch(s).items()} for s in range(3)]
    train_step(state, batches[0])
    torch.cuda.set_sync_debug_mode("error")
    try:
        for b in batches[1:]:
            terms, feats = train_step(state, b)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(terms["total"]) and int(state.update.skipped) == 0
    if loss == "prolip":
        logvar = torch.cat([feats["logvar_v"], feats["logvar_t"]]).detach()
        assert logvar.dtype == torch.float32 and -15 < float(logvar.min()) and float(logvar.max()) < -5


@pytest.mark.gpu
def test_checkpoint_resume_on_cuda(tmp_path) -> None:
    from pipeline.ingest.tokenizer import train_tokenizer
    from training.train.checkpointing import save_state

    tok = train_tokenizer([f"a photo of a {w}" for w in ("cat", "dog", "bird", "fish")] * 10, vocab_size=64)
    cfg = TrainConfig(model="tiny", global_batch_size=8, samples_seen=64, precision="bf16",
                      optim=OptimConfig(warmup_steps=1))  # fmt: skip
    device = torch.device("cuda")
    state = setup_state(cfg, tok, device, 0)
    batch = {k: v.cuda() for k, v in uint8_batch(0).items()}
    batch["tokens"] %= tok.vocab_size
    batch["masked_tokens"] %= tok.vocab_size
    train_step(state, batch)
    save_state(str(tmp_path), state, tok)
    resumed = setup_state(cfg, tok, device, 0, restore_dir=str(tmp_path))
    assert resumed.step == 1 and next(resumed.module.parameters()).is_cuda
    for a, b in zip(state.module.parameters(), resumed.module.parameters(), strict=True):
        assert torch.equal(a, b)
    train_step(state, batch)
    train_step(resumed, batch)
    for a, b in zip(state.module.parameters(), resumed.module.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_decode_cores_per_h100_fit_what_a_gpu_node_supplies() -> None:
    """From the FLOPs counted on the meta device and the measured per-core decode rate: the cores each
    preset's H100 needs at 30% MFU, against the CPUs a GPU node of the cluster configs has per GPU once
    the Train worker took its own (p5.48xlarge: 192 vCPU for 8 GPUs; the KubeRay GPU pod's request)."""
    from pathlib import Path

    import yaml

    from pipeline.ingest.transforms import DECODE_SAMPLES_PER_CORE_224
    from training.config import TRAIN_PRESETS
    from training.model.config import model_config
    from training.model.flops import cores_needed, samples_per_s, train_flops_per_sample

    root = Path(__file__).resolve().parents[3]
    pod = yaml.safe_load((root / "cluster" / "kuberay" / "raycluster.yaml").read_text())
    gpu_group = next(g for g in pod["spec"]["workerGroupSpecs"] if g["groupName"] == "gpu")
    limits = gpu_group["template"]["spec"]["containers"][0]["resources"]["requests"]
    per_gpu = {"kuberay": float(limits["cpu"]) / float(limits["nvidia.com/gpu"]), "aws p5.48xlarge": 192 / 8}
    goal = {"datacomp-small": 20, "prolip-b16": 8}
    for preset, most in goal.items():
        cfg = TRAIN_PRESETS[preset]
        flops = train_flops_per_sample(model_config(cfg.model), masked=True)["total"]
        need = cores_needed(samples_per_s(flops), DECODE_SAMPLES_PER_CORE_224)
        assert need <= most, (preset, need)
        for where, cpus in per_gpu.items():
            assert need <= cpus - cfg.scaling.cpus_per_worker, (preset, where, need, cpus)


def test_the_sizing_line_a_gpu_run_prints_at_start() -> None:
    """``decode_sizing`` (printed only when ``scaling.use_gpu``): the preset's FLOPs, its H100 rate and the
    decode cores at the measured rate, the same figures as docs/gpu.md's table."""
    from training.config import TRAIN_PRESETS
    from training.model.config import objective_model_config
    from training.train.trainer import decode_sizing, h100_rate

    cfg = TRAIN_PRESETS[
        "datacomp-small"
    ]  # a ProLIP on ViT-B-32, its own text tower (as the trainer sizes it)
    mcfg = objective_model_config(cfg.model, probabilistic=True)
    flops, rate = h100_rate(cfg, mcfg)
    assert flops == pytest.approx(48.3e9, rel=1e-3) and rate == pytest.approx(6145, rel=1e-3)
    line = decode_sizing(cfg, mcfg)
    assert "48.3 GFLOP a sample" in line and "trains 6145 samples/s" in line and "≈17.9 decode cores" in line
