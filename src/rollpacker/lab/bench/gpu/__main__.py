"""``python -m rollpacker.lab.bench.gpu``: the GPU bench without the ``rollpacker`` CLI (Python 3.12)."""

from rollpacker.lab.bench.gpu.runner import main

if __name__ == "__main__":
    raise SystemExit(main())
