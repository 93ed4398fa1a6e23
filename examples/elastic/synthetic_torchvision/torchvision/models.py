"""torchvision.models' ResNet-50 and VGG-16 for Horovod's pytorch_synthetic_benchmark_elastic.py
(`getattr(models, args.model)()`): the same layouts, from dear's benchmarks (benchmarks/models.py,
on the PYTHONPATH that examples/elastic/run_horovod_example.py sets)."""

from benchmarks.models import resnet50, vgg16

__all__ = ["resnet50", "vgg16"]
