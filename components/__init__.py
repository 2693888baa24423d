"""Thin KFP components, one folder per stage: ``components/<stage>/component.py``.

Each component is a ``@dsl.component`` whose body imports ``rollpacker.stages.edge`` and calls one stage
function; every import sits inside the function body, because KFP serializes only the function's
source into the task's container (and ``kfp.local`` runs that source in a fresh interpreter).
The images carry rollpacker (and kfp), so ``packages_to_install=[]`` and ``install_kfp_package=False``.

``components`` and ``pipelines`` are plain packages at the repository root, not installed into the
venv: ``rollpacker.pipeline_compile.load_pipeline_modules()`` puts the repository root on ``sys.path``
and imports them (``rollpacker compile`` and ``rollpacker.pipeline_local`` go through it).
Images come from one place, ``components/images.py``, read when the component modules are imported.
"""
