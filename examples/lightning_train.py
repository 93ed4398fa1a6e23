"""PyTorch Lightning with dear: `Trainer(strategy="dear")`. Run with

    python examples/lightning_train.py                  # 2 CPU processes, strategy="dear"
    python examples/lightning_train.py --strategy ddp   # the same with DDP, for comparison
    python examples/lightning_train.py --resume --epochs 5   # continue to epoch 5
    python examples/lightning_train.py --epochs 5            # the same 5 epochs in one go

Lightning starts the second process itself (as for strategy="ddp"); under torchrun, srun or
mpirun it uses the processes the launcher started. The script prints a checksum of the final
parameters: "dear" and "ddp" print the same one, and so do a run resumed from a checkpoint
and an uninterrupted one.
"""

import argparse
import os

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import dear.lightning  # noqa: F401  (registers strategy="dear")


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        acc = (self(x).argmax(1) == y).float().mean()
        self.log("val_acc", acc, sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return {"optimizer": opt,
                "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)}


def data(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="dear")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    L.seed_everything(0, verbose=False)
    ckpt_dir = f"/tmp/dear-lightning-{args.strategy}"
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=args.strategy, max_epochs=args.epochs,
        precision="bf16-mixed", gradient_clip_val=1.0, accumulate_grad_batches=2,
        val_check_interval=0.5, logger=False, enable_progress_bar=False,
        callbacks=[L.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True)])
    model = Classifier()
    last = os.path.join(ckpt_dir, "last.ckpt")
    trainer.fit(model, data(1024, 1), data(256, 2),
                ckpt_path=last if args.resume and os.path.exists(last) else None)
    if trainer.is_global_zero:
        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
        acc = trainer.callback_metrics.get("val_acc")
        print(f"strategy={args.strategy}: {trainer.global_step} steps, "
              + (f"val_acc {float(acc):.3f}, " if acc is not None else "")
              + f"parameter checksum {checksum:.6f}")
    # Leave no Gloo process group to the interpreter's exit: torch's Gloo threads destroyed
    # there aborted the process now and then ("terminate called without an active exception",
    # 3 of 50 runs of plain strategy="ddp" under mpirun on a busy machine).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
