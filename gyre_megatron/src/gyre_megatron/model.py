"""A megatron-core GPTModel stage of a dense HF family, its DDP grad buffers, and the core's optimizer.

The layout the supported families share (:mod:`gyre_megatron.families`: Qwen2, Qwen3, Llama),
so that weight export has a real serving target: RMSNorm, SwiGLU MLP without biases,
grouped-query attention, RoPE, QKV biases and per-head q/k norms where the family has them,
a router over SwiGLU experts in place of the MLP for a mixture-of-experts family,
untied output layer by default (a tied one, as in
the smaller Qwen2 checkpoints, is kept in step across pipeline stages by summing its gradients over
megatron-core's embedding group; see :mod:`gyre_megatron.runtime`). The local
(non-TransformerEngine) layer spec runs on CPU.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Iterator, Mapping

import torch

__all__ = ["PRECISIONS", "ModelSpec", "build_stage", "gpt_forward_step", "make_optimizer", "megatron_name"]


@dataclass(frozen=True)
class ModelSpec:
    num_layers: int = 4
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int = 2
    vocab_size: int = 128
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    """Output layer shares the input embedding (HF's ``tie_word_embeddings``)."""
    seed: int = 1234
    family: str = "qwen2"
    """The HF family the weights are exported as (:mod:`gyre_megatron.families`)."""
    qkv_bias: bool = True
    """Biases on the query/key/value projections (Qwen2: yes; Llama, Qwen3: as configured)."""
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys before RoPE (Qwen3)."""
    head_dim: int = 0
    """Size of one attention head; 0: ``hidden_size / num_attention_heads``."""
    num_experts: int = 0
    """Experts per MLP (mixture-of-experts families); 0: a dense SwiGLU MLP."""
    experts_per_token: int = 0
    """Experts the router picks for each token (HF ``num_experts_per_tok``)."""
    expert_ffn_hidden_size: int = 0
    """One expert's SwiGLU width (HF ``moe_intermediate_size``)."""
    norm_topk_prob: bool = False
    """The picked experts' router weights are renormalised to sum to one."""
    rope_llama3_factor: float = 0.0
    """Llama 3.x RoPE scaling (HF ``rope_type = "llama3"``): its ``factor``; 0: plain RoPE.
    megatron-core's scaling fixes ``low_freq_factor`` 1, ``high_freq_factor`` 4 and
    ``original_max_position_embeddings`` 8192, the values of every Llama 3.1-3.3 release
    (:data:`LLAMA3_ROPE_FIXED`)."""
    rope_yarn_factor: float = 0.0
    """YaRN RoPE (HF ``rope_type = "yarn"``, Qwen3's long-context setting): its ``factor``; 0: none."""
    rope_yarn_original_positions: int = 0
    """YaRN's ``original_max_position_embeddings``."""
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_attention_factor: float = 1.0
    """YaRN's scale of queries and keys (HF's ``attention_factor``, by default ``0.1·ln(factor) + 1``),
    given to megatron-core as the ``yarn_mscale`` that yields it."""
    rope_yarn_truncate: bool = True
    """YaRN's correction range rounded to whole dimensions (HF's ``truncate``)."""

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


PRECISIONS = ("fp32", "bf16")
"""``fp32``: parameters, activations and optimizer in float32. ``bf16``: parameters, activations
and pipeline messages in bfloat16; gradients reduced and the optimizer (Adam state and master
weights) kept in float32 -- megatron-core's mixed precision."""


def _moe_settings(spec: ModelSpec, tp_size: int, ep_size: int) -> dict[str, Any]:
    """megatron-core's MoE settings for ``spec`` (none for a dense model).

    Expert parallelism is folded onto the tensor group: with ``ep_size == tp_size`` each tensor
    rank holds whole experts (expert tensor parallelism 1); with ``ep_size == 1`` every expert is
    split over the tensor group like the dense MLP. Either way a cell's expert layout stays inside
    its ranks. No load-balancing loss: the RL objective is the only gradient (an auxiliary loss
    would change what the policy optimises, and HF's is a training-time extra too). The
    ``allgather`` dispatcher is the one that runs over gloo. With ``tp_size > 1`` megatron-core
    trains MoE layers only under sequence parallelism: each tensor rank then holds ``1/tp`` of
    the sequence between the tensor-parallel blocks (see :func:`sequence_parallel`)."""
    if not spec.num_experts:
        return {}
    return dict(
        sequence_parallel=sequence_parallel(spec, tp_size),
        num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.expert_ffn_hidden_size,
        moe_router_topk=spec.experts_per_token, moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False, expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=1 if ep_size > 1 else tp_size,
    )


def sequence_parallel(spec: ModelSpec, tp_size: int) -> bool:
    """Whether a stage runs sequence-parallel: a mixture-of-experts model over several tensor
    ranks (megatron-core refuses to train MoE with TP otherwise). Micro-steps are then padded to
    a multiple of ``tp_size`` tokens, pipeline messages carry ``1/tp`` of the sequence, and the
    replicated parameters' gradients are summed over the tensor group."""
    return bool(spec.num_experts) and tp_size > 1


LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The Llama 3 RoPE-scaling parameters megatron-core's ``RotaryEmbedding`` does not take: they
are fixed at these values (a checkpoint with others is refused)."""

TRANSFORMER_IMPLS = ("auto", "transformer_engine", "local")
"""``training.transformer_impl``'s values."""

FUSIONS = ("bias_dropout_fusion", "apply_rope_fusion", "masked_softmax_fusion", "gradient_accumulation_fusion",
           "persist_layer_norm")
"""megatron-core's fused-kernel switches: on with TransformerEngine's spec (as Megatron-LM
trains), off with the local spec (they need CUDA kernels)."""


def transformer_engine_problem() -> str | None:
    """Why TransformerEngine's layer spec cannot run here (``None``: it can): it needs CUDA and
    the ``transformer_engine`` package importable with megatron-core's extension for it."""
    if not torch.cuda.is_available():
        return "TransformerEngine's layers need CUDA, and this machine has no GPU"
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions import transformer_engine as _te  # noqa: F401
    except Exception as e:  # ImportError, or TE's own failure to load its CUDA libraries
        return (f"TransformerEngine does not import here ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}); "
                "install it with pip install --no-build-isolation 'transformer_engine[pytorch]'")
    return None


def resolve_transformer_impl(requested: str) -> str:
    """``transformer_engine`` or ``local`` for ``training.transformer_impl``: ``auto`` takes TE's
    spec where it can run; an explicit ``transformer_engine`` where it cannot is an error."""
    if requested not in TRANSFORMER_IMPLS:
        raise ValueError(f"training.transformer_impl {requested!r}: expected one of {TRANSFORMER_IMPLS}")
    if requested == "local":
        return "local"
    problem = transformer_engine_problem()
    if problem is None:
        return "transformer_engine"
    if requested == "transformer_engine":
        raise ValueError(f"training.transformer_impl = \"transformer_engine\": {problem} (or set it to \"auto\")")
    return "local"


def transformer_config(spec: ModelSpec, pp_size: int, tp_size: int = 1, precision: str = "fp32",
                       ep_size: int = 1, overrides: Mapping[str, Any] | None = None, impl: str = "local") -> Any:
    """megatron-core's ``TransformerConfig`` for one stage: the fields Gyre owns (the shape, the
    layout, precision) from its arguments, Gyre's defaults for the rest (the fused kernels on with
    ``impl = "transformer_engine"``, off with the local spec), and the team's
    ``[training.megatron]`` keys (``overrides``, checked by
    :mod:`gyre_megatron.megatron_settings`) over those defaults."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {PRECISIONS}")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    defaults: dict[str, Any] = dict(
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **{f: impl == "transformer_engine" for f in FUSIONS},
    )
    config = TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        kv_channels=spec.kv_channels,
        qk_layernorm=spec.qk_norm,
        use_cpu_initialization=True,
        pipeline_model_parallel_size=pp_size,
        tensor_model_parallel_size=tp_size,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=precision == "bf16",
        calculate_per_token_loss=True,
        **{**_moe_settings(spec, tp_size, ep_size), **defaults, **dict(overrides or {})},
    )
    if spec.rope_yarn_factor:  # read by GPTModel's YaRN embedding (TransformerConfig has no such fields)
        config.yarn_rotary_scaling_factor = spec.rope_yarn_factor
        config.yarn_original_max_position_embeddings = spec.rope_yarn_original_positions
        config.yarn_beta_fast, config.yarn_beta_slow = spec.rope_yarn_beta_fast, spec.rope_yarn_beta_slow
        # megatron-core scales q and k by 0.1·mscale·ln(factor) + 1: the mscale that gives HF's attention factor
        config.yarn_mscale = ((spec.rope_yarn_attention_factor - 1.0) / (0.1 * math.log(spec.rope_yarn_factor))
                              if spec.rope_yarn_factor > 1 else 1.0)
        config.yarn_mscale_all_dim = 0.0
        config.yarn_correction_range_round_to_int = spec.rope_yarn_truncate
    return config


def megatron_name(name: str) -> str:
    """A parameter's name inside the GPT model, without its wrappers' ``module.`` prefixes (DDP,
    and with bf16 the Float16Module)."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _seed_model_parallel_rng(seed: int) -> None:
    """Megatron's named RNG stream for model-parallel regions (dropout forks it even at p=0)."""
    from megatron.core import tensor_parallel

    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    from megatron.core import parallel_state as ps

    tracker = tensor_parallel.get_cuda_rng_tracker()
    if "model-parallel-rng" not in tracker.states_:
        tracker.add("model-parallel-rng", seed + 2718)
    if "expert-parallel-rng" not in tracker.states_:  # MoE layers fork it (as upstream seeds it)
        tracker.add("expert-parallel-rng", seed + 1024 + 100 * ps.get_expert_model_parallel_rank())


def _router_without_transformer_engine() -> None:
    """megatron-core's router GEMM tests ``te_general_gemm is not None``, a name its module
    defines only when TransformerEngine imports: without TE (the local spec, any CPU) it is
    ``None``, which selects the plain ``torch`` GEMM."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """megatron-core's local norm under sequence parallelism. Upstream's ``WrappedTorchNorm``
    refuses it because nothing would sum its scale's gradient over the tensor group (each rank
    sees its share of the sequence); this one marks the scale ``sequence_parallel`` as
    megatron-core's own norms do, and Gyre's step sums the marked gradients
    (:meth:`gyre_megatron.runtime.CellRank._sum_tensor_partial_grads`)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_unused: Any) -> None:
        super().__init__(normalized_shape=hidden_size, eps=eps)
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))


