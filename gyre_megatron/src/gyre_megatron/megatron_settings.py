"""A team's own megatron-core settings (``[training.megatron]``), by megatron-core's names.

Each key is a field of megatron-core's ``TransformerConfig``, ``DistributedDataParallelConfig``
or ``OptimizerConfig``, or a parameter of its learning-rate scheduler
(``OptimizerParamScheduler``: ``lr_warmup_steps``, ``lr_decay_style``, ...), checked against the
installed release's own dataclasses and signature, so the names are the ones that release
documents. A key goes to every one of them that has it.

Some fields Gyre must own, because every cell shares them or Gyre does the work itself: the
model's shape comes from the model folder, the layout and precision from ``[training]``, the
gradient reduction across cells is Gyre's, and so is gradient clipping (over the core's whole
pipeline). Setting one of those here is an error that names the key to use instead
(:data:`OWNED`).

The scheduler counts Gyre's steps: a step makes exactly one optimizer update, so
``lr_warmup_steps`` and ``lr_decay_steps`` are steps of the run (``lr_decay_steps`` defaults to
``run.steps``, as Megatron's ``--lr-decay-iters`` defaults to ``--train-iters``). The learning
rate of step ``s`` is a function of ``s`` alone, so a resumed run continues the schedule where it
stopped without saving the scheduler.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["MEGATRON_LM_NAMES", "OWNED", "SCHEDULER_DEFAULTS", "MegatronSettings", "apply_schedule", "make_scheduler",
           "settings_problems", "settings_refused", "signature_keys", "split_settings"]

_MODEL = "the model's own config.json (model.dir) or [model]"
_REDUCE = "Gyre reduces a step's gradients across cells itself, after the step's last micro-step"
OWNED: dict[str, str] = {
    **{k: _MODEL for k in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
        "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func", "add_bias_linear",
        "add_qkv_bias", "qk_layernorm", "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk",
        "moe_router_pre_softmax")},
    "tensor_model_parallel_size": "training.tp",
    "pipeline_model_parallel_size": "training.pp",
    "expert_model_parallel_size": "training.ep",
    "expert_tensor_parallel_size": "training.ep (1: experts split over the tensor ranks; tp: whole experts)",
    "sequence_parallel": "training.tp (Gyre turns it on where megatron-core requires it: MoE with tp > 1)",
    "context_parallel_size": "context parallelism is not offered yet",
    "virtual_pipeline_model_parallel_size": "training.pp (Gyre's pausable schedule streams one stage per rank)",
    "bf16": "training.precision", "fp16": "training.precision", "params_dtype": "training.precision",
    "pipeline_dtype": "training.precision",
    "lr": "training.lr", "max_lr": "training.lr",
    "clip_grad": "training.clip_grad (Gyre clips over the core's whole pipeline)",
    "calculate_per_token_loss": "training.objective (its own weights normalise the loss)",
    "use_cpu_initialization": "Gyre draws weights on the host, so a seeded model is the same at any tp",
    "optimizer": "the core runs megatron-core's Adam (other optimizers are not offered yet)",
    "use_distributed_optimizer": _REDUCE, "overlap_grad_reduce": _REDUCE, "overlap_param_gather": _REDUCE,
    "num_distributed_optimizer_instances": _REDUCE, "average_in_collective": _REDUCE,
    "use_megatron_fsdp": _REDUCE, "use_custom_fsdp": _REDUCE,
    "transformer_impl": "training.transformer_impl",
    "use_checkpoint_opt_param_scheduler": "the schedule is a function of the step, never saved",
    "override_opt_param_scheduler": "the schedule is a function of the step, never saved",
}
"""Fields Gyre sets itself, each with the key to set instead (or why none)."""

MEGATRON_LM_NAMES: dict[str, str] = {
    "lr_warmup_iters": "lr_warmup_steps", "lr_decay_iters": "lr_decay_steps", "lr_warmup_init": "init_lr",
    "start_weight_decay": "start_wd", "end_weight_decay": "end_wd", "weight_decay_incr_style": "wd_incr_style",
    "lr_wsd_decay_iters": "wsd_decay_steps", "lr_warmup_fraction": "lr_warmup_steps",
    "train_iters": "run.steps",
}
"""Megatron-LM's command-line names for what megatron-core's scheduler calls otherwise (a hint
when a recipe's name is used)."""

SCHEDULER_DEFAULTS: dict[str, Any] = {
    "init_lr": 0.0, "min_lr": 0.0, "lr_warmup_steps": 0, "lr_decay_steps": None,
    "lr_decay_style": "constant", "wd_incr_steps": None, "wd_incr_style": "constant",
    "start_wd": None, "end_wd": None, "wsd_decay_steps": None, "lr_wsd_decay_style": None,
}
"""The schedule's keys and their defaults: Megatron's (a constant learning rate, no warm-up);
``None`` steps default to ``run.steps``, ``None`` weight decays to ``weight_decay``."""

_SCHEDULER_TYPES: dict[str, Any] = {
    "init_lr": float, "min_lr": float, "lr_warmup_steps": int, "lr_decay_steps": int,
    "lr_decay_style": typing.Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"],
    "wd_incr_steps": int, "wd_incr_style": typing.Literal["constant", "linear", "cosine"],
    "start_wd": float, "end_wd": float, "wsd_decay_steps": int,
    "lr_wsd_decay_style": typing.Literal["linear", "cosine", "exponential", "minus_sqrt"],
}


@functools.lru_cache(maxsize=1)
def _targets() -> dict[str, dict[str, Any]]:
    """Each target's settable fields and their types, from the installed megatron-core."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    out: dict[str, dict[str, Any]] = {}
    for name, cls in (("transformer", TransformerConfig), ("ddp", DistributedDataParallelConfig),
                      ("optimizer", OptimizerConfig)):
        hints = typing.get_type_hints(cls)
        out[name] = {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}
    out["scheduler"] = dict(_SCHEDULER_TYPES)
    return out


def _convert(tp: Any, value: Any) -> tuple[bool, Any]:
    """Whether a TOML ``value`` fits the annotation ``tp``, and the value as the field takes it
    (an enum member from its name, a tuple from a list). Types a file cannot hold (callables,
    torch dtypes, classes) fit nothing."""
    if tp is Any:
        return True, value
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return value in typing.get_args(tp) and type(value) in {type(a) for a in typing.get_args(tp)}, value
    if origin is typing.Union or origin is types.UnionType:
        for arg in typing.get_args(tp):
            ok, v = _convert(arg, value)
            if ok:
                return True, v
        return False, value
    if origin in (list, tuple):
        if not isinstance(value, list):
            return False, value
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        items = []
        for i, item in enumerate(value):
            arg = (args[i] if origin is tuple and len(args) > 1 and i < len(args) else args[0]) if args else Any
            ok, v = _convert(arg, item)
            if not ok:
                return False, value
            items.append(v)
        if origin is tuple and len(args) > 1 and Ellipsis not in typing.get_args(tp) and len(items) != len(args):
            return False, value
        return True, tuple(items) if origin is tuple else items
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool), float(value) if isinstance(
            value, (int, float)) and not isinstance(value, bool) else value
    if tp is str:
        return isinstance(value, str), value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, str) and value in tp.__members__:
            return True, tp[value]
        return False, value
    return False, value


def _union_args(tp: Any) -> list[Any]:
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        return [a for a in typing.get_args(tp) if a is not type(None)]
    return [tp]


def _file_can_hold(tp: Any) -> bool:
    """Whether some value a TOML file can hold fits ``tp`` (not a callable, a dtype, a class)."""
    for arg in _union_args(tp):
        origin = typing.get_origin(arg)
        if arg is Any or arg in (bool, int, float, str) or origin in (typing.Literal, list, tuple) or (
                isinstance(arg, type) and issubclass(arg, enum.Enum)):
            return True
    return False


def _type_name(tp: Any) -> str:
    names = []
    for arg in _union_args(tp):
        if isinstance(arg, type) and issubclass(arg, enum.Enum):
            names.append(f"one of {', '.join(repr(m) for m in arg.__members__)}")
        elif typing.get_origin(arg) is typing.Literal:
            names.append(f"one of {', '.join(repr(a) for a in typing.get_args(arg))}")
        else:
            names.append(getattr(arg, "__name__", None) or str(arg).replace("typing.", ""))
    return " or ".join(names)


def settings_problems(table: Mapping[str, Any]) -> list[str]:
    """One line per key of ``[training.megatron]`` that megatron-core does not have, that Gyre
    owns, or whose value does not fit the field's type (empty: every key will be applied)."""
    targets = _targets()
    problems = []
    for key, value in table.items():
        where = f"training.megatron.{key}"
        if key in OWNED:
            what = OWNED[key]
            instead = f"set {what} instead" if what.startswith(("training.", "the model")) else what
            problems.append(f"{where}: Gyre sets this itself; {instead}")
            continue
        types_ = [t[key] for t in targets.values() if key in t]
        if not types_:
            norm = key.replace("-", "_")
            if norm in MEGATRON_LM_NAMES:
                hint = f" (Megatron-LM's argument; here: {MEGATRON_LM_NAMES[norm]})"
            elif norm in OWNED or any(norm in t for t in targets.values()):
                hint = f" (did you mean {norm}?)"
            else:
                hint = ""
            problems.append(f"{where}: not a field of megatron-core's TransformerConfig, DistributedDataParallelConfig "
                            f"or OptimizerConfig, nor a learning-rate schedule setting{hint}")
            continue
        for tp in types_:
            ok, _ = _convert(tp, value)
            if not ok:
                why = (f"expected {_type_name(tp)}" if _file_can_hold(tp)
                       else f"its type ({_type_name(tp)}) cannot be set from a file")
                problems.append(f"{where}: {value!r} does not fit: {why}")
                break
    return problems


@dataclass(frozen=True)
class MegatronSettings:
    """``[training.megatron]`` split by where each key acts, values converted to the fields' types."""

    transformer: dict[str, Any] = field(default_factory=dict)
    ddp: dict[str, Any] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)


