"""The shipped models (tasks/shipped.py, built by tasks/ship.py: ``rollpacker model ship``): they
are what their manifest says (files, key, recipe, shapes, tokenizer, validation figure), the key is
the one the current code computes for the embedded default experiment, a matching key installs the
shipped model into the cache instead of training, a tampered file is refused, and any other recipe
still trains."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest

from rollpacker.core.config import load_config, resolve_config
from rollpacker.tasks import shipped
from rollpacker.tasks.ship import SHIPPED_CONFIGS, greedy_exact_match, measure, recipes, val_examples
from rollpacker.tasks.tiny_model import PRESETS, tokenizer_id

# A re-measured validation figure may sit this many examples below the manifest's: the weights are
# the same bits, but a CPU with other kernels (or another thread count) sums in another order, and
# an argmax at a near-tie may flip. Two examples of 120 (policy) or 512 (judge); a model that is not
# the shipped one misses by far more (the 200-step math warm-up: 0.0 of 0.875, tests below).
TOLERANCE_EXAMPLES = 2


def _experiment():  # type: ignore[no-untyped-def]
    return load_config(resolve_config("experiment"))


def _entries() -> dict[str, shipped.ShippedEntry]:
    return shipped.load_manifest()


def _entry(kind: str, config: str = "experiment") -> shipped.ShippedEntry:
    return next(e for e in _entries().values() if e.kind == kind and e.config == config)


def test_the_shipped_keys_are_those_the_code_computes_for_the_shipped_configs() -> None:
    """The embedded default experiment's warm-ups (its policy and toy judge), and the policy
    warm-ups of `train`'s default config and of the code config (the suite's whole runs start from
    those two: built on every fresh machine, they took 394 s and 549 s of a CI run)."""
    assert SHIPPED_CONFIGS == ("experiment", "default", "code")
    want = {r.name: r for c in SHIPPED_CONFIGS for r in recipes(load_config(resolve_config(c)))}
    got = _entries()
    assert set(got) == set(want), (
        f"the shipped configs' warm-ups are {sorted(want)}, the shipped models {sorted(got)}: "
        f"a warm-up recipe changed without a rebuild; run `{shipped.REBUILD_COMMAND}` (make shipped-models)"
    )
    for name, r in want.items():
        assert got[name].key == r.key and got[name].recipe == json.loads(json.dumps(asdict(r.spec))), (
            f"{name}: the manifest's recipe is not the current one; run `{shipped.REBUILD_COMMAND}`"
        )
    assert {e.config for e in got.values()} == set(SHIPPED_CONFIGS)


@pytest.mark.parametrize("kind", ["warm-up", "judge"])
def test_a_shipped_model_is_what_its_manifest_says(kind: str) -> None:
    from safetensors import safe_open
    from transformers import AutoTokenizer

    e = _entry(kind)
    d = shipped.verify(e)  # every file's sha256
    assert sorted(p.name for p in d.iterdir()) == sorted(e.files)
    # the shape: the preset's, in config.json and in every tensor
    preset = PRESETS[e.recipe["model"]]
    cfg_json = json.loads((d / "config.json").read_text())
    assert e.shape == preset.config_json() == {k: cfg_json[k] for k in preset.config_json()}
    with safe_open(str(d / "model.safetensors"), framework="pt") as st:
        tensors = {k: list(st.get_slice(k).get_shape()) for k in st.keys()}  # noqa: SIM118
        dtypes = {st.get_slice(k).get_dtype() for k in st.keys()}  # noqa: SIM118
    assert tensors == e.tensors and dtypes == {"F32"} == {e.dtype}
    assert tensors["model.embed_tokens.weight"] == [preset.config_json()["vocab_size"], preset.hidden_size]
    assert len([k for k in tensors if k.endswith("self_attn.q_proj.weight")]) == preset.num_layers
    # the tokenizer: the one tiny_model builds
    tok = AutoTokenizer.from_pretrained(str(d))
    assert tokenizer_id(tok.get_vocab(), str(tok.eos_token)) == tokenizer_id() == e.tokenizer
    # the marker the warm-up wrote holds the same recipe
    assert json.loads((d / e.marker).read_text())["spec"] == e.recipe


def test_the_shipped_policy_keeps_its_validation_accuracy() -> None:
    e = _entry("warm-up")
    ex = val_examples(_experiment())
    assert e.val["metric"] == "greedy_exact_match" and e.val["examples"] == len(ex) == 120
    got = greedy_exact_match(shipped.verify(e), ex)
    assert got["exact"] >= e.val["value"] - TOLERANCE_EXAMPLES / len(ex), (got, e.val)
    assert e.val["value"] >= 0.8  # a warm-up worth shipping: most references written exactly


@pytest.mark.parametrize("config", ["default", "code"])
def test_the_other_shipped_policies_keep_their_validation_figure(config: str) -> None:
    e = _entry("warm-up", config)
    cfg = load_config(resolve_config(config))
    r = next(r for r in recipes(cfg) if r.kind == "warm-up")
    got = measure(r, shipped.verify(e), cfg)
    assert got["metric"] == e.val["metric"] and got["examples"] == e.val["examples"] > 0
    assert got["value"] >= e.val["value"] - TOLERANCE_EXAMPLES / got["examples"], (got, e.val)


def test_the_shipped_judge_keeps_its_heldout_accuracy() -> None:
    e = _entry("judge")
    r = next(r for r in recipes(_experiment()) if r.kind == "judge")
    got = measure(r, shipped.verify(e), _experiment())
    assert got["examples"] == e.val["examples"] == 512
    assert got["value"] >= e.val["value"] - TOLERANCE_EXAMPLES / got["examples"], (got, e.val)


def test_the_accuracy_check_tells_another_model_apart() -> None:
    """The figure the tests compare is not one every tiny model reaches: the untrained start model
    of the same preset (the warm-up's base, cached) writes no reference exactly."""
    from rollpacker.tasks.tiny_model import build_tiny_model

    base = build_tiny_model("tiny")
    ex = tuple(sorted(val_examples(_experiment()), key=lambda x: len(x.prompt))[:16])
    assert greedy_exact_match(base, ex)["exact"] == 0.0
    assert greedy_exact_match(shipped.verify(_entry("warm-up")), ex)["exact"] >= 0.5


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ROLLPACKER_CACHE", str(tmp_path / "cache"))

    def no_training(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("trained a warm-up that is shipped")

    monkeypatch.setattr("rollpacker.tasks.warmup._train", no_training)
    monkeypatch.setattr("rollpacker.tasks.judge_task._train", no_training)
    return tmp_path / "cache"


def test_the_experiment_installs_the_shipped_models_and_says_shipped_then_cached(cache: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from rollpacker.rewards.factory import judge_model_dir
    from rollpacker.tasks.prepare import prepare_model

    cfg = _experiment()
    said: list[str] = []
    path = prepare_model(cfg, say=said.append)
    e = _entry("warm-up")
    assert path == cache / "models" / e.name
    assert said == [f"warm-up: shipped with rollpacker, installed to {path}"]
    assert {f.name: shipped.sha256_file(f) for f in path.iterdir()} == e.files  # marker included
    judge = judge_model_dir(cfg, quiet=False)
    assert judge == cache / _entry("judge").name
    assert capsys.readouterr().err == f"judge warm-up: shipped with rollpacker, installed to {judge}\n"
    said.clear()
    assert prepare_model(cfg, say=said.append) == path
    assert said == [f"warm-up: cached ({path})"]
    assert judge_model_dir(cfg, quiet=False) == judge
    assert capsys.readouterr().err == f"judge warm-up: cached ({judge})\n"


def test_a_tampered_shipped_file_is_refused_and_nothing_is_installed(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollpacker.tasks.models import warmup_spec
    from rollpacker.tasks.warmup import warm_up

    root = tmp_path / "shipped"
    shutil.copytree(shipped.SHIPPED_ROOT, root)
    e = _entry("warm-up")
    f = root / e.name / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    monkeypatch.setattr(shipped, "SHIPPED_ROOT", root)
    with pytest.raises(shipped.ShippedModelError) as err:
        warm_up(warmup_spec(_experiment()))
    assert str(f) in str(err.value) and shipped.REBUILD_COMMAND in str(err.value)
    assert not (cache / "models" / e.name).exists()
    f.unlink()
    with pytest.raises(shipped.ShippedModelError, match="is missing"):
        warm_up(warmup_spec(_experiment()))


def test_a_recipe_with_another_key_trains_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted tiny recipe whose key is not shipped (the shipped one's with one setting changed
    would take minutes to train): trained, with the warm-up's own marker, nothing installed."""
    import dataclasses

    from rollpacker.tasks.models import warmup_spec
    from rollpacker.tasks.synthetic_math import SyntheticMathSpec
    from rollpacker.tasks.warmup import WarmupSpec, shipped_warm_up, warm_up

    monkeypatch.setenv("ROLLPACKER_CACHE", str(tmp_path))
    changed = dataclasses.replace(warmup_spec(_experiment()), lr=2e-3)
    assert changed.key() != _entry("warm-up").key and shipped_warm_up(changed) is None
    assert not list(tmp_path.glob("models/warm-*"))
    planted = WarmupSpec(model="bench", steps=2, batch_size=2, task=SyntheticMathSpec(num_examples=40))
    steps: list[int] = []
    out = warm_up(planted, progress=lambda s, _l: steps.append(s))
    assert steps == [0, 1] and out.name == f"warm-bench-{planted.key()}"
    info = json.loads((out / "warmup.json").read_text())
    assert info["spec"] == asdict(planted) and info["train_s"] > 0


def test_a_bad_manifest_is_refused_with_the_rebuild_command(tmp_path: Path) -> None:
    (tmp_path / shipped.MANIFEST).write_text(json.dumps({"version": 1, "entries": [{"name": "x"}]}))
    with pytest.raises(shipped.ShippedModelError, match=r"missing fields .*rollpacker model ship"):
        shipped.load_manifest(tmp_path)
    (tmp_path / shipped.MANIFEST).write_text("{")
    with pytest.raises(shipped.ShippedModelError, match="not valid JSON"):
        shipped.load_manifest(tmp_path)


def test_the_build_command_trains_measures_and_writes_what_the_cache_then_installs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rollpacker model ship`` end to end on a planted config (a 2-step warm-up of the 62K
    ``bench`` model, no judge): trained, measured, written with its manifest; the cache then
    installs it for that config's key instead of training."""
    from typer.testing import CliRunner

    from rollpacker.cli import app
    from rollpacker.tasks.models import warmup_spec
    from rollpacker.tasks.warmup import shipped_warm_up

    config = tmp_path / "planted.yaml"
    config.write_text(
        "experiment: t\ntask: {name: synthetic_math, num_examples: 60, val_size: 6}\n"
        "model: {preset: bench, warmup_steps: 2}\n"
    )
    out = tmp_path / "shipped"
    res = CliRunner().invoke(app, ["model", "ship", "--config", str(config), "--out", str(out)])
    assert res.exit_code == 0, res.output
    (entry,) = shipped.load_manifest(out).values()
    spec = warmup_spec(load_config(config))
    assert entry.name == f"warm-bench-{spec.key()}" and entry.recipe == json.loads(json.dumps(asdict(spec)))
    assert entry.val["metric"] == "greedy_exact_match" and entry.val["examples"] == 6
    assert json.loads((out / entry.name / "warmup.json").read_text())["train_s"] > 0  # trained now
    assert f"1 models ({entry.name})" in res.output
    monkeypatch.setattr(shipped, "SHIPPED_ROOT", out)
    monkeypatch.setenv("ROLLPACKER_CACHE", str(tmp_path / "cache"))
    installed = shipped_warm_up(spec)
    assert installed == tmp_path / "cache" / "models" / entry.name
    assert {f.name: shipped.sha256_file(f) for f in installed.iterdir()} == entry.files
