"""``python -m lightning_twod COMMAND ...``: the command-line entry points."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {
        "fit": "train with LightningCLI: --config examples/configs/synthetic_2x2.yaml",
        "validate": "validate with LightningCLI",
        "test": "test with LightningCLI",
        "predict": "predict with LightningCLI",
        "demo": "a short 2D sharded training run on CPU processes (synthetic data)",
    }
    if not argv or argv[0] not in commands:
        print("usage: python -m lightning_twod COMMAND [options]\n\ncommands:")
        for name, what in commands.items():
            print(f"  {name:<10} {what}")
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    if argv[0] == "demo":
        from lightning_twod.demo import main as demo

        demo(argv[1:])
    else:
        from lightning_twod.cli import main as cli

        cli(argv)


if __name__ == "__main__":
    main()
