"""The LLM judge's task: the prompt it reads, its warm-up data, and its cached warm-up.

The judge reads (problem, candidate response, reference response) and answers ``yes`` or ``no``.
Its prompt (``JudgePromptFormat``, stored with the warmed-up judge) is, by default, the last
``tail_chars`` characters of the response, a newline, the last ``tail_chars`` of the reference
(each left-padded to exactly that width), and the verdict follows at once::

    =2\nAnswer: 5            <- response tail (12 characters)
    =2\nAnswer: 2            <- reference tail
    y|n                      <- the answer token

The verdict of a step-by-step solution is decided by its final answer, which is at its end, and
the prompt is compact on purpose: a tiny judge trained from scratch learns to compare the two
answers only when little else competes for its attention (measured on this CPU, ``micro``, batch
256: 1.00 held-out accuracy after 150 steps with this format; 0.59 after 175 steps with the
problem line in front, ``include_problem=True``; a longer tail or a batch of 32 stays at chance
for hundreds of steps). The answer is one token: the byte ``y`` or ``n`` (byte-level tokenizer),
and the judge's score is ``P(yes) = softmax(logit_y, logit_n)[0]`` at the last prompt position.
Batches are right-padded and each row is read at its own last token, so batched scoring equals
per-sample scoring (causal attention never looks right).

A configured judge model (``reward.judge.model``, no ``judge.json``: an instruction-tuned LM)
reads ``InstructPromptFormat`` instead: the problem, the reference and the response in full and a
yes/no question; its ``P(yes)`` compares the first tokens of ``YES_WORDS`` with those of
``NO_WORDS`` (``instruct_verdict_ids``, ``verdict_logits(..., verdicts)``).

Warm-up data (``judge_pairs``) comes from the synthetic math task: a correct candidate is the
reference solution or a terse ``Answer: <right digit>``; an incorrect one is the reference solution
with a wrong final answer, with a wrong step carried through (so its final answer is wrong too),
or a terse wrong answer. Warm-up (``warm_up_judge``) is a short supervised run of a ``tiny_model``
preset (``micro`` by default) with the loss on the single answer token.

Invariants:
- ``judge_pairs(n, seed, ...)`` is a pure function of its arguments and balanced: exactly
  ``ceil(n / 2)`` positives; every positive's final answer equals the reference's, every
  negative's differs;
- a rendered prompt is a pure function of (format, problem, response, reference); without the
  problem its length is exactly ``2 * tail_chars + 1``;
- ``warm_up_judge(spec)`` is deterministic, cached under ``default_cache_dir()/judge-<spec key>``
  (the key hashes the whole spec, prompt format included, and the base model's key), and a cached
  directory is complete or absent (written to a temporary sibling, then renamed);
- warm-up pairs and held-out pairs use disjoint seeds, both disjoint from the RL datasets' seeds.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollpacker.tasks import shipped, synthetic_math
from rollpacker.tasks.tiny_model import PRESETS, build_tiny_model, default_cache_dir, publish_dir

if TYPE_CHECKING:
    import torch

JUDGE_WARMUP_VERSION = 1
YES, NO = "yes", "no"  # the verdicts; their first bytes (y, n) are the answer tokens
JUDGE_TRAIN_SEED_OFFSET = 2_000_003  # warm-up pairs never share a seed with an RL dataset
JUDGE_EVAL_SEED_OFFSET = 3_000_017  # held-out pairs: disjoint from the warm-up pairs


def _tail(text: str, width: int) -> str:
    """The last ``width`` characters of ``text`` (stripped), left-padded with spaces to exactly ``width``."""
    return text.strip()[-width:].rjust(width)


@dataclass(frozen=True)
class JudgePromptFormat:
    tail_chars: int = 12  # characters kept from the end of the response and of the reference
    include_problem: bool = False  # prefix "Problem: <problem>\n" (see the module docstring)

    def __post_init__(self) -> None:
        if self.tail_chars < 1:
            raise ValueError(f"judge prompt tail_chars = {self.tail_chars}: must be >= 1")

    def render(self, problem: str, response: str, reference: str) -> str:
        """The judge's prompt; the next token is the verdict's first byte (``y`` or ``n``)."""
        head = f"Problem: {problem.strip()}\n" if self.include_problem else ""
        return f"{head}{_tail(response, self.tail_chars)}\n{_tail(reference, self.tail_chars)}"


DEFAULT_FORMAT = JudgePromptFormat()

YES_WORDS = ("yes", "Yes", " yes", " Yes")  # an instruction-tuned judge's verdict, as it may begin
NO_WORDS = ("no", "No", " no", " No")


@dataclass(frozen=True)
class InstructPromptFormat:
    """The prompt of a configured judge (``reward.judge.model``: an instruction-tuned LM, no
    ``judge.json``): the problem, the reference and the response in full, then a yes/no
    question. ``JudgeReward`` wraps it in the tokenizer's chat template when it has one, and reads
    ``P(yes)`` from the first tokens of ``YES_WORDS`` against those of ``NO_WORDS``."""

    question: str = (
        "Does the candidate response reach the same final answer as the reference answer? Answer yes or no."
    )

    def render(self, problem: str, response: str, reference: str) -> str:
        return (
            f"Problem:\n{problem.strip()}\n\nReference answer:\n{reference.strip()}\n\n"
            f"Candidate response:\n{response.strip()}\n\n{self.question}"
        )


def instruct_verdict_ids(tokenizer: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The first token ids of ``YES_WORDS`` and of ``NO_WORDS``, without the ids both share (a
    byte-level tokenizer starts `` yes`` and `` no`` alike)."""
    yes = {int(tokenizer.encode(w, add_special_tokens=False)[0]) for w in YES_WORDS}
    no = {int(tokenizer.encode(w, add_special_tokens=False)[0]) for w in NO_WORDS}
    yes, no = yes - no, no - yes
    if not yes or not no:
        raise ValueError(
            f"the judge's tokenizer cannot tell {YES_WORDS} from {NO_WORDS} by their first token"
        )
    return tuple(sorted(yes)), tuple(sorted(no))


