"""Tiny ImageFolder data set: data/{train,val}/class{0..4}/*.png, 64x64 RGB, fixed seed.
5 classes (torchvision's train.py always computes top-5 accuracy); class c is brighter by 16*c,
so there is something to learn. 16 train + 4 val images per class."""
import os
import sys

import numpy as np
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "data")
rng = np.random.default_rng(1234)
for split, n in (("train", 16), ("val", 4)):
    for c in range(5):
        d = os.path.join(root, split, f"class{c}")
        os.makedirs(d, exist_ok=True)
        for i in range(n):
            img = rng.integers(0, 176, size=(64, 64, 3), dtype=np.uint8) + 16 * c
            Image.fromarray(img.astype(np.uint8)).save(os.path.join(d, f"{i:03d}.png"))
print("data in", root)
