"""Label-free recovery after pruning (issue 33): train the pruned model to reproduce the dense one on unlabeled inputs.

The whole method on one screen. ``recover(pruned, dense, batches, steps=N | minutes=M, lr=...)`` minimises, over
the pruned model's trainable parameters (the blocks' Linear layers by default: norms, embeddings, LayerScale and
the widths stay as they are), one of two label-free losses on ``batches`` (the calibration inputs; never the
sensitivity pass's held-out ones, which ``calibration.calibration_data`` keeps apart):

- ``target="features"``: ``||f_p(x) - f_d(x)||^2 / ||f_d(x)||^2``, f the family's final features
  (``Adapter.features``: the pooled pre-logits of a ViT, the last hidden state at the real tokens of a text model);
- ``target="blocks"``: the mean over blocks i of ``||B_i^p(h_i) - B_i^d(h_i)||^2 / ||B_i^d(h_i) - h_i||^2`` where
  h_i is the DENSE model's input of block i: each pruned block learns to reproduce its dense block's residual update
  given the dense input (local, no drift through the stack). Padding tokens (``Adapter.token_mask``) are left out;
- ``target="hidden"``: the same sum with B_i^p fed the PRUNED model's own input of block i (its path from the
  embeddings): every block's output is pulled towards the dense one end to end, so a later block can learn to
  undo an earlier block's error (``blocks`` cannot: it never sees one). Same forward and backward cost as ``blocks``.

The dense targets are computed once per batch and cached (``cache=False``: recomputed at every visit, for data too
large to keep them: the block targets are (blocks + 1) x tokens x dim floats per input); a minutes budget counts
from the call (the targets and the first batch's loss before are in it). AdamW (no weight decay: it would pull the
compensated weights towards zero) or SGD with momentum, a linear warm-up over the first ``warmup`` of the budget
then a cosine decay to 0, gradient norm clipped at ``clip``; progress is steps done over ``steps``, or seconds
spent over ``minutes``. The model stays in eval mode (no dropout: the dense targets have
none). ``check`` batches, if given, are only evaluated (the loss before and after), never trained on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from corp_deploy.base.errors import CorpError
from corp_deploy.families import adapter_for

TARGETS = ("features", "blocks", "hidden")
OPTIMIZERS = ("adamw", "sgd")
TRAINED = ("linear", "all")
KEPT_INPUTS = 256
"""Calibration inputs a pruning run keeps for recovery (``Kept``): the study's count, whose block targets a
DINOv2-S holds in about 1.3 GB ((12 + 1) x 257 tokens x 384 floats per image)."""


@dataclass
class RecoveryRecord:
    """What a recovery did, for ``corp.json`` (``to_dict`` / ``from_dict`` round-trip)."""

    target: str
    optimizer: str
    trained: str
    lr: float
    budget: dict[str, float]
    """``{"steps": N}`` or ``{"minutes": M}``, as asked."""
    steps: int
    seconds: float
    inputs: int
    """Distinct unlabeled inputs trained on (images or sequences)."""
    batches: int
    loss_before: float
    loss_after: float
    """The objective on the first training batch, before and after (a cheap monitor, not a held-out figure)."""
    check_before: float | None = None
    check_after: float | None = None
    """The same objective on the ``check`` batches (never trained on), when given."""
    check_inputs: int = 0
    """Inputs in the ``check`` batches."""
    parameters: int = 0
    """Trainable parameters."""
    history: list[tuple[int, float]] = field(default_factory=list)
    """(step, training loss of that step) every ``log_every`` steps."""
    kept: str = "recovered"
    """Whose weights the model holds after ``Recovery.run``: ``recovered``, or ``corp`` when the held-out objective
    rose (the recovered weights were put back to CORP's)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RecoveryRecord:
        return cls(**{**d, "history": [tuple(h) for h in d.get("history", [])]})


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a recovery, after ``steps`` of its ``budget``: still an interrupt to every caller, and it says
    how far the recovery went (``Recovery.run`` puts CORP's weights back first)."""

    def __init__(self, steps: int, budget: dict[str, float]) -> None:
        asked = f"{budget['steps']:g} steps" if "steps" in budget else f"{budget['minutes']:g} minutes"
        super().__init__(f"recovery interrupted after {steps} of {asked}")
        self.steps, self.budget = steps, budget


def recovery_budget(steps: int | None, minutes: float | None, lr: float = 1.0) -> dict[str, float]:
    """``{"steps": N}`` or ``{"minutes": M}``; one line when both, neither or a non-positive one is given."""
    if (steps is None) == (minutes is None):
        raise CorpError("recovery needs exactly one budget: --recover-steps N or --recover-minutes M")
    if steps is not None and (isinstance(steps, bool) or int(steps) != steps or steps < 1):
        raise CorpError(f"--recover-steps must be a whole number >= 1, not {steps}")
    if minutes is not None and not (minutes > 0 and math.isfinite(minutes)):
        raise CorpError(f"--recover-minutes must be > 0, not {minutes}")
    if not (lr > 0 and math.isfinite(lr)):
        raise CorpError(f"--recover-lr (the recovery learning rate) must be > 0, not {lr}")
    return {"steps": int(steps)} if steps is not None else {"minutes": float(minutes)}


def check_choices(target: str, optimizer: str = "adamw", trained: str = "linear") -> None:
    """One line for a target, optimizer or trained set ``recover`` does not know."""
    for name, value, allowed in (
        ("target", target, TARGETS),
        ("optimizer", optimizer, OPTIMIZERS),
        ("trained", trained, TRAINED),
    ):
        if value not in allowed:
            raise CorpError(f"unknown recovery {name} {value!r}; choose one of {', '.join(allowed)}")


@dataclass(frozen=True)
class Recovery:
    """A recovery asked for (``--recover-*``), checked when made, so a bad budget fails before any model is built
    or data read; ``run`` is ``recover`` with these settings (the other settings: ``recover``'s defaults)."""

    steps: int | None = None
    minutes: float | None = None
    lr: float = 1e-4
    target: str = "blocks"

    def __post_init__(self) -> None:
        recovery_budget(self.steps, self.minutes, self.lr)
        check_choices(self.target)

    def run(
        self,
        pruned: nn.Module,
        dense: nn.Module,
        batches: Iterable[Any],
        check: Iterable[Any] | None = None,
        say: Callable[[str], None] | None = None,
    ) -> RecoveryRecord:
        """``recover``, then CORP's weights back where the held-out objective (``check``) came out higher than it
        went in: a recovery that drifted off its start on data it never trained on is not shipped (``kept``)."""
        start = {k: v.detach().clone() for k, v in pruned.state_dict().items()}  # one more copy of the pruned model
        try:
            record = recover(
                pruned,
                dense,
                batches,
                steps=self.steps,
                minutes=self.minutes,
                lr=self.lr,
                target=self.target,
                check=check,
                say=say,
            )
        except Interrupted:  # half-trained weights are nobody's result: CORP's go back
            pruned.load_state_dict(start)
            raise
        if record.check_after is not None and record.check_after > record.check_before:
            pruned.load_state_dict(start)
            record.kept = "corp"
        return record


def inputs_of(batch: Any) -> Any:
    """A batch's inputs: calibration batches come as (inputs, skipped) pairs, other batches as the inputs."""
    return batch[0] if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[1], int) else batch


class Kept:
    """``batches`` passed through to the one calibration pass that reads them, the first whole batches up to
    ``limit`` inputs (``count`` of a batch's inputs) kept in ``batches`` for recovery to train on: the data are
    read once, and only what recovery trains on stays in memory (in host memory, as the stream gave it)."""

    def __init__(self, batches: Iterable[Any], count: Callable[[Any], int], limit: int = KEPT_INPUTS) -> None:
        self.source, self.count, self.limit = batches, count, limit
        self.batches: list[Any] = []
        self.inputs = 0

    def __iter__(self) -> Iterator[Any]:
        for batch in self.source:
            if self.inputs < self.limit:
                self.batches.append(batch)
                self.inputs += self.count(inputs_of(batch))
            yield batch


def trainable(model: nn.Module, trained: str) -> list[nn.Parameter]:
    """The parameters recovery trains (the rest get ``requires_grad=False``): every Linear's weight and bias inside
    the blocks (``linear``), or all of them (``all``)."""
    if trained == "all":
        params = list(model.parameters())
    else:
        params = [
            p
            for block in adapter_for(model).blocks(model)
            for m in block.modules()
            if isinstance(m, nn.Linear)
            for p in m.parameters(recurse=False)
        ]
    chosen = {id(p) for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in chosen)
    return params


def lr_factor(progress: float, warmup: float) -> float:
    """Linear warm-up to 1 over ``warmup`` of the budget, then a cosine to 0 at ``progress`` 1."""
    if progress < warmup:
        return (progress + 1e-3) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))))


