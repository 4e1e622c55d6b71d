"""``lightning-twod consolidate CKPT OUT``: a checkpoint's full, unsharded state dict, written with ``torch.save``;
with ``--lightning``, a single-file Lightning checkpoint of the unsharded model (``checkpoint.lightning_checkpoint``).

The arguments are parsed before torch and the checkpoint package are imported, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse


def consolidate_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_twod consolidate",
        description="Export a checkpoint (distributed directory or single file) as a plain state dict whose keys "
                    "match the unsharded LightningModule; load it with torch.load(OUT, weights_only=True). With "
                    "--lightning, as a single-file Lightning checkpoint.")
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--lightning", action="store_true",
                        help="write a single-file Lightning checkpoint instead (the full model, hyper-parameters, "
                             "loops and callbacks; no optimizer state): a ckpt_path for any Trainer, and for "
                             "Model.load_from_checkpoint")
    args = parser.parse_args(argv)

    import torch

    from lightning_twod.checkpoint import consolidate, lightning_checkpoint

    if args.lightning:
        written = lightning_checkpoint(args.checkpoint)
        state = written["state_dict"]
    else:
        written = state = consolidate(args.checkpoint)
    torch.save(written, args.out)
    total = sum(t.numel() for t in state.values())
    print(f"wrote {len(state)} tensors ({total:,} values) to {args.out}")
