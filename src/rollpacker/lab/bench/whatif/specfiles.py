"""Hardware and model spec files, and the cost model a ``--hardware`` / ``--model`` pair names.

Shipped specs live in ``rollpacker/lab/bench/whatif/specs/hardware/*.yaml`` and
``rollpacker/lab/bench/whatif/specs/models/*.yaml`` (package data, every number cited in its file's
``sources``). ``--hardware`` takes a shipped name
(``h800``), a YAML file, or ``cpu-profile:<profile.json>`` (a measured profile from
``rollpacker lab profile``: its layouts are the TP choices); ``--model`` a shipped name or a YAML file.
A bad file is refused by name with the field at fault (``core.costmodel.SpecError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rollpacker.core.costmodel import HardwareSpec, ModelSpec, ProfileCost, RooflineCost, SpecError, StepCost
from rollpacker.core.latency import Predictor, ProfileTable

SPECS_DIR = Path(__file__).resolve().parent / "specs"
HARDWARE_DIR = SPECS_DIR / "hardware"
MODELS_DIR = SPECS_DIR / "models"
PROFILE_PREFIX = "cpu-profile:"


def shipped(kind_dir: Path) -> dict[str, Path]:
    """The shipped specs of one kind, by name."""
    return {p.stem: p for p in sorted(kind_dir.glob("*.yaml"))}


def _read_yaml(value: str, kind_dir: Path, kind: str) -> tuple[object, str]:
    """A spec's parsed YAML and where it came from: a file path, or a shipped name."""
    import yaml

    p = Path(value).expanduser()
    known = shipped(kind_dir)
    if not p.is_file():
        if value.lower() not in known:
            raise SpecError(
                f"unknown {kind} {value!r}: not a file and not a shipped {kind} "
                f"(shipped: {', '.join(known)}); write a YAML spec like the files in {kind_dir}"
            )
        p = known[value.lower()]
    try:
        return yaml.safe_load(p.read_text()), str(p)
    except yaml.YAMLError as e:
        raise SpecError(f"{p}: not valid YAML: {e}") from e


def load_hardware(value: str) -> HardwareSpec:
    data, where = _read_yaml(value, HARDWARE_DIR, "hardware")
    return HardwareSpec.from_mapping(data, where)


def load_model(value: str) -> ModelSpec:
    data, where = _read_yaml(value, MODELS_DIR, "model")
    return ModelSpec.from_mapping(data, where)


def load_profile(path: str | Path) -> ProfileTable:
    """A profile table: the ``table`` of a ``rollpacker lab profile`` document, or a bare table."""
    import json

    p = Path(path).expanduser()
    if not p.is_file():
        raise SpecError(
            f"{PROFILE_PREFIX}{path}: no such profile file; run `rollpacker lab profile --out {path}`"
        )
    try:
        doc = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise SpecError(f"{p}: not JSON ({e}); re-run `rollpacker lab profile`") from e
    return ProfileTable.from_dict(doc.get("table", doc) if isinstance(doc, dict) else doc, str(p))


@dataclass(frozen=True)
class Deployment:
    """One way to serve the rollout: ``dp`` replicas of the engine ``cost`` prices (TP inside)."""

    cost: StepCost
    dp: int

    @property
    def name(self) -> str:
        return f"tp{self.cost.tp}dp{self.dp}"


def deployments(hardware: str, model: str | None, tps: tuple[int, ...], gpus: int | None) -> list[Deployment]:
    """Every deployment the what-if compares: a profile's layouts (``cpu-profile:``), or the roofline
    of ``model`` on ``gpus`` devices (default: one node) at each TP in ``tps`` (default: every
    power of two that fits the model and splits its heads), ``gpus // tp`` replicas each."""
    if hardware.startswith(PROFILE_PREFIX):
        table = load_profile(hardware.removeprefix(PROFILE_PREFIX))
        pred = Predictor(table)
        out = [
            Deployment(ProfileCost(pred, lay), lay.dp) for lay in table.candidates if not tps or lay.tp in tps
        ]
        if not out:
            have = ", ".join(lay.name for lay in table.candidates)
            raise SpecError(f"{hardware}: no profiled layout has TP in {list(tps)} (it has {have})")
        return out
    if model is None:
        raise SpecError(f"--hardware {hardware} is a roofline: name the model too (--model qwen2.5-7b)")
    hw, spec = load_hardware(hardware), load_model(model)
    n = gpus or hw.devices_per_node
    wanted = tps or tuple(1 << i for i in range(8) if (1 << i) <= min(n, hw.devices_per_node))
    out, why = [], []
    for tp in wanted:
        if n % tp:
            why.append(f"tp {tp} does not divide {n} devices")
            continue
        try:
            out.append(Deployment(RooflineCost(hw, spec, tp), n // tp))
        except SpecError:
            raise
        except ValueError as e:  # ConfigError: does not fit, heads do not split, TP beyond a node
            why.append(str(e))
    if not out:
        raise SpecError(f"{spec.name} on {n} x {hw.name}: no usable TP in {list(wanted)}: {'; '.join(why)}")
    return out
