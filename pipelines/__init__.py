"""KFP pipelines: ``rl_step`` (one RL step) and ``rl_experiment`` (N steps chained).

Like ``components``, a plain package at the repository root: ``rollpacker compile`` (through
``rollpacker.pipeline_compile.load_pipeline_modules``) puts the root on ``sys.path`` and imports it.
Compiled YAML goes to ``build/``.
"""
