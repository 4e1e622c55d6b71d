"""``python -m lightning_twod COMMAND ...``: the same as the console script ``lightning-twod``."""

from lightning_twod.cli.main import main

if __name__ == "__main__":
    main()