class Objective:
    """The loss of ``target`` for one batch, its dense targets computed once and cached by batch index."""

    def __init__(self, pruned: nn.Module, dense: nn.Module, target: str, cache: bool = True) -> None:
        self.pruned, self.dense, self.target, self.keep = pruned, dense, target, cache
        self.adapter = adapter_for(pruned)
        self.device = next(pruned.parameters()).device
        self.cache: dict[int, Any] = {}

    @torch.no_grad()
    def dense_targets(self, key: int, inputs: Any) -> Any:
        if key in self.cache:
            return self.cache[key]
        a = self.adapter
        x, call = a.block_call(self.dense, inputs, self.device)
        if self.target == "features":
            found = a.features_from(self.dense, 0, x, call, inputs)
        else:
            xs = [x]
            for block in a.blocks(self.dense):
                xs.append(call.run(block, xs[-1]))
            found = (xs, call, a.token_mask(inputs, self.device))
        if self.keep:
            self.cache[key] = found
        return found

    def __call__(self, key: int, inputs: Any) -> Tensor:
        a, want = self.adapter, self.dense_targets(key, inputs)
        if self.target == "features":
            x, call = a.block_call(self.pruned, inputs, self.device)
            got = a.features_from(self.pruned, 0, x, call, inputs)
            return (got - want).square().sum() / want.square().sum().clamp_min(1e-12)
        xs, call, mask = want
        losses, h = [], xs[0]
        for i, block in enumerate(a.blocks(self.pruned)):
            h = call.run(block, h if self.target == "hidden" else xs[i])
            err, update = h - xs[i + 1], xs[i + 1] - xs[i]
            if mask is not None:
                err, update = err[mask], update[mask]
            losses.append(err.square().sum() / update.square().sum().clamp_min(1e-12))
        return torch.stack(losses).mean()

    @torch.no_grad()
    def mean(self, batches: Sequence[Any], offset: int = 0) -> float:
        return sum(float(self(offset + i, b)) for i, b in enumerate(batches)) / len(batches)


