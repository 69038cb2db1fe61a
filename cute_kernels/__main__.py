"""``python -m cute_kernels <command>``: the same CLI as the ``cute-kernels`` console script."""

from cute_kernels.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
