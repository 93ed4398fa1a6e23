"""Benchmark models in plain torch (torchvision does not import beside our torch) and their data.

The three models of the DeAR paper, with the parameter counts of the reference models, so the
gradient volume (what a data-parallel method must communicate) is the real one:

    resnet50   25,557,032  torchvision resnet50 (v1.5: stride on the 3x3 conv)
    vgg16     138,357,544  torchvision vgg16 (no batch norm)
    bert_base 109,482,240  bert-base-uncased BertModel incl. pooler, plus a classification head
                           Linear(768, num_labels): + 769 * num_labels (+1,538 for 2 labels)

Compute is what we scale for a CPU: the image size and sequence length change the work per
sample but not the parameter count (VGG's adaptive pool keeps the classifier at 25088 inputs;
BERT keeps 512 positions). Measured on this 2-core box, one thread, SGD step included, a
training iteration takes: resnet50 image_size 96 batch 8: 0.99 s (image_size 64: 0.65 s);
vgg16 image_size 32 batch 8: 1.09 s; bert_base seq_len 32 batch 4: 1.05 s. Check with
`python -m benchmarks.models resnet50 --time --batch 8 --image-size 96`.

`build(name, **knobs)` returns a `Workload`: how to make the model (call after
torch.manual_seed; every init is drawn from torch's RNG), synthetic batches from a
torch.Generator, the loss, and the blocks FSDP2 shards one by one. The `*_tiny` variants run the
same classes at toy sizes for tests. Dropout defaults to 0 in `build` so that every method sees
the same function and loss trajectories can be compared; pass dropout=... to change it.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# ---------------------------------------------------------------- ResNet (torchvision layout)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.downsample: Optional[nn.Module] = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        return F.relu(h + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    def __init__(self, layers: list[int], num_classes: int = 1000, width: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        stages, inplanes = [], width
        for i, n in enumerate(layers):
            planes = width * 2 ** i
            blocks = [Bottleneck(inplanes, planes, stride=1 if i == 0 else 2)]
            inplanes = planes * Bottleneck.expansion
            blocks += [Bottleneck(inplanes, planes) for _ in range(n - 1)]
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(inplanes, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, stride=2, padding=1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet50(num_classes: int = 1000) -> ResNet:
    return ResNet([3, 4, 6, 3], num_classes)


# ---------------------------------------------------------------- VGG (torchvision layout)

VGG16_CFG: list[Any] = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
                        512, 512, 512, "M", 512, 512, 512, "M"]


class VGG(nn.Module):
    def __init__(self, cfg: list[Any], num_classes: int = 1000, hidden: int = 4096,
                 pool: int = 7, dropout: float = 0.5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(channels, v, 3, padding=1), nn.ReLU(inplace=True)]
                channels = v
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(pool)
        self.classifier = nn.Sequential(
            nn.Linear(channels * pool * pool, hidden), nn.ReLU(True), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(True), nn.Dropout(dropout),
            nn.Linear(hidden, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def vgg16(num_classes: int = 1000, dropout: float = 0.5) -> VGG:
    return VGG(VGG16_CFG, num_classes, dropout=dropout)


# ---------------------------------------------------------------- BERT (HF BertModel layout)


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    ffn: int = 3072
    max_positions: int = 512
    type_vocab: int = 2
    num_labels: int = 2
    dropout: float = 0.1


class BertLayer(nn.Module):
    """Post-LayerNorm encoder layer: self-attention (q, k, v, output) then the 2-layer FFN."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.heads, self.dropout = c.heads, c.dropout
        self.query, self.key, self.value = (nn.Linear(c.hidden, c.hidden) for _ in range(3))
        self.attn_out = nn.Linear(c.hidden, c.hidden)
        self.attn_norm = nn.LayerNorm(c.hidden, eps=1e-12)
        self.intermediate = nn.Linear(c.hidden, c.ffn)
        self.output = nn.Linear(c.ffn, c.hidden)
        self.out_norm = nn.LayerNorm(c.hidden, eps=1e-12)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape

        def split(t: Tensor) -> Tensor:
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)),
                                           split(self.value(x)), dropout_p=p)
        a = self.attn_out(a.transpose(1, 2).reshape(b, s, h))
        x = self.attn_norm(x + F.dropout(a, p, self.training))
        f = self.output(F.gelu(self.intermediate(x)))
        return self.out_norm(x + F.dropout(f, p, self.training))