def judge_prompt(problem: str, response: str, reference: str, fmt: JudgePromptFormat = DEFAULT_FORMAT) -> str:
    """The judge's prompt in format ``fmt`` (the default format unless a judge was trained otherwise)."""
    return fmt.render(problem, response, reference)


@dataclass(frozen=True)
class JudgePair:
    problem: str
    response: str
    reference: str
    label: bool  # True: the response is correct
    variant: str  # how the response was made: full | terse | wrong_answer | wrong_step | terse_wrong

    def prompt(self, fmt: JudgePromptFormat = DEFAULT_FORMAT) -> str:
        return fmt.render(self.problem, self.response, self.reference)


def _wrong_step_solution(start: int, add: int, n: int, rng: random.Random) -> str:
    """The solution with one step's result off by ``delta`` (mod 10), carried through to the end."""
    bad = rng.randrange(1, n + 1)
    delta = rng.randrange(1, synthetic_math.MODULUS)
    lines, x = [], start
    for k in range(1, n + 1):
        y = (x + add) % synthetic_math.MODULUS
        if k == bad:
            y = (y + delta) % synthetic_math.MODULUS
        lines.append(synthetic_math.step_line(k, n, x, add, y))
        x = y
    lines.append(f"Answer: {x}")
    return "\n".join(lines)


def judge_pairs(
    num_pairs: int, seed: int, task: synthetic_math.SyntheticMathSpec | None = None
) -> tuple[JudgePair, ...]:
    """Balanced (problem, response, reference, label) pairs built from the synthetic math task."""
    if num_pairs < 1:
        raise ValueError(f"num_pairs = {num_pairs}: must be >= 1")
    task = task or synthetic_math.SyntheticMathSpec(
        num_examples=num_pairs, max_steps=12, hard_fraction=0.0, hard_min_steps=12
    )
    task = synthetic_math.SyntheticMathSpec(
        num_examples=num_pairs,
        median_steps=task.median_steps,
        sigma=task.sigma,
        max_steps=task.max_steps,
        hard_fraction=task.hard_fraction,
        hard_min_steps=task.hard_min_steps,
    )
    rng = random.Random(f"judge-pairs:{seed}")
    out = []
    for i, ex in enumerate(synthetic_math.generate(task, seed)):
        m = ex.metadata
        start, add, n = int(m["start"]), int(m["add"]), int(m["steps"])
        reference = synthetic_math.solution_text(start, add, n)
        right = synthetic_math.answer(start, add, n)
        wrong = (right + rng.randrange(1, synthetic_math.MODULUS)) % synthetic_math.MODULUS
        if i % 2 == 0:
            variant = rng.choice(("full", "terse"))
            response = reference if variant == "full" else f"Answer: {right}"
        else:
            variant = rng.choice(("wrong_answer", "wrong_step", "terse_wrong"))
            if variant == "wrong_answer":
                response = reference.rpartition("Answer:")[0] + f"Answer: {wrong}"
            elif variant == "wrong_step":
                response = _wrong_step_solution(start, add, n, rng)
            else:
                response = f"Answer: {wrong}"
        out.append(JudgePair(ex.prompt, response, reference, i % 2 == 0, variant))
    return tuple(out)


