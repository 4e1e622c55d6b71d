"""Reference models: ordinary unsharded LightningModules (no parallelism in the model code)."""

from lightning_twod.models.dlrm import DLRM

__all__ = ["DLRM"]
