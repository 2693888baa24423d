"""The lab: rollpacker's experimental wing, apart from the product.

Benchmarks (``lab.bench``: replay, learning, reward, planner, speculation, what-if, GPU...), the
profiler driver (``lab.profiling``), and the soak and chaos drivers. They measure the product; the
product never imports them (tests/test_layers.py enforces it). Their commands are the ``rollpacker
lab`` group (``lab.cli``); the older spellings (``rollpacker bench ...``, ``rollpacker whatif``,
``profile``, ``soak``, ``chaos``) still run the same commands.
"""
