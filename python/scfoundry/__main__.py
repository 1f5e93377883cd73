"""`python -m scfoundry ...` and the `scfoundry` command of the wheel: run the packaged binary."""
import os
import sys

from scfoundry import binary


def main() -> None:
    exe = binary()
    os.execv(exe, [exe, *sys.argv[1:]])


if __name__ == "__main__":
    main()
