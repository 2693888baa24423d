"""The megatron-core training backend (docs/megatron.md): the CPU shim, the Qwen2 converter, one
rank (``worker``) and the gang behind the trainer port (``gang.MegatronTrainer``)."""
