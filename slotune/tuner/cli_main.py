"""`python -m slotune.tuner.cli_main` = the `tune` command (for subprocesses and `-m` use)."""

from slotune.tuner.cli import app

if __name__ == "__main__":  # pragma: no cover
    app()