class Bert(nn.Module):
    """BertModel (embeddings, encoder, pooler) + a sequence-classification head on the pool."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.config = c
        self.word = nn.Embedding(c.vocab_size, c.hidden)
        self.position = nn.Embedding(c.max_positions, c.hidden)
        self.token_type = nn.Embedding(c.type_vocab, c.hidden)
        self.emb_norm = nn.LayerNorm(c.hidden, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer(c) for _ in range(c.layers))
        self.pooler = nn.Linear(c.hidden, c.hidden)
        self.classifier = nn.Linear(c.hidden, c.num_labels)
        for m in self.modules():  # BERT's init: N(0, 0.02), zero biases
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0, 0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word(input_ids) + self.position(positions) + self.token_type.weight[0]
        x = F.dropout(self.emb_norm(x), self.config.dropout, self.training)
        for layer in self.layers:
            x = layer(x)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return self.classifier(F.dropout(pooled, self.config.dropout, self.training))


def bert_base(vocab_size: int = 30522, num_labels: int = 2, dropout: float = 0.1) -> Bert:
    return Bert(BertConfig(vocab_size=vocab_size, num_labels=num_labels, dropout=dropout))


def encoder_params(model: Bert) -> int:
    """Parameters of the BertModel part (everything but the classification head)."""
    return sum(p.numel() for n, p in model.named_parameters() if not n.startswith("classifier"))


# ---------------------------------------------------------------- registry


@dataclass(frozen=True)
class Workload:
    """A model factory with its synthetic data; the batch size is fixed when built."""

    name: str
    make_model: Callable[[], nn.Module]
    sample: Callable[[int, torch.Generator], tuple[Tensor, Tensor]]
    blocks: Callable[[nn.Module], list[nn.Module]]
    batch_size: int
    loss: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy

    def make_batch(self, generator: torch.Generator, batch_size: Optional[int] = None
                   ) -> tuple[Tensor, Tensor]:
        """Synthetic (inputs, targets), reproducible from the generator's seed."""
        return self.sample(batch_size or self.batch_size, generator)


