"""``rollpacker lab bench gpu``: one prepared command: on one GPU, what rollpacker claims for GPUs.

Phases, in order of value, each under its own deadline (``runner.PHASES``): ``probe`` (versions,
attention kernels, measured copy and GEMM ceilings), ``profile`` (decode step time of a
Qwen2.5-7B-shaped model with random bf16 weights over batch x context, written in the table format
of ``rollpacker lab profile``), ``policies`` (the replay of every rollout policy priced by that profile
beside the roofline's price), ``predictor`` (the latency predictor's error on held-out profile
points), ``trainer`` (the stream trainer's update vs the monolithic one on the device, bf16),
``megatron`` (one megatron-core rank vs the torch backend) and ``judge`` (the layer-wise offload
vs the resident model). ``--tiny`` runs the same phases on a tiny model on the CPU.

This package runs on the bare GPU machine (Python 3.12, torch, transformers, safetensors, numpy,
pytest; no vLLM, Ray, kfp, MLflow, boto3, typer): every module it imports keeps those imports
inside the functions that need them (tests/lab/bench/test_gpu_bench.py runs it with them blocked).

Invariants (tests/lab/bench/test_gpu_bench.py):
- the JSON has one section per phase with ``status`` ``ok``, ``skipped`` (with ``why``) or
  ``failed`` (with ``error``), and it is rewritten after every phase;
- a phase that fails or runs past its deadline does not stop the phases after it;
- the profile section's table is read by ``ProfileTable.from_dict`` (the predictor and ``whatif``).
"""
