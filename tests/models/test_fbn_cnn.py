import pytest
import torch
from torch import nn

from fednorm.models.fbn import FederatedBatchNorm2d
from fednorm.models.fbn_cnn import FBNCNN
from fednorm.models.norm import NORM_KINDS
from fednorm.models.wsconv import WSConv2d


def layers(module, kind):
    return [m for m in module.modules() if isinstance(m, kind)]


def test_table1_architecture_and_parameter_count():
    model = FBNCNN()
    convs = layers(model, nn.Conv2d)
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.stride, c.padding) for c in convs] == [
        (3, 64, (3, 3), (1, 1), (1, 1)), (64, 64, (3, 3), (1, 1), (1, 1)),
        (64, 128, (3, 3), (1, 1), (1, 1)), (128, 128, (3, 3), (1, 1), (1, 1))]
    assert [b.num_features for b in layers(model, nn.BatchNorm2d)] == [64, 64, 128, 128]
    assert [(f.in_features, f.out_features) for f in layers(model, nn.Linear)] == [(8192, 128), (128, 10)]
    assert [d.p for d in layers(model, nn.Dropout)] == [0.25, 0.25]
    assert len(layers(model, nn.MaxPool2d)) == 2
    # the extraction's count (Section 5.1): 1,310,922 trainable parameters incl. 768 BN affine ones
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 1_310_922
    assert sum(p.numel() for b in layers(model, nn.BatchNorm2d) for p in b.parameters()) == 768
    assert sum(b.running_mean.numel() + b.running_var.numel() for b in layers(model, nn.BatchNorm2d)) == 768


def test_conv_relu_bn_order():
    kinds = [type(m) for m in FBNCNN().features]
    block = [nn.Conv2d, nn.ReLU, nn.BatchNorm2d]
    pool = [nn.MaxPool2d, nn.Dropout]
    assert kinds == block + block + pool + block + block + pool


# MNIST-M's 28x28 adaptation: only the first FC layer's input shrinks (8192 -> 6272 features into 128 units)
@pytest.mark.parametrize("size, flat, count", [(32, 128 * 8 * 8, 1_310_922),
                                               (28, 128 * 7 * 7, 1_310_922 - (8192 - 6272) * 128)])
def test_output_shapes_and_flatten_size(size, flat, count):
    model = FBNCNN(image_size=size).eval()
    assert layers(model, nn.Linear)[0].in_features == flat
    assert sum(p.numel() for p in model.parameters()) == count
    assert model(torch.zeros(2, 3, size, size)).shape == (2, 10)


def test_width_norms_and_channels():
    model = FBNCNN(width=0.125, num_classes=7, in_channels=1, image_size=28)
    assert [c.out_channels for c in layers(model, nn.Conv2d)] == [8, 8, 16, 16]
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 7)
    gn = FBNCNN(norm="gn", width=0.25)
    assert len(layers(gn, nn.GroupNorm)) == 4 and not layers(gn, nn.BatchNorm2d)
    assert gn(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    ws = FBNCNN(norm="ws", width=0.25)
    assert len(layers(ws, WSConv2d)) == 4 and not layers(ws, (nn.BatchNorm2d, nn.GroupNorm))
    assert not layers(FBNCNN(norm="none", width=0.25), (nn.BatchNorm2d, nn.GroupNorm))


def test_the_model_returns_logits_so_cross_entropy_is_the_papers_logsoftmax_nll_once():
    """The paper's net ends in log-softmax + NLL; here the model returns the last linear layer's raw output and
    the loss (cross-entropy) applies the log-softmax: a model that returned log-probabilities already would have
    them normalized twice in training."""
    torch.manual_seed(0)
    model = FBNCNN(width=0.125).eval()
    seen = {}
    model.features.register_forward_hook(lambda module, args, out: seen.update(features=out))
    z = model(torch.randn(4, 3, 32, 32))
    fc1, fc2 = layers(model, nn.Linear)
    # exactly FC2(ReLU(FC1(flattened features))): no softmax, log-softmax or ReLU after the last layer
    torch.testing.assert_close(z, fc2(torch.relu(fc1(seen["features"].flatten(1)))), rtol=0, atol=0)
    assert not torch.allclose(torch.logsumexp(z, dim=1), torch.zeros(4), atol=1e-3)  # not log-probabilities


def test_bad_arguments():
    with pytest.raises(ValueError, match="divisible by 4"):
        FBNCNN(image_size=30)
    with pytest.raises(ValueError, match="image_size=28"):
        FBNCNN(width=0.125)(torch.zeros(1, 3, 28, 28))
    with pytest.raises(ValueError, match="unknown normalization"):
        FBNCNN(norm="batch")


@pytest.mark.parametrize("norm", NORM_KINDS)
def test_every_normalization_keeps_the_papers_parameter_count_where_it_applies(norm):
    """Table 1's CNN with any normalization: BN and FBN (the paper's count, 1,310,922), GN, LN and IN (the same
    per-channel affine, 2 x 384) keep the paper's trainable count; without normalization the 768 affine parameters
    go, and WSConv adds its 384 gains (one per output channel). FBN has BN's running statistics and nothing else."""
    torch.manual_seed(0)
    model = FBNCNN(norm=norm).train()
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    expected = {"none": 1_310_922 - 768, "ws": 1_310_922 - 768 + 384}.get(norm, 1_310_922)
    assert count == expected
    if norm in ("bn", "fbn"):
        bns = layers(model, (nn.BatchNorm2d, FederatedBatchNorm2d))
        assert len(bns) == 4 and all(isinstance(b, FederatedBatchNorm2d) == (norm == "fbn") for b in bns)
        assert sum(b.running_mean.numel() + b.running_var.numel() for b in bns) == 768
        assert sum(buf.numel() for buf in model.buffers()) == 768 + 4  # and each layer's num_batches_tracked
    out = model(torch.randn(2, 3, 32, 32))
    out.sum().backward()
    assert out.shape == (2, 10) and all(p.grad is not None for p in model.parameters())
