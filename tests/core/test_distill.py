"""The distillation term: KL of the next-token distributions, the LoRA-free view of a model."""

import pytest
import torch

from compresskit.distill import DistillConfig, kl_loss, lora_off


def test_kl_is_zero_when_student_equals_teacher_and_positive_otherwise():
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(2, 5, 50, generator=gen)
    s = torch.randn(2, 5, 50, generator=gen)
    for kw in ({}, {"temperature": 2.0}, {"top_k": 7}):
        assert kl_loss(t, t, **kw).item() == pytest.approx(0.0, abs=1e-6)
        assert kl_loss(s, t, **kw).item() > 0.05
    # T^2 scaling; the mask averages over the real tokens only (whatever the padded positions hold)
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    garbage = s.clone()
    garbage[1, 3:] = 1e4
    assert kl_loss(garbage, t, mask).item() == pytest.approx(kl_loss(s, t, mask).item())
    full = kl_loss(s, t, mask)
    by_hand = sum(kl_loss(s[b, :n][None], t[b, :n][None]) * n for b, n in ((0, 5), (1, 3))) / 8
    assert full.item() == pytest.approx(by_hand.item(), rel=1e-5)


def test_kl_with_top_k_of_the_whole_vocabulary_is_the_full_kl():
    gen = torch.Generator().manual_seed(1)
    s, t = torch.randn(1, 4, 30, generator=gen), torch.randn(1, 4, 30, generator=gen)
    assert kl_loss(s, t, top_k=30).item() == pytest.approx(kl_loss(s, t).item(), rel=1e-5)


def test_config_bounds():
    with pytest.raises(ValueError):
        DistillConfig(weight=0.0)
    with pytest.raises(ValueError):
        DistillConfig(temperature=0)
    assert DistillConfig().weight == 0.5


def test_lora_off_gives_the_base_model_and_leaves_training_flags(tiny_model_dir):
    from compresskit.modeling import load_model
    from compresskit.trainers import LoraStageConfig, inject_lora, lora_parameters

    model, _ = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    ids = torch.randint(2, 300, (1, 9))
    with torch.no_grad():
        base = model(ids).logits
    inject_lora(model, LoraStageConfig(r=2, alpha=4))
    model.eval()  # the new adapters' dropout too
    params = lora_parameters(model)
    with torch.no_grad():
        for p in params:
            p.add_(0.5)  # adapters that change the output
        adapted = model(ids).logits
        with lora_off(model):
            off = model(ids).logits
    assert not torch.allclose(adapted, base)
    torch.testing.assert_close(off, base)
    flags = [p.requires_grad for p in params]
    with lora_off(model):
        pass
    assert [p.requires_grad for p in params] == flags
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, adapted)
