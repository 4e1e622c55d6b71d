"""``lightning-twod consolidate CKPT OUT``: a checkpoint's full, unsharded state dict, written with ``torch.save``.

The arguments are parsed before torch and the checkpoint package are imported, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse


def consolidate_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_twod consolidate",
        description="Export a checkpoint (distributed directory or single file) as a plain state dict whose keys "
                    "match the unsharded LightningModule; load it with torch.load(OUT, weights_only=True).")
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    args = parser.parse_args(argv)

    import torch

    from lightning_twod.checkpoint import consolidate

    state = consolidate(args.checkpoint)
    torch.save(state, args.out)
    total = sum(t.numel() for t in state.values())
    print(f"wrote {len(state)} tensors ({total:,} values) to {args.out}")