def _images(size: int, classes: int) -> Callable[[int, torch.Generator], tuple[Tensor, Tensor]]:
    def sample(n: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
        return torch.randn(n, 3, size, size, generator=g), torch.randint(classes, (n,), generator=g)
    return sample


def _tokens(seq_len: int, vocab: int, labels: int
            ) -> Callable[[int, torch.Generator], tuple[Tensor, Tensor]]:
    def sample(n: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
        return (torch.randint(vocab, (n, seq_len), generator=g),
                torch.randint(labels, (n,), generator=g))
    return sample


def _resnet_blocks(m: nn.Module) -> list[nn.Module]:
    return [b for stage in (m.layer1, m.layer2, m.layer3, m.layer4) for b in stage]


def _vgg_blocks(m: nn.Module) -> list[nn.Module]:
    return [x for x in m.modules() if isinstance(x, (nn.Conv2d, nn.Linear))]


def _bert_blocks(m: nn.Module) -> list[nn.Module]:
    return list(m.layers)


def _resnet(name: str, k: dict[str, Any], layers: list[int], width: int) -> Workload:
    classes = k["num_classes"]
    return Workload(name, lambda: ResNet(layers, classes, width),
                    _images(k["image_size"], classes), _resnet_blocks, k["batch_size"])


def _vgg(name: str, k: dict[str, Any], cfg: list[Any], hidden: int, pool: int) -> Workload:
    classes, dropout = k["num_classes"], k["dropout"]
    return Workload(name, lambda: VGG(cfg, classes, hidden, pool, dropout),
                    _images(k["image_size"], classes), _vgg_blocks, k["batch_size"])


def _bert(name: str, k: dict[str, Any], config: BertConfig) -> Workload:
    c = BertConfig(**{**config.__dict__, "vocab_size": k["vocab_size"],
                      "num_labels": k["num_labels"], "dropout": k["dropout"]})
    if k["seq_len"] > c.max_positions:
        raise ValueError(f"{name}: seq_len {k['seq_len']} > {c.max_positions} positions")
    return Workload(name, lambda: Bert(c), _tokens(k["seq_len"], c.vocab_size, c.num_labels),
                    _bert_blocks, k["batch_size"])


def _image_knobs(classes: int, image: int, batch: int) -> dict[str, Any]:
    return {"num_classes": classes, "image_size": image, "batch_size": batch}


def _bert_knobs(vocab: int, seq_len: int, batch: int) -> dict[str, Any]:
    return {"vocab_size": vocab, "num_labels": 2, "seq_len": seq_len, "batch_size": batch,
            "dropout": 0.0}


_TINY_VGG = [8, "M", 16, "M", 32, 32, "M"]
_TINY_BERT = BertConfig(vocab_size=100, hidden=32, layers=2, heads=2, ffn=64, max_positions=64)
# The real models' module structure (every layer, hook and bucket boundary) at shapes where host
# work sets the pace: benchmarks.host_cost.
_HOST_BERT = BertConfig(vocab_size=1000, hidden=64, layers=12, heads=2, ffn=256, max_positions=64)

# name -> (builder(name, knobs), default knobs); build() accepts exactly these knobs.
REGISTRY: dict[str, tuple[Callable[[str, dict[str, Any]], Workload], dict[str, Any]]] = {
    "resnet50": (partial(_resnet, layers=[3, 4, 6, 3], width=64), _image_knobs(1000, 224, 32)),
    "vgg16": (partial(_vgg, cfg=VGG16_CFG, hidden=4096, pool=7),
              {**_image_knobs(1000, 224, 32), "dropout": 0.0}),
    "bert_base": (partial(_bert, config=BertConfig()), _bert_knobs(30522, 128, 32)),
    "resnet_tiny": (partial(_resnet, layers=[1, 1, 1, 1], width=8), _image_knobs(10, 32, 4)),
    "vgg_tiny": (partial(_vgg, cfg=_TINY_VGG, hidden=64, pool=1),
                 {**_image_knobs(10, 32, 4), "dropout": 0.0}),
    "bert_tiny": (partial(_bert, config=_TINY_BERT), _bert_knobs(100, 16, 4)),
    "resnet50_host": (partial(_resnet, layers=[3, 4, 6, 3], width=8), _image_knobs(10, 32, 4)),
    "bert_base_host": (partial(_bert, config=_HOST_BERT), _bert_knobs(1000, 16, 4)),
}


def build(name: str, **knobs: Any) -> Workload:
    """The workload `name` with its default knobs (REGISTRY) overridden by `knobs`; a knob
    given as None or 0 keeps its default (so unset command-line options can be passed on)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(REGISTRY)}")
    builder, defaults = REGISTRY[name]
    unknown = sorted(set(knobs) - set(defaults))
    if unknown:
        raise TypeError(f"{name}: unknown knobs {unknown}; it takes {sorted(defaults)}")
    return builder(name, {**defaults, **{k: v for k, v in knobs.items() if v}})


def time_iteration(w: Workload, iters: int = 3) -> float:
    """Median seconds of one SGD iteration (forward, backward, step) on this process's threads."""
    torch.manual_seed(0)
    model = w.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = w.make_batch(torch.Generator().manual_seed(0))
    times = []
    for _ in range(iters + 1):
        start = time.perf_counter()
        opt.zero_grad()
        w.loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def main(argv: Optional[list[str]] = None) -> None:
    """Print parameter counts, or with --time one-thread iteration times, to size a CPU run."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("models", nargs="*", default=["resnet50", "vgg16", "bert_base"])
    p.add_argument("--time", action="store_true")
    p.add_argument("--batch", type=int, default=0)
    p.add_argument("--image-size", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.models:
        knobs = {"seq_len": args.seq_len} if "bert" in name else {"image_size": args.image_size}
        w = build(name, batch_size=args.batch, **knobs)
        torch.manual_seed(0)
        n = sum(p.numel() for p in w.make_model().parameters())
        line = f"{name}: {n:,} parameters ({n * 4 / 2**20:.1f} MB fp32)"
        if args.time:
            line += f"; batch {w.batch_size}, {knobs}: {time_iteration(w):.3f} s/iteration"
        print(line)


if __name__ == "__main__":
    main()