# --- scoring primitive (shared by the warm-up, the judge reward and the offload runner's checks) ------


def verdict_token_ids(tokenizer: Any) -> tuple[int, int]:
    """Token ids of the verdicts' first bytes: (``y``, ``n``)."""
    ids = []
    for word in (YES, NO):
        toks = tokenizer.encode(word[0], add_special_tokens=False)
        if len(toks) != 1:
            raise ValueError(f"the judge's tokenizer splits {word[0]!r} into {toks}; it needs one token")
        ids.append(int(toks[0]))
    return ids[0], ids[1]


def encode_batch(
    tokenizer: Any, texts: Sequence[str], device: Any = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask, last_index)`` of ``texts``."""
    import torch

    seqs = [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    if not seqs or any(not s for s in seqs):
        raise ValueError("encode_batch needs at least one text, and no empty text")
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attn[i, : len(s)] = 1
    last = torch.tensor([len(s) - 1 for s in seqs], dtype=torch.long)
    return ids.to(device), attn.to(device), last.to(device)


def last_hidden(model: Any, ids: torch.Tensor, attn: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The final-norm hidden state at each row's last real token: ``[batch, hidden]``."""
    import torch

    h = model.model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
    return h[torch.arange(h.shape[0], device=h.device), last]


def verdict_logits(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    verdicts: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
) -> torch.Tensor:
    """``[batch, 2]`` logits of (yes, no) after each text, for a HF causal LM ``model``: of the
    tokens ``y`` and ``n`` (the toy judge's answer bytes), or with ``verdicts`` (yes ids, no ids)
    the log-sum-exp of each group's logits (``instruct_verdict_ids``).

    ``model`` needs ``.model`` (the decoder stack) and ``.lm_head``; an offloaded model from
    ``rollpacker.rewards.offload`` qualifies, so both judges run exactly this code.
    """
    import torch

    device = model.lm_head.weight.device
    ids, attn, last = encode_batch(tokenizer, texts, device)
    h = last_hidden(model, ids, attn, last)
    if verdicts is None:
        y, n = verdict_token_ids(tokenizer)
        return model.lm_head(h)[:, [y, n]].float()
    logits = model.lm_head(h).float()
    yes, no = (logits[:, list(group)].logsumexp(dim=-1) for group in verdicts)
    return torch.stack((yes, no), dim=-1)


def p_yes(logits: torch.Tensor) -> torch.Tensor:
    """P(yes) from ``[batch, 2]`` (yes, no) logits."""
    return logits.float().softmax(dim=-1)[:, 0]