def _sequence_parallel_block(layer_spec: Any, layers: int) -> Any:
    """A block of ``layers`` copies of ``layer_spec`` with every local norm (the layer's, the
    per-head q/k norms, the final one) a :class:`SequenceParallelRMSNorm`."""
    import dataclasses

    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    def swap(node: Any) -> Any:
        if node is WrappedTorchNorm:
            return SequenceParallelRMSNorm
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            return dataclasses.replace(node, **{f.name: swap(getattr(node, f.name))
                                                for f in dataclasses.fields(node) if f.init})
        return node

    return TransformerBlockSubmodules(layer_specs=[swap(layer_spec)] * layers, layer_norm=SequenceParallelRMSNorm)


def layer_spec_for(spec: ModelSpec, impl: str) -> Any:
    """megatron-core's layer spec for ``impl`` (``transformer_engine`` or ``local``). Experts
    stay one module each (no grouped GEMM) with either, so their parameters keep the names
    (``mlp.experts.local_experts.<e>.*``) the import, the export and publication map; TE's spec
    fuses each layer's norms into ``linear_qkv`` and ``linear_fc1`` (``layer_norm_weight``), names
    both directions know."""
    from megatron.core.models.gpt import gpt_layer_specs

    if impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=spec.num_experts or None, moe_grouped_gemm=False, qk_layernorm=spec.qk_norm)
    return gpt_layer_specs.get_gpt_layer_local_spec(num_experts=spec.num_experts or None, moe_grouped_gemm=False,
                                                    normalization="RMSNorm", qk_layernorm=spec.qk_norm)


