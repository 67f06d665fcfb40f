"""fused_zero with PyTorch Lightning, on 2 CPU processes: python examples/train_lightning.py"""
import lightning.pytorch as pl
import torch
import torch.nn.functional as F

import fused_zero
from fused_zero.lightning import FusedZeroStrategy


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 257), torch.nn.GELU(), torch.nn.Linear(257, 10))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):  # no ddp=: the strategy attaches the optimizer to its DDP module
        return fused_zero.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


x = torch.randn(1024, 32, generator=torch.Generator().manual_seed(0))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :10].argmax(dim=1)), batch_size=64)
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=FusedZeroStrategy(), max_epochs=2,
                     gradient_clip_val=1.0, logger=False, enable_checkpointing=False)   # "gpu": NCCL
trainer.fit(Net(), loader)
