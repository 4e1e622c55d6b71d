"""``lightning-twod COMMAND ...`` (or ``python -m lightning_twod COMMAND ...``): dispatches to the command's module.

Nothing heavy is imported before a command is chosen: ``--version`` and ``--help`` answer without torch.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {
        "fit": "train with LightningCLI: --config examples/configs/synthetic_2x2.yaml",
        "validate": "validate with LightningCLI",
        "test": "test with LightningCLI",
        "predict": "predict with LightningCLI",
        "demo": "a short 2D sharded training run on CPU processes (synthetic data)",
        "consolidate": "CKPT OUT [--lightning]: write a checkpoint's full, unsharded state dict (or, with "
                       "--lightning, a single-file Lightning checkpoint) to OUT",
        "plan": "--config CONFIG [overrides]: the plan fit will log, and per-rank memory of 1D next to it",
        "simulate": "predicted step time and scaling of 1D and 2D from 8 to 4,096 GPUs (table; --plot PNG)",
        "calibrate": "measure this cluster's links and compute (run it under torchrun on every node); --out YAML",
        "prepare-criteo": "TSV... --out DIR --table-rows N: Criteo day files as Parquet row groups that each "
                          "rank reads its share of",
    }
    if argv and argv[0] in ("--version", "-V"):
        from lightning_twod import __version__

        print(f"lightning-twod {__version__}")
        sys.exit(0)
    if not argv or argv[0] not in commands:
        print("usage: lightning-twod COMMAND [options]   (or: python -m lightning_twod COMMAND [options])\n\n"
              "commands:")
        for name, what in commands.items():
            print(f"  {name:<10} {what}")
        print(f"  {'--version':<10} print the version")
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    if argv[0] == "plan":
        from lightning_twod.cli.plan import plan_main

        sys.exit(_reporting_errors("plan", lambda: plan_main(argv[1:])))
    elif argv[0] == "simulate":
        from lightning_twod.cli.simulate import simulate_main

        sys.exit(simulate_main(argv[1:]))
    elif argv[0] == "calibrate":
        from lightning_twod.cli.calibrate import calibrate_main

        sys.exit(calibrate_main(argv[1:]))
    elif argv[0] == "prepare-criteo":
        from lightning_twod.cli.prepare_criteo import prepare_criteo_main

        sys.exit(_reporting_errors("prepare-criteo", lambda: prepare_criteo_main(argv[1:])))
    elif argv[0] == "consolidate":
        from lightning_twod.cli.consolidate import consolidate_main

        consolidate_main(argv[1:])
    elif argv[0] == "demo":
        from lightning_twod.cli.demo import main as demo

        demo(argv[1:])
    else:
        _reporting_errors(argv[0], lambda: _lightning_cli(argv))


def _lightning_cli(argv: list[str]):
    """``cli.fit.main``; a checkpoint directory met by a strategy that reads single files (a config
    without the 2D strategy) is one error that names the fixes, instead of Lightning's ``IsADirectoryError``."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_twod.checkpoint import is_distributed_checkpoint, strategy_needed
    from lightning_twod.cli.fit import main as cli

    try:
        return cli(argv)
    except IsADirectoryError as err:
        if err.filename is None or not is_distributed_checkpoint(err.filename):
            raise
        raise MisconfigurationException(strategy_needed(err.filename)) from None


def _reporting_errors(command: str, run):
    """``cli.errors.run_reporting_errors``, imported only by the commands that use it (it imports torch)."""
    from lightning_twod.cli.errors import run_reporting_errors

    return run_reporting_errors(command, run)
