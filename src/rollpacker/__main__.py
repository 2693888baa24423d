"""``python -m rollpacker``: the ``rollpacker`` command."""

from rollpacker.cli import main

if __name__ == "__main__":
    main()
