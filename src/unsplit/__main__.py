"""``python -m unsplit`` runs the command-line interface."""

from unsplit.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
