"""The flow-matching acoustic model: streaming == offline at fixed noise over several chunkings, constant
per-chunk cost (FLOPs and attended keys), determinism, batched == one by one, bounded encoder lookahead,
and exact resumption of training. Tiny seeded models, no weights."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tts.flow_model import FlowConfig, FlowModel, FlowState
from tts.training.train_flow import Trainer

CFG = FlowConfig(
    latent_dim=4,
    enc_dim=32,
    enc_layers=2,
    enc_heads=2,
    dim=32,
    layers=2,
    heads=2,
    t_dim=16,
    chunk=4,
    left_chunks=2,
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_model(seed: int = 0) -> FlowModel:
    torch.manual_seed(seed)
    m = FlowModel(CFG)
    with torch.no_grad():  # the zero-initialised (adaLN-zero) layers would make every test trivially pass
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
        m.latent_mean.copy_(0.1 * torch.randn(CFG.latent_dim))
        m.latent_std.copy_(0.5 + torch.rand(CFG.latent_dim))
    return m.eval()


def ids(n: int = 17, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, 170, (1, n), generator=g)
    x[0, 0] = x[0, -1] = 0
    return x


def stream(m: FlowModel, cond, chunk: int, left: int, steps: int, seed: int = 0) -> torch.Tensor:
    st = m.init_state(1, steps, chunk, left, seed=seed)
    outs = []
    for a in range(0, cond.cond.shape[1], chunk):
        y, st = m.step(st, *cond.slice(a, a + chunk))
        outs.append(y)
    return torch.cat(outs, 1)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("left", [1, 3])
def test_streaming_equals_offline(chunk: int, left: int) -> None:
    m = tiny_model()
    cond = m.condition(ids())
    assert cond.cond.shape[1] > 2 * chunk  # several chunks, the last one partial for most sizes
    offline = m.sample(cond, steps=3, chunk=chunk, left_chunks=left, seed=7)
    torch.testing.assert_close(stream(m, cond, chunk, left, 3, seed=7), offline, atol=1e-5, rtol=1e-5)


def test_chunk_mask_is_causal_across_chunks() -> None:
    """Changing chunk 3's conditions changes chunk 3 and leaves the chunks before it untouched."""
    m = tiny_model()
    cond = m.condition(ids(40))
    chunk, left = 3, 1
    base = m.sample(cond, steps=2, chunk=chunk, left_chunks=left)
    cond.cond[:, 9:12] += torch.randn_like(cond.cond[:, 9:12])
    changed = m.sample(cond, steps=2, chunk=chunk, left_chunks=left)
    torch.testing.assert_close(base[:, :9], changed[:, :9])
    assert not torch.allclose(base[:, 9:12], changed[:, 9:12])


@pytest.mark.parametrize("steps", [2, 4, 8])
def test_constant_cost_per_chunk(steps: int) -> None:
    """Chunk 50 costs what chunk 2 costs: same FLOPs, same attended keys, same state size."""
    m = tiny_model()
    n_frames = 52 * CFG.chunk
    cond = m.condition(ids(120))
    cond_cond = cond.cond[:, :1].expand(1, n_frames, -1)
    mu = cond.mu[:, :1].expand(1, n_frames, -1)
    st = m.init_state(1, steps)
    flops, sizes, keys = {}, {}, {}
    for c in range(52):
        a = c * CFG.chunk
        if c in (2, 50):
            sizes[c] = sum(t.numel() for t in (st.conv, st.key, st.value, st.valid))
            keys[c] = FlowModel.attended_keys(st, CFG.chunk)
            with FlopCounterMode(display=False) as fc:
                _, st = m.step(st, cond_cond[:, a : a + CFG.chunk], mu[:, a : a + CFG.chunk])
            flops[c] = fc.get_total_flops()
        else:
            _, st = m.step(st, cond_cond[:, a : a + CFG.chunk], mu[:, a : a + CFG.chunk])
    assert flops[2] == flops[50] > 0
    assert keys[2] == keys[50] == (CFG.left_chunks + 1) * CFG.chunk
    assert sizes[2] == sizes[50]


