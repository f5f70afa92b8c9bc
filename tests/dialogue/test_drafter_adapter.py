"""The distilled drafter: LoRA training pieces (dialogue/training/train_drafter.py) and the shipped adapter's
loading (dialogue/drafter_adapter.py), on tiny seeded models and the test tokenizer of test_engine.

They prove: the adapter file applied to a fresh base model gives the same model that was trained
(pruned layers renumbered for the KV cache, LoRA merged, norms copied), and the lean forward runs
it exactly; a few steps of distillation learn a target answer; the drafting evaluation counts
matching words; mismatched or broken adapters and heads trained for another drafter are refused
with a message that says what to do.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import DynamicCache

from dialogue import drafter_adapter as DA
from dialogue.fast_decoder import FastDecoder
from dialogue.training import train_drafter as TD
from duplex.base.errors import ModelError
from tests.dialogue.test_engine import tiny
from tests.dialogue.test_engine import tokenizer as tokenizer  # noqa: F401  (the module-scoped fixture)

SYSTEM = "You are a friendly voice assistant on a phone call."


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def four_layers(vocab: int = 400, seed: int = 0):
    m = tiny("llama", vocab, seed)
    extra = tiny("llama", vocab, seed + 1)
    m.model.layers.extend(copy.deepcopy(extra.model.layers))  # 4 layers
    for i, layer in enumerate(m.model.layers):
        layer.self_attn.layer_idx = i
    m.config.num_hidden_layers = 4
    if getattr(m.config, "layer_types", None) is not None:
        m.config.layer_types = ["full_attention"] * 4
    return m


def write_adapter(model, kept: list[int], path: Path, sha: str = "ab" * 32) -> None:
    save_file({k: v.contiguous() for k, v in TD.adapter_tensors(model).items()}, str(path))
    path.with_suffix(".json").write_text(
        json.dumps({"format": DA.FORMAT, "base_sha256": sha, "kept_layers": kept, "rank": 4, "alpha": 8.0})
    )


def trained_like(base, kept: list[int]):
    """The base, pruned to `kept`, with LoRA whose B is non-zero and norms moved (as after training)."""
    m = copy.deepcopy(base)
    DA.keep_layers(m, kept)
    TD.add_lora(m, rank=4, alpha=8.0, dropout=0.0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, TD.LoraLinear):
                mod.lora_b.copy_(torch.randn(mod.lora_b.shape, generator=g) * 0.05)
        for layer in m.model.layers:
            layer.input_layernorm.weight.mul_(1.1)
    return m.eval()


def test_the_adapter_file_rebuilds_the_trained_model(tmp_path: Path) -> None:
    base = four_layers()
    kept = [0, 2, 3]
    trained = trained_like(base, kept)
    path = tmp_path / "ad.safetensors"
    write_adapter(trained, kept, path)
    fresh = copy.deepcopy(base)
    info = DA.apply_adapter(fresh, path, base_sha256="AB" * 32)  # the sha check ignores case
    assert info.kept_layers == kept and len(fresh.model.layers) == 3
    assert [ly.self_attn.layer_idx for ly in fresh.model.layers] == [0, 1, 2]
    ids = torch.tensor([[5, 9, 17, 33, 2, 8]])
    with torch.inference_mode():
        want = TD.merge_lora(trained).model(input_ids=ids).last_hidden_state
        lora_out = trained.model(input_ids=ids).last_hidden_state
        got = fresh.model(input_ids=ids).last_hidden_state
        fast = FastDecoder(copy.deepcopy(fresh)).forward(
            DynamicCache(config=fresh.config), ids[0].tolist(), 0
        )
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(lora_out, want, atol=1e-5)
    assert torch.equal(fast, got)


def test_adapter_errors_say_what_to_do(tmp_path: Path) -> None:
    base = four_layers()
    with pytest.raises(ModelError, match="train_drafter"):
        DA.apply_adapter(copy.deepcopy(base), tmp_path / "missing.safetensors")
    path = tmp_path / "ad.safetensors"
    write_adapter(trained_like(base, [0, 1, 3]), [0, 1, 3], path)
    with pytest.raises(ModelError, match="trained on base weights"):
        DA.apply_adapter(copy.deepcopy(base), path, base_sha256="cd" * 32)
    other = tiny("llama", 400, 3)  # 2 layers: kept index 3 does not exist
    with pytest.raises(ModelError, match="kept layers"):
        DA.apply_adapter(other, path)
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(ModelError, match="cannot read"):
        DA.apply_adapter(copy.deepcopy(base), path)
    path.with_suffix(".json").write_text("{")
    with pytest.raises(ModelError, match="not valid JSON"):
        DA.read_adapter_info(path)


def test_heads_trained_for_another_drafter_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "ad.safetensors"
    write_adapter(trained_like(four_layers(), [0, 1, 2, 3]), [0, 1, 2, 3], path)
    sha = DA.adapter_sha256(path)
    DA.check_trained_with("heads", {"drafter": {"adapter_sha256": sha}}, path)
    DA.check_trained_with("heads", {"drafter": {}}, None)
    with pytest.raises(ModelError, match="retrain them"):
        DA.check_trained_with("heads", {"drafter": {}}, path)
    with pytest.raises(ModelError, match="no adapter"):
        DA.check_trained_with("heads", {"drafter": {"adapter_sha256": sha}}, None)
    assert DA.adapter_path("shipped") == DA.DEFAULT_ADAPTER and DA.adapter_path(None) is None
    assert DA.adapter_path("none") is None and DA.adapter_path("x.safetensors") == Path("x.safetensors")


def test_a_few_steps_of_distillation_learn_the_answer(tokenizer) -> None:  # noqa: F811
    torch.manual_seed(0)
    model = tiny("llama", len(tokenizer), 4).train()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # a trained head is confident; a random one of std 0.02 is not
    rows = [
        {"key": f"k{i}", "split": "train", "history": [], "text": q, "answer": a, "ended": True}
        for i, (q, a) in enumerate(
            [
                ("what is the capital of france", "the capital of france is paris"),
                ("how are you today", "i am fine thanks"),
            ]
        )
    ]
    examples = TD.build_examples(tokenizer, SYSTEM, rows)
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert examples[0].target[-1] == stop  # an answer that ended teaches the end of turn too
    assert (
        examples[0].prompt
        == tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": rows[0]["text"]}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
    )
    TD.add_lora(model, rank=8, alpha=16.0, dropout=0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all(
        not p.requires_grad for n, p in model.named_parameters() if n.endswith("base.weight")
    )
    opt = torch.optim.AdamW(params, lr=1e-2)
    pad = tokenizer.pad_token_id
    first = TD.mean_loss(model, examples, pad)
    model.train()
    for _ in range(150):
        loss, n = TD.batch_loss(model, examples, pad)
        opt.zero_grad()
        (loss / n).backward()
        opt.step()
    assert TD.mean_loss(model, examples, pad) < 0.2 * first
    rates = TD.match_rates(TD.merge_lora(model).eval(), tokenizer, SYSTEM, examples)
    assert rates["n"] == 2 and rates["match_1w"] == 1.0 and rates["match_3w"] == 1.0


def test_the_shared_system_prompt_runs_once_with_the_same_loss_and_gradients(tokenizer) -> None:  # noqa: F811
    model = tiny("qwen2", len(tokenizer), 8).train()
    TD.add_lora(model, rank=4, alpha=8.0, dropout=0.0)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, TD.LoraLinear):
                mod.lora_b.normal_(0, 0.1)
    rows = [
        {"key": str(i), "split": "train", "history": [], "text": q, "answer": a, "ended": i % 2 == 0}
        for i, (q, a) in enumerate(
            [
                ("tell me a story please", "once upon a time there was a cat"),
                ("how are you today", "i am fine thanks"),
                ("what is two plus two", "two plus two is four"),
            ]
        )
    ]
    batch = TD.build_examples(tokenizer, SYSTEM, rows)
    assert TD.shared_prefix([e.prompt + e.target for e in batch]) >= 5
    grads = []
    for share in (False, True):
        model.zero_grad()
        loss, n = TD.batch_loss(model, batch, tokenizer.pad_token_id, share=share)
        loss.backward()
        grads.append(
            (float(loss.detach()), n, [p.grad.clone() for p in model.parameters() if p.requires_grad])
        )
    (l0, n0, g0), (l1, n1, g1) = grads
    assert n0 == n1 and l1 == pytest.approx(l0, rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(g0, g1, strict=True))


def test_layer_choice_keeps_ends_and_most_influential() -> None:
    assert TD.choose_layers([0.5, 0.1, 0.3, 0.05, 0.2, float("inf")], 4) == [0, 2, 4, 5]
    with pytest.raises(ValueError):
        TD.choose_layers([0.1, 0.2], 3)
    assert TD.words("The capital, of France is", 3) == ["the", "capital", "of"]
