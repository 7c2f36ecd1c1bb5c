"""``python -m speculant``: the same command as the ``speculant`` console script."""

from speculant.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