def test_deterministic_and_seeded() -> None:
    m = tiny_model()
    cond = m.condition(ids())
    a = stream(m, cond, 4, 2, 4, seed=3)
    b = stream(m, cond, 4, 2, 4, seed=3)
    c = stream(m, cond, 4, 2, 4, seed=4)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_batched_step_equals_one_by_one() -> None:
    """Sessions at different places of different utterances, stacked in one step."""
    m = tiny_model()
    conds = [m.condition(ids(n, seed=s)) for n, s in ((17, 1), (25, 2), (30, 3))]
    states = []
    for i, cond in enumerate(conds):  # advance each by a different number of chunks
        st = m.init_state(1, 3, seed=10 * i)
        for a in range(0, 4 * i, 4):
            _, st = m.step(st, *cond.slice(a, a + 4))
        states.append(st)
    pos = [4 * i for i in range(3)]
    one = [m.step(st, *c.slice(p, p + 4)) for st, c, p in zip(states, conds, pos, strict=True)]
    cond = torch.cat([c.slice(p, p + 4)[0] for c, p in zip(conds, pos, strict=True)])
    mu = torch.cat([c.slice(p, p + 4)[1] for c, p in zip(conds, pos, strict=True)])
    y, st = m.step(FlowState.stack(states), cond, mu)
    for i, (y1, s1) in enumerate(one):
        torch.testing.assert_close(y[i : i + 1], y1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(st.unbind()[i].key, s1.key, atol=1e-5, rtol=1e-5)


def test_encoder_lookahead_is_bounded() -> None:
    """Phoneme i's encoding depends on phonemes <= i + lookahead only (the rest may still be unknown)."""
    m = tiny_model()
    x = ids(30)
    full = m.encoder(x)
    k = 12
    prefix = m.encoder(x[:, : k + CFG.lookahead])
    torch.testing.assert_close(prefix[:, :k], full[:, :k], atol=1e-5, rtol=1e-5)
    shorter = m.encoder(x[:, : k + CFG.lookahead - 1])
    assert not torch.allclose(shorter[:, k - 1], full[:, k - 1], atol=1e-5)


def test_every_phoneme_gets_frames() -> None:
    """Regulating at 80 Hz keeps phonemes shorter than a codec frame (25 ms < 37.5 ms)."""
    m = tiny_model()
    units = torch.ones(1, 9, dtype=torch.long)
    cond = m.regulate(m.encoder(ids(9)), units)
    assert cond.cond.shape[1] == -(-9 * 2 // 3)


def synthetic_source(i: int) -> dict:
    r = np.random.default_rng(i)
    p = int(r.integers(6, 14))
    units = torch.from_numpy(r.integers(1, 4, p))
    n = int(units.sum()) * 2 // 3
    return {
        "ids": torch.from_numpy(r.integers(1, 170, p)),
        "units": units,
        "y": torch.from_numpy(r.uniform(-1, 1, (n, CFG.latent_dim)).astype(np.float16)),
    }


def make() -> Trainer:
    """A tiny trainer on synthetic data (the recipe's loop, seconds per step)."""

    return Trainer(
        CFG, synthetic_source, pool_size=12, batch=3, norm_examples=4, warmup=2, log=lambda _: None
    )


def test_resume_gives_identical_next_loss() -> None:
    a = make()
    a.start()
    for _ in range(3):
        a.step()
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    expected = a.step()
    b = make()
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=False))
    b.start()
    got = b.step()
    assert got["total"] == expected["total"]
    assert b.step()["total"] == a.step()["total"]


def test_a_run_starts_from_exported_weights(tmp_path) -> None:
    """What the repository ships (fp16 EMA, no optimiser) is enough to continue training: the new run's
    model and EMA are the export's, at its step and data position, with the lr warming up again."""
    from safetensors.torch import save_file

    a = make()
    a.start()
    for _ in range(3):
        a.step()
    tensors = {k: v.half().contiguous() for k, v in a.ema.state_dict().items() if v.is_floating_point()}
    save_file(tensors, str(tmp_path / "flow_model.safetensors"))
    meta = {"config": CFG.to_dict(), "step": a.step_n, "examples_seen": a.pos}
    (tmp_path / "flow_model.json").write_text(__import__("json").dumps(meta))
    b = make()
    b.init_from_export(tmp_path)
    assert (b.step_n, b.pos, b.rewarm_from) == (3, a.pos, 3)
    for k, v in b.ema.state_dict().items():
        assert torch.equal(v, a.ema.state_dict()[k].half().float()), k
    assert b.lr_at(3) == pytest.approx(b.lr * 0.5 * 0.5 ** (3 / b.lr_halflife))  # warming up again
    b.start()
    assert np.isfinite(b.step()["total"]) and b.step_n == 4