def split_settings(table: Mapping[str, Any]) -> MegatronSettings:
    """The table's keys for each target; a ``ValueError`` with :func:`settings_problems`' lines
    if any key is wrong (the orchestrator's preflight reports them before any rank starts)."""
    problems = settings_problems(table)
    if problems:
        raise ValueError("; ".join(problems))
    out = MegatronSettings()
    for name, fields in _targets().items():
        part = getattr(out, name)
        for key, value in table.items():
            if key in fields:
                part[key] = _convert(fields[key], value)[1]
    return out


def make_scheduler(optimizer: Any, lr: float, total_steps: int, settings: MegatronSettings) -> Any:
    """megatron-core's ``OptimizerParamScheduler`` for the core's optimizer: ``training.lr`` the
    peak, the table's schedule keys over Gyre's steps (see the module docstring)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    s = {**SCHEDULER_DEFAULTS, **settings.scheduler}
    if "min_lr" in settings.optimizer and "min_lr" not in settings.scheduler:
        s["min_lr"] = settings.optimizer["min_lr"]
    steps = max(int(total_steps), 1)
    decay = s["lr_decay_steps"] or steps
    wd = float(settings.optimizer.get("weight_decay", 0.0))  # Gyre's default is no decay
    start_wd = wd if s["start_wd"] is None else s["start_wd"]
    end_wd = wd if s["end_wd"] is None else s["end_wd"]
    # megatron-core asserts these without a message: say which setting is wrong
    for ok, why in ((0 <= s["min_lr"] <= lr, f"min_lr ({s['min_lr']}) must lie in [0, training.lr = {lr}]"),
                    (s["init_lr"] <= lr, f"init_lr ({s['init_lr']}) must not exceed training.lr ({lr})"),
                    (decay > 0, f"lr_decay_steps must be > 0, got {decay}"),
                    (s["lr_warmup_steps"] < decay, f"lr_warmup_steps ({s['lr_warmup_steps']}) must be fewer than "
                                                   f"lr_decay_steps ({decay}; unset: run.steps)"),
                    (s["lr_decay_style"] != "WSD" or s["wsd_decay_steps"] is not None,
                     "lr_decay_style WSD needs wsd_decay_steps"),
                    (0 <= start_wd <= end_wd, f"need 0 <= start_wd ({start_wd}) <= end_wd ({end_wd})"),
                    (s["wd_incr_style"] != "constant" or start_wd == end_wd,
                     "wd_incr_style constant needs start_wd == end_wd")):
        if not ok:
            raise ValueError(why)
    return OptimizerParamScheduler(
        optimizer, init_lr=s["init_lr"], max_lr=lr, min_lr=s["min_lr"],
        lr_warmup_steps=s["lr_warmup_steps"], lr_decay_steps=decay, lr_decay_style=s["lr_decay_style"],
        start_wd=start_wd, end_wd=end_wd,
        wd_incr_steps=s["wd_incr_steps"] or decay, wd_incr_style=s["wd_incr_style"],
        wsd_decay_steps=s["wsd_decay_steps"], lr_wsd_decay_style=s["lr_wsd_decay_style"])


class _StubOptimizer:
    """What the scheduler touches of an optimizer: its parameter groups (preflight only)."""

    def __init__(self) -> None:
        self.param_groups: list[dict[str, Any]] = [{}]


def settings_refused(table: Mapping[str, Any], spec: Any, pp: int = 1, tp: int = 1, ep: int = 1,
                     precision: str = "fp32", total_steps: int = 1, lr: float = 1.0) -> list[str]:
    """What megatron-core's own checks refuse in ``table`` together with the run's model,
    layout, peak learning rate and steps (full recompute without a method, a warm-up longer than
    the decay, a ``min_lr`` above ``training.lr``, ...):
    the stage's configs and the schedule are built as the ranks will build them, nothing is
    allocated. One line per config that refused, empty when all were accepted."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from gyre_megatron.model import transformer_config

    settings = split_settings(table)
    checks = (
        ("TransformerConfig", lambda: transformer_config(spec, pp, tp, precision, ep, settings.transformer)),
        ("DistributedDataParallelConfig", lambda: DistributedDataParallelConfig(**settings.ddp)),
        ("OptimizerConfig", lambda: OptimizerConfig(**settings.optimizer)),
        ("OptimizerParamScheduler", lambda: make_scheduler(_StubOptimizer(), lr, total_steps, settings)),
    )
    problems = []
    for name, build in checks:
        try:
            build()
        except Exception as exc:  # megatron-core's own message says what it wants
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            problems.append(f"training.megatron: megatron-core's {name} refuses these settings: {why}")
    return problems


def apply_schedule(scheduler: Any, step: int) -> float:
    """Set the optimizer's learning rate and weight decay for Gyre step ``step`` (0-based);
    returns the learning rate. A function of ``step`` only, so a resume needs no saved state."""
    scheduler.num_steps = step
    scheduler.step(0)
    group = scheduler.optimizer.param_groups[0]
    return float(group["lr"]) / float(group.get("lr_mult", 1.0) or 1.0)


def signature_keys() -> tuple[str, ...]:
    """The scheduler parameters megatron-core's installed ``OptimizerParamScheduler`` takes
    (a check that :data:`SCHEDULER_DEFAULTS` names only real ones)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return tuple(inspect.signature(OptimizerParamScheduler.__init__).parameters)[2:]