def recover(
    pruned: nn.Module,
    dense: nn.Module,
    batches: Iterable[Any],
    *,
    steps: int | None = None,
    minutes: float | None = None,
    lr: float = 1e-4,
    target: str = "blocks",
    optimizer: str = "adamw",
    trained: str = "linear",
    warmup: float = 0.1,
    clip: float = 1.0,
    check: Iterable[Any] | None = None,
    seed: int = 0,
    log_every: int = 1,
    cache: bool = True,
    say: Any = None,
) -> RecoveryRecord:
    """Train ``pruned`` in place towards ``dense`` on ``batches`` (inputs, or (inputs, skipped) pairs as the
    calibration batches come) within ``steps`` or ``minutes``; the record of what it did (see the module doc)."""
    budget = recovery_budget(steps, minutes, lr)
    check_choices(target, optimizer, trained)
    data, held = [inputs_of(b) for b in batches], [inputs_of(b) for b in check or []]
    if not data:
        raise CorpError("recovery needs at least one batch of unlabeled inputs")
    adapter = adapter_for(pruned)
    widths = [adapter.structure(b) for b in adapter.blocks(pruned)]
    start = time.perf_counter()
    dense.eval()
    pruned.eval()  # no dropout: the targets are the dense model's eval-mode outputs
    objective = Objective(pruned, dense, target, cache)
    params = trainable(pruned, trained)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    else:
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    loss_before = objective.mean(data[:1])
    check_before = objective.mean(held, offset=len(data)) if held else None
    seconds = budget.get("minutes", 0) * 60
    order = torch.Generator().manual_seed(seed)
    done, history, queue, said = 0, [], [], 0
    try:
        while True:
            progress = done / budget["steps"] if "steps" in budget else (time.perf_counter() - start) / seconds
            if progress >= 1:
                break
            if not queue:
                queue = torch.randperm(len(data), generator=order).tolist()
            i = queue.pop()
            for group in opt.param_groups:
                group["lr"] = lr * lr_factor(progress, warmup)
            loss = objective(i, data[i])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            done += 1
            if done % log_every == 0:
                history.append((done, loss.item()))
            elapsed = time.perf_counter() - start
            tenth = int(10 * (done / budget["steps"] if "steps" in budget else elapsed / seconds))
            if say and tenth > said:  # about ten lines, whatever the budget
                said = tenth
                say(f"recovery step {done}: loss {loss.item():.4g} ({elapsed:.0f} s)")
    except KeyboardInterrupt:
        raise Interrupted(done, budget) from None
    finally:
        for p in pruned.parameters():
            p.requires_grad_(True)
    record = RecoveryRecord(
        target=target,
        optimizer=optimizer,
        trained=trained,
        lr=lr,
        budget=budget,
        steps=done,
        seconds=time.perf_counter() - start,
        inputs=sum(adapter.count(b) for b in data),
        batches=len(data),
        loss_before=loss_before,
        loss_after=objective.mean(data[:1]),
        check_before=check_before,
        check_after=objective.mean(held, offset=len(data)) if held else None,
        check_inputs=sum(adapter.count(b) for b in held),
        parameters=sum(p.numel() for p in params),
        history=history,
    )
    if [adapter.structure(b) for b in adapter.blocks(pruned)] != widths:
        raise AssertionError("recovery changed the pruned model's widths")
    return record
