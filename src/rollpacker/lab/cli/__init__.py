"""``rollpacker lab``: the lab's commands (benchmarks, what-if, profiling, soak, chaos).

``lab_app`` is mounted by the product's command root by name only (``rollpacker.cli.LAB``): no
product module imports the lab. Each module here registers its commands on ``lab_app`` or
``bench_app`` through the product's one command wrapper (``rollpacker.cli.common.command``).
"""

from __future__ import annotations

from . import bench, reliability, rollout, whatif
from .groups import bench_app, lab_app

__all__ = ["bench", "bench_app", "lab_app", "reliability", "rollout", "whatif"]