def test_training_then_euler_sampling_reproduces_a_memorised_target() -> None:
    """The loss, the time convention and the sampler agree: a tiny model that memorises one utterance
    samples it back (chunked, at fixed noise), better with more Euler steps."""
    from tts.training.train_flow import flow_loss

    torch.manual_seed(0)
    cfg = FlowConfig(
        latent_dim=4, enc_dim=32, enc_layers=1, dim=48, layers=2, t_dim=16, chunk=4, left_chunks=2
    )
    m = FlowModel(cfg)
    x = torch.tensor([[0, 5, 9, 16, 30, 41, 2, 0]])
    units = torch.tensor([[2, 1, 3, 1, 2, 2, 1, 3]])
    n = int(units.sum()) * 2 // 3
    y = torch.sin(torch.arange(n)[:, None] * 0.7 + torch.arange(4)[None]) * 0.8
    batch = {
        "ids": x.repeat(8, 1),
        "units": units.repeat(8, 1),
        "valid": torch.ones(8, 8, dtype=torch.bool),
        "y": y[None].repeat(8, 1, 1),
        "frames": torch.full((8,), n),
    }
    opt = torch.optim.Adam(m.parameters(), 3e-3)
    gen = torch.Generator().manual_seed(0)
    for i in range(200):
        loss, _ = flow_loss(m, batch, gen, 4 if i % 2 else None, 2)
        opt.zero_grad()
        loss.backward()
        opt.step()
    m.eval()
    cond = m.condition(x, units=units)
    err = {s: float(((m.sample(cond, steps=s, chunk=4, left_chunks=2)[0] - y) ** 2).mean()) for s in (2, 8)}
    assert err[8] < 0.05 * float((y**2).mean())
    assert err[8] < err[2]


def test_a_run_for_a_wider_latent_warm_starts_from_exported_weights(tmp_path) -> None:
    """--warm-start: a run on a codec with another latent width copies every tensor whose shape matches
    (phoneme encoder, durations, the estimator's body) and starts the latent's projections new, at step 0."""
    from dataclasses import replace

    from safetensors.torch import save_file

    a = make()
    a.start()
    a.step()
    tensors = {k: v.half().contiguous() for k, v in a.ema.state_dict().items() if v.is_floating_point()}
    save_file(tensors, str(tmp_path / "flow_model.safetensors"))
    wide = replace(CFG, latent_dim=CFG.latent_dim + 2)
    b = Trainer(wide, synthetic_source, pool_size=12, batch=3, norm_examples=4, warmup=2, log=lambda _: None)
    copied, new = b.warm_start(tmp_path)
    assert {"prior.weight", "x_in.weight", "out.weight", "latent_mean"} <= set(new)
    assert copied and not set(copied) & set(new)
    for k in copied:
        assert torch.equal(b.model.state_dict()[k], tensors[k].float()), k
        assert torch.equal(b.ema.state_dict()[k], tensors[k].float()), k
    assert b.step_n == 0 and not b.norm_ready
    with pytest.raises(SystemExit, match="no tensor matches"):
        save_file({"nothing": torch.zeros(1)}, str(tmp_path / "flow_model.safetensors"))
        b.warm_start(tmp_path)


def test_a_deeper_run_grows_from_exported_weights_computing_the_same(tmp_path) -> None:
    """--grow: more estimator blocks and encoder layers, started from an export, compute exactly what the
    export computes (new blocks are identity), continue its step and data position, and then train."""
    import json
    from dataclasses import replace

    from safetensors.torch import save_file

    a = make()
    a.start()
    for _ in range(2):
        a.step()
    tensors = {k: v.half().contiguous() for k, v in a.ema.state_dict().items() if v.is_floating_point()}
    save_file(tensors, str(tmp_path / "flow_model.safetensors"))
    (tmp_path / "flow_model.json").write_text(
        json.dumps({"config": CFG.to_dict(), "step": a.step_n, "examples_seen": a.pos})
    )
    ref = FlowModel(CFG)
    ref.load_state_dict({k: v.float() for k, v in tensors.items()})
    deep = replace(CFG, layers=CFG.layers + 2, enc_layers=CFG.enc_layers + 1)
    b = Trainer(deep, synthetic_source, pool_size=12, batch=3, norm_examples=4, warmup=2, log=lambda _: None)
    new = b.grow_from_export(tmp_path)
    assert any(k.startswith(f"blocks.{CFG.layers}.") for k in new)
    assert any(k.startswith(f"encoder.layers.{CFG.enc_layers}.") for k in new)
    assert (b.step_n, b.pos, b.rewarm_from) == (2, a.pos, 2)
    x, units = ids(9), torch.full((1, 9), 2)
    with torch.no_grad():
        for m in (b.model, b.ema):
            m.eval()
            want = ref.sample(ref.condition(x, units=units), steps=2, chunk=CFG.chunk, left_chunks=1)
            got = m.sample(m.condition(x, units=units), steps=2, chunk=CFG.chunk, left_chunks=1)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    b.start()
    assert np.isfinite(b.step()["total"]) and b.step_n == 3
    assert any(
        float(p.abs().sum()) > 0
        for n, p in b.model.named_parameters()
        if n.startswith(f"blocks.{CFG.layers}.mod")
    )
    wider = replace(CFG, dim=CFG.dim + 16)
    c = Trainer(wider, synthetic_source, pool_size=12, batch=3, norm_examples=4, warmup=2, log=lambda _: None)
    with pytest.raises(SystemExit, match="only adds"):
        c.grow_from_export(tmp_path)
