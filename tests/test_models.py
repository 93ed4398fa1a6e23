"""Benchmark models: the reference parameter counts, and that every code path trains."""

from __future__ import annotations

import pytest
import torch

from benchmarks import models


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_resnet50_has_torchvisions_parameter_count() -> None:
    assert n_params(models.resnet50()) == 25_557_032


def test_vgg16_has_torchvisions_parameter_count() -> None:
    assert n_params(models.vgg16()) == 138_357_544


def test_bert_base_has_bertmodels_parameter_count_plus_documented_head() -> None:
    model = models.bert_base(num_labels=2)
    assert models.encoder_params(model) == 109_482_240
    assert n_params(model) == 109_482_240 + 769 * 2


@pytest.mark.parametrize("name", ["resnet50", "vgg16", "bert_base"])
def test_registry_builds_the_full_size_models(name: str) -> None:
    expected = {"resnet50": 25_557_032, "vgg16": 138_357_544, "bert_base": 109_483_778}[name]
    assert n_params(models.build(name).make_model()) == expected


@pytest.mark.parametrize("name", ["resnet_tiny", "vgg_tiny", "bert_tiny"])
def test_tiny_variants_train(name: str) -> None:
    w = models.build(name, batch_size=3)
    torch.manual_seed(0)
    model = w.make_model()
    x, y = w.make_batch(torch.Generator().manual_seed(0))
    assert x.shape[0] == y.shape[0] == 3
    loss = w.loss(model(x), y)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())
    assert w.blocks(model) and all(b in set(model.modules()) for b in w.blocks(model))


def test_resnet50_forward_backward_at_a_tiny_image_size() -> None:
    w = models.build("resnet50", image_size=32, batch_size=2)
    model = w.make_model()
    x, y = w.make_batch(torch.Generator().manual_seed(0))
    out = model(x)
    assert out.shape == (2, 1000)
    w.loss(out, y).backward()
    assert model.conv1.weight.grad is not None
    assert len(w.blocks(model)) == 16


def test_models_and_batches_are_deterministic() -> None:
    w = models.build("bert_tiny")
    torch.manual_seed(0)
    a = w.make_model()
    torch.manual_seed(0)
    b = w.make_model()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    xa, ya = w.make_batch(torch.Generator().manual_seed(7))
    xb, yb = w.make_batch(torch.Generator().manual_seed(7))
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(a(xa), b(xb))


def test_knobs_change_the_batch_and_bad_knobs_are_refused() -> None:
    x, y = models.build("bert_tiny", seq_len=8, batch_size=5).make_batch(torch.Generator())
    assert x.shape == (5, 8) and y.shape == (5,)
    x, _ = models.build("resnet_tiny", image_size=16).make_batch(torch.Generator(), batch_size=2)
    assert x.shape == (2, 3, 16, 16)
    with pytest.raises(TypeError, match="unknown knobs"):
        models.build("resnet_tiny", seq_len=8)
    with pytest.raises(ValueError, match="unknown model"):
        models.build("resnet51")
    with pytest.raises(ValueError, match="positions"):
        models.build("bert_tiny", seq_len=65)