# --- warm-up ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JudgeWarmupSpec:
    model: str = "micro"  # a tiny_model preset
    task: synthetic_math.SyntheticMathSpec = field(
        default_factory=lambda: synthetic_math.SyntheticMathSpec(
            num_examples=20000, max_steps=12, hard_fraction=0.0, hard_min_steps=12
        )
    )
    prompt: JudgePromptFormat = field(default_factory=JudgePromptFormat)
    steps: int = 150
    batch_size: int = 256  # large on purpose: the answer-comparison signal is faint early on
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 20
    eval_pairs: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model not in PRESETS:
            raise ValueError(f"judge warm-up model {self.model!r}: use one of {sorted(PRESETS)}")
        for name in ("steps", "batch_size", "eval_pairs", "warmup_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"judge warm-up {name} = {getattr(self, name)}: must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"judge warm-up lr = {self.lr}: must be > 0")

    def key(self) -> str:
        blob = json.dumps(
            {
                "v": JUDGE_WARMUP_VERSION,
                "math_task_version": synthetic_math.TASK_VERSION,  # the pairs are its text
                "base": PRESETS[self.model].key(),
                **asdict(self),
            },
            sort_keys=True,
        ).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def judge_dir(spec: JudgeWarmupSpec, cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / f"judge-{spec.key()}"


def warm_up_judge(
    spec: JudgeWarmupSpec | None = None,
    cache_dir: Path | None = None,
    force: bool = False,
    progress: Callable[[int, float], None] | None = None,
    use_shipped: bool = True,
) -> Path:
    """Return the directory of the warmed-up judge for ``spec``: the cached one, else the shipped
    one for the same key installed into the cache (``tasks/shipped.py``; unless ``use_shipped`` is
    False), else one trained now. ``force``: train even if cached or shipped.

    The directory holds the model and tokenizer (``from_pretrained``-loadable) and ``judge.json``
    (the spec, final loss, training seconds, held-out accuracy). ``progress(step, loss)`` is called
    after each optimizer step.
    """
    spec = spec or JudgeWarmupSpec()
    out = judge_dir(spec, cache_dir)
    if (out / "judge.json").is_file() and not force:
        return out
    if use_shipped and not force and shipped.install(out) is not None:
        return out
    base = build_tiny_model(spec.model, cache_dir=cache_dir)

    def build(tmp: Path) -> None:
        info = _train(spec, base, tmp, progress)
        (tmp / "judge.json").write_text(json.dumps({"spec": asdict(spec), **info}, indent=2))

    return publish_dir(out, build, None if force else lambda d: (d / "judge.json").is_file())


def shipped_judge(spec: JudgeWarmupSpec, cache_dir: Path | None = None) -> Path | None:
    """The shipped judge for ``spec``'s key installed into the cache (verified against the
    manifest), or None when no judge is shipped for that key."""
    return shipped.install(judge_dir(spec, cache_dir))


def judge_info(model_dir: Path) -> dict[str, Any]:
    """The ``judge.json`` written by ``warm_up_judge`` (held-out accuracy, training time)."""
    info: dict[str, Any] = json.loads((Path(model_dir) / "judge.json").read_text())
    return info


def prompt_format(model_dir: Path) -> JudgePromptFormat | InstructPromptFormat:
    """The prompt format a judge was warmed up with (its ``judge.json``), or for a judge model
    without one (a configured, instruction-tuned judge) ``InstructPromptFormat``."""
    f = Path(model_dir) / "judge.json"
    if not f.is_file():
        return InstructPromptFormat()
    return JudgePromptFormat(**judge_info(model_dir)["spec"]["prompt"])


def evaluate_judge(
    model: Any,
    tokenizer: Any,
    pairs: Sequence[JudgePair],
    fmt: JudgePromptFormat = DEFAULT_FORMAT,
    batch_size: int = 64,
) -> float:
    """Accuracy of ``P(yes) > 0.5`` against the pairs' labels."""
    import torch

    hits = 0
    with torch.inference_mode():
        for i in range(0, len(pairs), batch_size):
            chunk = pairs[i : i + batch_size]
            probs = p_yes(verdict_logits(model, tokenizer, [p.prompt(fmt) for p in chunk]))
            hits += sum(int((float(q) > 0.5) == p.label) for q, p in zip(probs, chunk, strict=True))
    return hits / len(pairs)


def _train(
    spec: JudgeWarmupSpec, base: Path, out: Path, progress: Callable[[int, float], None] | None
) -> dict[str, float]:
    import torch

    threads = torch.get_num_threads()
    # one thread: the judge's matrices are too small to gain from a second one, and on a busy
    # machine an oversubscribed OpenMP team is several times slower (measured here: 8 s vs 1 s/step)
    torch.set_num_threads(1)
    try:
        return _train_single_threaded(spec, base, out, progress)
    finally:
        torch.set_num_threads(threads)


def _train_single_threaded(
    spec: JudgeWarmupSpec, base: Path, out: Path, progress: Callable[[int, float], None] | None
) -> dict[str, float]:
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(base))
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model.train()
    train = judge_pairs(spec.task.num_examples, JUDGE_TRAIN_SEED_OFFSET + spec.seed, spec.task)
    held_out = judge_pairs(spec.eval_pairs, JUDGE_EVAL_SEED_OFFSET + spec.seed, spec.task)
    y, n = verdict_token_ids(tok)
    rng = random.Random(f"judge-warmup:{spec.seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / spec.warmup_steps) * max(0.05, 1 - s / spec.steps)
    )
    loss_v = float("nan")
    for step in range(spec.steps):
        batch = [train[rng.randrange(len(train))] for _ in range(spec.batch_size)]
        ids, attn, last = encode_batch(tok, [p.prompt(spec.prompt) for p in batch])
        target = torch.tensor([y if p.label else n for p in batch], dtype=torch.long)
        opt.zero_grad(set_to_none=True)
        logits = model.lm_head(last_hidden(model, ids, attn, last)).float()
        loss = torch.nn.functional.cross_entropy(logits, target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_v = float(loss.detach())
        if progress is not None:
            progress(step, loss_v)
    train_s = time.perf_counter() - t0
    model.eval()
    acc = evaluate_judge(model, tok, held_out, spec.prompt)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return {"final_loss": loss_v, "train_s": train_s, "heldout_accuracy": acc, "heldout_pairs": len(held_out)}
