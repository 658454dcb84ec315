"""Shared machinery of the megatron-core CPU patches: a ``torch`` stand-in that maps CUDA to CPU.

Why a proxy instead of editing site-packages or monkeypatching torch globally: Megatron's
CUDA-only lines use the module-level name ``torch`` (``torch.zeros(..., device="cuda")``,
``torch.cuda.current_device()``, ``torch.cuda.synchronize()``). Replacing that *name* inside the
few Megatron modules that need it redirects exactly those lines and nothing else in the process;
:meth:`Redirection.revert` puts the real ``torch`` back.

What the proxy changes, and only inside the patched modules:

* any ``device=`` argument (or ``torch.device(...)``) naming CUDA -- ``"cuda"``, ``"cuda:N"``, an
  integer index, a CUDA ``torch.device`` -- becomes the CPU; ``pin_memory=True`` is dropped;
* ``torch.cuda`` becomes :class:`CpuCuda`: ``current_device()`` answers the CPU device,
  ``synchronize``/``empty_cache`` do nothing, ``stream(...)`` is a null context, and the RNG calls
  use the CPU generator.

Everything else (types, dtypes, submodules, functions without CUDA arguments) is the real torch
object, so ``isinstance`` checks and ``torch.distributed`` work unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

if TYPE_CHECKING:
    from packaging.specifiers import SpecifierSet

_CPU = torch.device("cpu")


def is_cuda_absent() -> bool:
    """The only condition under which a patch may be applied."""
    return not torch.cuda.is_available()


def _map_device(dev: Any) -> Any:
    if isinstance(dev, int) and not isinstance(dev, bool):
        return _CPU
    if isinstance(dev, str) and dev.startswith("cuda"):
        return _CPU
    if isinstance(dev, torch.device) and dev.type == "cuda":
        return _CPU
    return dev


def _wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    return call


class _NullStream:
    """Stands in for a CUDA stream: CPU work is already ordered."""

    def wait_stream(self, _other: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, *_a: Any, **_k: Any) -> None:
        return None


class CpuCuda:
    """``torch.cuda`` as seen from a patched Megatron module on a CPU-only machine."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return 0

    @staticmethod
    def synchronize(*_a: Any, **_k: Any) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def stream(*_a: Any, **_k: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(*_a: Any, **_k: Any) -> _NullStream:
        return _NullStream()

    default_stream = current_stream

    @staticmethod
    def Stream(*_a: Any, **_k: Any) -> _NullStream:  # noqa: N802 - mirrors torch.cuda.Stream
        return _NullStream()

    @staticmethod
    def get_rng_state(*_a: Any, **_k: Any) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, *_a: Any, **_k: Any) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed


class CpuTorch(types.ModuleType):
    """The ``torch`` name inside a patched module (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.__dict__["cuda"] = CpuCuda()
        self.__dict__["device"] = lambda *a, **k: _map_device(torch.device(*a, **k))
        self.__dict__["_gyre_cpu_redirect"] = True

    def __getattr__(self, name: str) -> Any:
        obj = getattr(torch, name)
        if isinstance(obj, (types.BuiltinFunctionType, types.FunctionType)):
            obj = _wrap(obj)
            self.__dict__[name] = obj  # cache
        return obj


@dataclass
class Redirection:
    """Which module globals were replaced, so the patch can be reverted (tests do)."""

    replaced: list[tuple[types.ModuleType, str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def revert(self) -> None:
        for mod, name, old in reversed(self.replaced):
            setattr(mod, name, old)
        self.replaced.clear()


def redirect_modules(module_names: Iterable[str], redirection: Redirection) -> None:
    """Point the global name ``torch`` of each module at one :class:`CpuTorch`."""
    proxy = CpuTorch()
    for name in module_names:
        mod = importlib.import_module(name)
        if getattr(mod, "torch", None) is not torch:
            raise RuntimeError(f"{name}: module-level 'torch' is not torch; refusing to patch")
        redirection.replaced.append((mod, "torch", mod.torch))
        mod.torch = proxy  # type: ignore[attr-defined]


def install_cpu_rng_tracker(redirection: Redirection) -> None:
    """Replace Megatron's CUDA RNG tracker by one that forks the CPU generator.

    The tracker keeps named RNG states (model-parallel dropout); upstream stores CUDA generator
    states and swaps them with ``_set_cuda_rng_state``, which needs a CUDA device.
    """
    random = importlib.import_module("megatron.core.tensor_parallel.random")

    class CpuRNGStatesTracker(random.CudaRNGStatesTracker):  # type: ignore[misc, name-defined]
        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Any:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    for attr in ("_CUDA_RNG_STATE_TRACKER", "_CUDA_RNG_STATE_TRACKER_INITIALIZED"):
        if hasattr(random, attr):
            redirection.replaced.append((random, attr, getattr(random, attr)))
    random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    redirection.notes.append("cpu rng tracker")

    # Activation recompute (CheckpointFunction) saves the "CUDA" generator's state beside the
    # CPU one and restores both before recomputing: on CPU the CPU generator is the only one,
    # and the caller restores it itself, so the device state is the CPU's and setting it is a no-op.
    def get_state(*_a: Any, **_k: Any) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(*_a: Any, **_k: Any) -> None:
        return None

    for attr, fn in (("_get_cuda_rng_state", get_state), ("_set_cuda_rng_state", set_state)):
        if hasattr(random, attr):
            redirection.replaced.append((random, attr, getattr(random, attr)))
            setattr(random, attr, fn)


def redirect_tensor_cuda(redirection: Redirection) -> None:
    """Make ``Tensor.cuda()`` return the tensor itself (0.13's schedules call it; every release's
    ``LanguageModule.setup_embeddings_and_output_layer`` calls it to sync tied embeddings across
    pipeline stages).

    This one is process-wide; it is safe only because it is applied solely when CUDA is absent,
    where ``Tensor.cuda()`` could only raise.
    """
    redirection.replaced.append((torch.Tensor, "cuda", torch.Tensor.cuda))  # type: ignore[arg-type]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign, assignment]
    redirection.notes.append("Tensor.cuda -> identity")


def apply_common(module_names: Iterable[str], tensor_cuda: bool = False) -> Redirection:
    if not is_cuda_absent():
        raise RuntimeError("Gyre's megatron CPU patches must never be applied when CUDA is present")
    r = Redirection()
    try:
        redirect_modules(module_names, r)
        install_cpu_rng_tracker(r)
        if tensor_cuda:
            redirect_tensor_cuda(r)
    except Exception:
        r.revert()
        raise
    return r


CUDA_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.utils",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    # mixture of experts: the router moves its weight to ``torch.cuda.current_device()`` at each
    # forward; the dispatcher, the experts and the MoE utilities allocate on it
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.token_dispatcher",
    # sequence parallelism (MoE with TP): the scatter/gather buffers are allocated on the device
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    # activation recompute: CheckpointFunction reads torch.cuda's generator state
    "megatron.core.tensor_parallel.random",
    # YaRN RoPE: moves its frequencies to ``torch.cuda.current_device()`` at each forward
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
)
"""The megatron-core modules with CUDA-only lines, 0.13 to 0.16 alike."""


def apply_for(
    target: SpecifierSet, version: str, module_names: Iterable[str], tensor_cuda: bool = False
) -> Redirection:
    """Apply a version's redirection; refuse any ``version`` outside its ``target``."""
    if version not in target:
        raise ValueError(f"this patch targets megatron-core {target}, not {version}")
    return apply_common(module_names, tensor_cuda=tensor_cuda)