def build_stage(spec: ModelSpec, pp_rank: int, pp_size: int, tp_size: int = 1, precision: str = "fp32",
                ep_size: int = 1, settings: Any = None, impl: str = "local") -> tuple[Any, Any]:
    """This rank's shard of one pipeline stage, wrapped in megatron-core DDP (grad buffers, no
    sync). With ``use_cpu_initialization`` megatron-core draws each full weight and keeps this
    rank's slice, so a seeded model starts with the same weights at every ``tp_size``.
    ``settings``: the team's :class:`~gyre_megatron.megatron_settings.MegatronSettings`;
    ``impl``: :func:`resolve_transformer_impl`'s answer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(spec, pp_size, tp_size, precision, ep_size,
                                settings.transformer if settings is not None else None, impl=impl)
    if spec.num_experts and impl == "local":
        _router_without_transformer_engine()
    torch.manual_seed(spec.seed + 1000 * pp_rank)
    _seed_model_parallel_rng(spec.seed)
    layer_spec: Any = layer_spec_for(spec, impl)
    if config.sequence_parallel and impl == "local":  # TE's norms handle sequence parallelism themselves
        layer_spec = _sequence_parallel_block(layer_spec, spec.num_layers // pp_size)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_seq_len,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="yarn" if spec.rope_yarn_factor else "rope",
        rotary_base=int(spec.rope_theta),
        rope_scaling=spec.rope_llama3_factor > 0,
        rope_scaling_factor=spec.rope_llama3_factor or 8.0,
    )
    if torch.cuda.is_available():  # initialised on the host (the same weights at any TP), trained here
        model.cuda(torch.cuda.current_device())
    if precision == "bf16":  # bf16 in, float32 out of the last stage (the loss is taken in float32)
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(**{
        "grad_reduce_in_fp32": True, **(settings.ddp if settings is not None else {}),
        "overlap_grad_reduce": False, "use_distributed_optimizer": False})
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    return ddp, config


def make_optimizer(ddp: Any, lr: float = 1e-3, precision: str = "fp32", settings: Any = None) -> Any:
    """megatron-core's optimizer (Adam, fp32 state) for one stage of the core cell; with
    ``bf16`` parameters it keeps float32 master weights and copies them back after each step.
    Weight decay 0 unless the team's ``settings`` (:class:`~gyre_megatron.megatron_settings.MegatronSettings`)
    say otherwise; their ``OptimizerConfig`` keys (Adam's betas and eps, weight decay, ...) apply.

    ``clip_grad=0``: megatron's clip_grads asserts CUDA tensor types, and Gyre clips on the core
    itself over the core's whole pipeline (see :mod:`gyre_megatron.runtime`).
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    bf16 = precision == "bf16"
    team = settings.optimizer if settings is not None else {}
    cfg = OptimizerConfig(**{"weight_decay": 0.0, **team}, optimizer="adam", lr=lr, clip_grad=0.0, bf16=bf16,
                          fp16=False, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                          use_distributed_optimizer=False)
    return get_megatron_optimizer(cfg, [ddp])


def _per_token_loss(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of (weighted) token losses and the count of weighted tokens: additive over micro-steps."""
    mask = loss_mask.reshape(-1).float()  # 0/1, or the objective's weights W_t
    loss = (output_tensor.float().reshape(-1) * mask).sum()
    n = (mask > 0).sum().to(torch.int)
    return loss, n, {"loss_sum": loss.detach().clone(), "tokens": n.clone()}


def _objective_loss(item: dict[str, torch.Tensor], entropy: torch.Tensor | None, output_tensor: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The core's objective on this micro-step (last pipeline stage): ``output_tensor`` is
    Megatron's per-token cross-entropy ``−log π(label)``, so the current log-probs are its
    negation, with gradient; ``entropy`` (per position) adds ``entropy_sum`` over the trained
    tokens to the figures."""
    from gyre_core.dataplane.objective import ObjectiveConfig, TokenBatch, microstep_objective

    logprobs = -output_tensor.float().reshape(-1)
    labels = item["labels"].reshape(-1)
    batch = TokenBatch(
        token_ids=labels, cu_seqlens=torch.tensor([0, len(labels)], device=labels.device),
        loss_weights=item["loss_mask"].reshape(-1).float(),
        behaviour_logprobs=item["behaviour_logprobs"].reshape(-1).float(),
        advantages=item["advantages"].reshape(-1).float(),
        exec_slots=item["exec_slots"].reshape(-1),
        n_executions=int(item["n_executions"]),
    )
    config = item.get("objective") or ObjectiveConfig()
    loss, stats = microstep_objective(logprobs, batch, config, item.get("outside_sums"), item.get("ref_logprobs"))
    n = (batch.loss_weights > 0).sum().to(torch.int)
    if entropy is not None:
        stats["entropy_sum"] = entropy.reshape(-1)[batch.loss_weights > 0].to(torch.float64).sum()
    return loss, n, {"loss_sum": loss.detach().clone(), "tokens": n.clone(), **stats}


def _ratio_sums(item: dict[str, torch.Tensor], output_tensor: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """A forward-only item of a split execution's other rows: no loss, only their
    ``[Σ W_t δ_t, Σ W_t]`` per execution for the part being trained (see :mod:`.microsteps`)."""
    from gyre_core.dataplane.objective import TokenBatch, log_ratio_sums

    labels = item["labels"].reshape(-1)
    batch = TokenBatch(
        token_ids=labels, cu_seqlens=torch.tensor([0, len(labels)], device=labels.device),
        loss_weights=item["loss_mask"].reshape(-1).float(),
        behaviour_logprobs=item["behaviour_logprobs"].reshape(-1).float(),
        advantages=torch.zeros_like(labels, dtype=torch.float32),
        exec_slots=item["exec_slots"].reshape(-1),
        n_executions=int(item["n_executions"]),
    )
    sums = log_ratio_sums(-output_tensor.detach().float().reshape(-1).double(), batch)
    zero = output_tensor.new_zeros((), dtype=torch.float32)
    return zero, torch.zeros((), dtype=torch.int, device=labels.device), {"ratio_sums": sums}


def _reference_logprobs(item: dict[str, torch.Tensor], output_tensor: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """A micro-step's forward through the reference policy (a KL penalty): no loss, only its
    per-token log-probs, laid out as the trained pass's own (see :func:`_objective_loss`)."""
    zero = output_tensor.new_zeros((), dtype=torch.float32)
    labels = item["labels"]
    return zero, torch.zeros((), dtype=torch.int, device=labels.device), {
        "ref_logprobs": (-output_tensor.detach().float().reshape(-1)).clone()}


def _last_stage(model: Any) -> bool:
    from megatron.core.utils import get_attr_wrapped_model

    return bool(get_attr_wrapped_model(model, "post_process"))


def tempered_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``−log softmax(logits / T)[label]`` per position ([b, s]), with the vocabulary split over
    the tensor-parallel ranks as GPTModel leaves it: megatron-core's own vocab-parallel cross
    entropy on the scaled logits (what ``GPTModel`` computes when ``T = 1``)."""
    from megatron.core import tensor_parallel

    scaled = (logits.float() / temperature.to(logits.device, torch.float32).unsqueeze(-1)).transpose(0, 1)
    loss = tensor_parallel.vocab_parallel_cross_entropy(scaled.contiguous(), labels.transpose(0, 1).contiguous())
    return loss.transpose(0, 1).contiguous()


def vocab_parallel_entropy(logits: torch.Tensor, temperature: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy of ``softmax(logits / T)`` per position ([b, s]; detached), the vocabulary split over
    the tensor-parallel ranks as GPTModel leaves it: the maximum and two sums are all-reduced over
    the tensor-parallel group, so every rank gets the whole vocabulary's entropy."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        z = logits.float()
        if temperature is not None:
            z = z / temperature.to(z.device, torch.float32).unsqueeze(-1)
        tp = ps.get_tensor_model_parallel_world_size()
        top = z.max(dim=-1, keepdim=True).values
        if tp > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
        e = torch.exp(z - top)
        sums = torch.stack([e.sum(dim=-1), (e * (z - top)).sum(dim=-1)])
        if tp > 1:
            dist.all_reduce(sums, group=ps.get_tensor_model_parallel_group())
        return torch.log(sums[0]) - sums[1] / sums[0]


def gpt_forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: Any) -> tuple[torch.Tensor, Any]:
    """Megatron forward-step function for an item ``{tokens, labels, loss_mask, ...}`` ([rows, S]).

    Data-plane items (they carry ``advantages``) are trained on the run's objective, and on the
    last stage their logits also give the policy's entropy at each position (a figure); plain
    items on the per-token loss ``Σ mask · (−log π)``."""
    item = next(data_iterator)
    if torch.cuda.is_available():  # the control channel delivers items in host memory
        dev = torch.device("cuda", torch.cuda.current_device())
        item = {k: v.to(dev, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in item.items()}
    tokens = item["tokens"]
    position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    temperature = item.get("temperature")
    trained = "advantages" in item and "ratio_only" not in item and "reference_only" not in item
    entropy = None
    if (temperature is not None or trained) and _last_stage(model):
        logits = model(tokens, position_ids, None)
        ones = torch.ones_like(item["labels"], dtype=torch.float32)
        out = tempered_cross_entropy(logits, item["labels"], ones if temperature is None else temperature)
        if trained:
            entropy = vocab_parallel_entropy(logits, temperature)
        del logits
    else:
        out = model(tokens, position_ids, None, labels=item["labels"])
    if "ratio_only" in item:
        return out, partial(_ratio_sums, item)
    if "reference_only" in item:
        return out, partial(_reference_logprobs, item)
    if trained:
        return out, partial(_objective_loss, item, entropy)
    return out, partial(_per_token_loss, item["loss_mask"])
