"""A stand-in for torchvision with what Horovod's pytorch_mnist_elastic.py takes from it
(datasets.MNIST, transforms), for running that example unchanged but for its import where
torchvision is not installed and nothing can be downloaded: MNIST becomes a synthetic set of
the same shapes (1x28x28 images, 10 classes), seeded, so every rank has the same data."""

from . import datasets, transforms

__all__ = ["datasets", "transforms"]
