"""``python -m lightning_twod demo ...``: the command-line entry points."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"demo": "a short 2D sharded training run on CPU processes (synthetic data)"}
    if not argv or argv[0] not in commands:
        print("usage: python -m lightning_twod COMMAND [options]\n\ncommands:")
        for name, what in commands.items():
            print(f"  {name:<10} {what}")
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    if argv[0] == "demo":
        from lightning_twod.demo import main as demo

        demo(argv[1:])


if __name__ == "__main__":
    main()
