"""Device settings of the torch trainer and the judge, and what a GPU config may not do.

A device setting (``train.device``, ``reward.judge.device``) is ``auto``, ``cpu``, ``cuda`` or
``cuda:N``. ``resolve_device(setting, gpus, ...)`` turns it into the torch device a process uses,
given how many GPUs that process sees (the caller asks torch, so this module stays pure):
``auto`` is ``cuda`` when a GPU is visible, else ``cpu``; ``cpu`` is obeyed as written.

A config *declares GPUs* when one of its settings puts work on a GPU
(``ExperimentConfig.gpu_declarations``): ``train.megatron.gpus_per_rank`` > 0 under
``train.backend: megatron``, a ``cuda`` device in ``train.device`` or ``reward.judge.device``.
On such a config (the gpu overlay's ``configs/cluster.yaml``):

- the toy judge (``reward.judge.model`` unset: the tiny ``reward.judge.preset`` warmed up on the
  judge's pod on the synthetic math task) is refused when the task may hold judge prompts
  (``check_judge``, which also keeps a judge model URI in the experiment's store); the error
  names the preset and says to set ``reward.judge.model`` and ``reward.judge.device``;
- a device ``auto`` that finds no GPU is refused (the pod sees none: a CPU pool, no device plugin,
  a CPU image); an explicit ``cpu`` is obeyed.

Invariants:
- ``resolve_device`` never returns ``auto``; it returns ``cpu`` or ``cuda[:N]`` with ``N < gpus``,
  and ``cuda`` only when ``gpus >= 1``; it raises ``ConfigError`` naming the setting otherwise;
- ``auto`` resolves to ``cpu`` only on a config that declares no GPU;
- ``gpu_declarations`` is empty exactly when no setting above names a GPU;
- ``check_device_setting`` accepts exactly ``auto``, ``cpu``, ``cuda`` and ``cuda:<N>`` (N >= 0).
"""

from __future__ import annotations

import re

from rollpacker.core.errors import ConfigError

_DEVICE = re.compile(r"auto|cpu|cuda(?::(0|[1-9][0-9]*))?")
# built-in tasks that hold no judge prompts; any other task (``mixed``, a JSON Lines file) may
TASKS_WITHOUT_JUDGE_PROMPTS = ("synthetic_math", "synthetic_code", "humaneval")
TRAIN_DTYPES = ("float32", "bfloat16")
JUDGE_DTYPES = ("float32", "bfloat16", "float16")
S3_SCHEME = "s3://"
FILE_SCHEME = "file://"


def check_device_setting(name: str, value: object) -> None:
    """``ConfigError`` unless ``value`` is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    if not isinstance(value, str) or not _DEVICE.fullmatch(value):
        raise ConfigError(
            f"{name} = {value!r}: use auto (cuda when a GPU is visible, else cpu), cpu, cuda or cuda:N"
        )


def is_cuda(setting: str) -> bool:
    return setting.startswith("cuda")


def resolve_device(setting: str, gpus: int, *, name: str, declared: tuple[str, ...] = ()) -> str:
    """The torch device for ``setting`` in a process that sees ``gpus`` GPUs; ``declared`` are the
    config's GPU declarations (``gpu_declarations``), which forbid ``auto`` falling back to ``cpu``."""
    check_device_setting(name, setting)
    if setting == "cpu":
        return "cpu"
    if setting == "auto":
        if gpus > 0:
            return "cuda"
        if declared:
            raise ConfigError(
                f"{name}: auto found no GPU in this process, but the config declares GPUs "
                f"({'; '.join(declared)}): run it where a GPU is visible (the pod's nvidia.com/gpu "
                f"limit, the CUDA image), or set {name}: cpu to run on the CPU on purpose"
            )
        return "cpu"
    index = int(setting.partition(":")[2] or 0)
    if index >= gpus:
        seen = "no GPU" if gpus == 0 else f"{gpus} GPU(s) (cuda:0..cuda:{gpus - 1})"
        raise ConfigError(
            f"{name} = {setting}: this process sees {seen}; run it where that GPU is visible, or set "
            f"{name}: auto (or cpu)"
        )
    return setting


def gpu_declarations(
    *, backend: str, megatron_gpus_per_rank: float, train_device: str, judge_device: str
) -> tuple[str, ...]:
    """The settings that put work on a GPU, as ``key: value`` (empty: a CPU config);
    ``ExperimentConfig.gpu_declarations`` passes its own."""
    out = []
    if backend == "megatron" and megatron_gpus_per_rank > 0:
        out.append(f"train.megatron.gpus_per_rank: {megatron_gpus_per_rank:g}")
    if backend == "torch" and is_cuda(train_device):
        out.append(f"train.device: {train_device}")
    if is_cuda(judge_device):
        out.append(f"reward.judge.device: {judge_device}")
    return tuple(out)


def check_judge(
    *, model: str, preset: str, task: str, declared: tuple[str, ...], bucket: str, file_store: str | None
) -> None:
    """The judge's cross-section rules (``ExperimentConfig`` checks them on construction): no toy
    judge (``model`` unset) on a config that declares GPUs when its ``task`` may hold judge
    prompts, and a judge model in the store is in the experiment's store (``bucket``, or the file
    store's root ``file_store``)."""
    if not model and declared and task not in TASKS_WITHOUT_JUDGE_PROMPTS:
        raise ConfigError(
            f"reward.judge: the toy judge (reward.judge.model unset: the {preset!r} tiny model warmed up "
            f"on the judge's pod on synthetic math answers) cannot judge the task {task!r} on a config "
            f"that declares GPUs ({'; '.join(declared)}); set reward.judge.model to a judge model (a "
            "Hugging Face directory on the judge's pod, or an s3:// URI in the experiment's bucket) and "
            "reward.judge.device: cuda (docs/judge.md)"
        )
    if model.startswith(S3_SCHEME) and (file_store is not None or _bucket(model) != bucket):
        where = (
            f"the file store {FILE_SCHEME}{file_store}" if file_store is not None else f"bucket {bucket!r}"
        )
        raise ConfigError(
            f"reward.judge.model = {model!r}: the judge is downloaded through the experiment's store, "
            f"{where} (store.endpoint, store.bucket); upload it there, or give a directory on the "
            "judge's pod"
        )
    if model.startswith(FILE_SCHEME) and file_store is None:
        raise ConfigError(
            f"reward.judge.model = {model!r}: a file:// URI needs a file store (store.endpoint: file://...); "
            f"with S3 give s3://{bucket}/<prefix>/ or a directory on the judge's pod"
        )


def _bucket(uri: str) -> str:
    return uri[len(S3_SCHEME) :].partition("/")[0]
