"""A stand-in for torchvision with what Horovod's pytorch_mnist_elastic.py takes from it
(datasets.MNIST, transforms) and what its pytorch_synthetic_benchmark_elastic.py takes (models.
resnet50, vgg16), for running those examples unchanged but for their import where
torchvision is not installed and nothing can be downloaded: MNIST becomes a synthetic set of
the same shapes (1x28x28 images, 10 classes), seeded, so every rank has the same data."""

from . import datasets, models, transforms

__all__ = ["datasets", "models", "transforms"]
