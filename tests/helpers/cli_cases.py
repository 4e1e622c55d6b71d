"""A tiny LightningCLI config (synthetic data, 2 CPU ranks) shared by the CLI tests of both tiers."""

from pathlib import Path

CONFIG = (
    "seed_everything: 0\ntrainer:\n  accelerator: cpu\n  devices: 2\n  max_steps: 2\n  limit_val_batches: 1\n"
    "  enable_progress_bar: false\n  logger: false\n  enable_checkpointing: false\n"
    "  strategy:\n    class_path: lightning_twod.TwoDSparseStrategy\n"
    "    init_args: {links: h100, sync_interval: 2, sharding: {t_cat_0: row_wise}}\n"
    "model:\n  class_path: lightning_twod.models.dlrm.DLRM\n"
    "  init_args: {embedding_dim: 8, bottom_mlp: [8], top_mlp: [8]}\n"
    "data:\n  class_path: lightning_twod.datasets.synthetic.SyntheticDataModule\n"
    "  init_args: {table_rows: [3000, 60, 900], num_dense: 5, num_train: 256, num_val: 64, batch_size: 48}\n"
)


def write_config(directory: Path) -> Path:
    """``CONFIG`` written to ``directory/tiny.yaml``."""
    path = directory / "tiny.yaml"
    path.write_text(CONFIG)
    return path
