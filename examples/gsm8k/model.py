"""Process groups, the Megatron-Core ``GPTModel``, the optimizer and checkpoints of the example.

CPU (gloo) by default, CUDA (NCCL) when a GPU is present. On CPU the model uses Megatron's local
layer spec and :func:`megatron_vocabstats.testing.megatron_cpu.install_cpu_shims`; on CUDA the
transformer-engine spec when transformer-engine is importable (packed sequences then go through
``packed_seq_params``), else the local spec (packed sequences through a block-diagonal mask).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import math
import os
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from . import report

# Megatron-LM pads the vocabulary to a multiple of this times tp (make_vocab_size_divisible_by).
VOCAB_MULTIPLE = 128
CHECKPOINT_META = "meta.json"


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes that define a checkpoint (saved next to it and checked on load)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    seq_length: int
    position_embedding: str
    tie_embeddings: bool
    tp: int


def model_shape(args, vocab_size: int) -> ModelShape:
    """:class:`ModelShape` from the parsed flags; ``ValueError`` for sizes that cannot work.

    Checked before any process group exists: heads divisible by tp, hidden divisible by heads,
    positive sizes, and context parallelism only where it can run (CUDA + transformer-engine).
    """
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "tp", "cp"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_attention_heads % args.tp:
        raise ValueError(f"--tp {args.tp} must divide --num-attention-heads "
                         f"{args.num_attention_heads} (each tensor-parallel rank holds whole "
                         "heads)")
    if args.hidden_size % args.num_attention_heads:
        raise ValueError(f"--num-attention-heads {args.num_attention_heads} must divide "
                         f"--hidden-size {args.hidden_size}")
    ffn = args.ffn_hidden_size or 4 * args.hidden_size
    if ffn % args.tp:
        raise ValueError(f"--tp {args.tp} must divide --ffn-hidden-size {ffn}")
    if args.cp > 1 and not thd_attention_available():
        raise ValueError(f"--cp {args.cp} needs CUDA and transformer-engine (context-parallel "
                         "attention over packed sequences); use --cp 1 on this machine")
    padded = -(-vocab_size // (VOCAB_MULTIPLE * args.tp)) * VOCAB_MULTIPLE * args.tp
    return ModelShape(args.num_layers, args.hidden_size, args.num_attention_heads, ffn,
                      vocab_size, padded, args.seq_length, args.position_embedding,
                      args.tie_embeddings, args.tp)


def thd_attention_available() -> bool:
    """True with CUDA and transformer-engine: packed (THD) attention via ``packed_seq_params``."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


# --------------------------------------------------------------------------- process groups


@dataclass(frozen=True)
class Parallel:
    """This process's place in the layout: world = tp x cp x dp (Megatron order tp-cp-dp)."""

    rank: int
    world: int
    tp: int
    cp: int
    dp: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    device: torch.device
    tp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    dp_cp_group: dist.ProcessGroup

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def owns_data_shard(self) -> bool:
        """One rank per dp shard writes/keeps per-example results (tp and cp rank 0)."""
        return self.tp_rank == 0 and self.cp_rank == 0


def init_parallel(tp: int, cp: int, seed: int) -> Parallel:
    """Join (or create) the process group and Megatron's model-parallel state.

    Under torchrun the environment gives rank and world; a plain ``python -m`` run is a world of
    one. Backend: NCCL on CUDA, else gloo. Raises ``ValueError`` on every rank when the world
    size is not a multiple of ``tp * cp``.
    """
    from megatron.core import parallel_state

    from megatron_vocabstats.testing.megatron_cpu import install_cpu_shims

    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # port 0: the store binds one of the system's choice
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo",
                                timeout=datetime.timedelta(minutes=10))
    world = dist.get_world_size()
    if world % (tp * cp):
        raise ValueError(f"the world size {world} (torchrun --nproc-per-node x nodes) must be a "
                         f"multiple of --tp {tp} x --cp {cp}")
    if parallel_state.model_parallel_is_initialized():
        if (parallel_state.get_tensor_model_parallel_world_size() != tp
                or parallel_state.get_context_parallel_world_size() != cp):
            raise ValueError("Megatron's model-parallel state is already initialised with "
                             "other sizes than --tp/--cp")
    else:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                                 context_parallel_size=cp)
    install_cpu_shims()
    if cuda:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return Parallel(
        rank=dist.get_rank(), world=world, tp=tp, cp=cp, dp=world // (tp * cp),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        device=torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        cp_group=parallel_state.get_context_parallel_group(),
        dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
    )


# --------------------------------------------------------------------------- model


def build_model(shape: ModelShape, args, par: Parallel):
    """Megatron-Core ``GPTModel`` with ``shape`` on ``par``; fp32 parameters.

    Dropout is 0 by default (``--dropout``) so that the plugin/native comparison sees identical
    activations. ``calculate_per_token_loss`` is on and :func:`finalize_grads` divides the
    summed gradients by the global number of loss tokens (Megatron's per-token loss mode).
    """
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs
    from megatron.core.transformer.transformer_config import TransformerConfig

    cuda = par.device.type == "cuda"
    config = TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads, ffn_hidden_size=shape.ffn_hidden_size,
        tensor_model_parallel_size=par.tp, context_parallel_size=par.cp,
        sequence_parallel=bool(args.sequence_parallel),
        use_cpu_initialization=not cuda, params_dtype=torch.float32,
        hidden_dropout=args.dropout, attention_dropout=args.dropout,
        calculate_per_token_loss=True,
        enable_autocast=bool(args.bf16), autocast_dtype=torch.bfloat16 if args.bf16 else None,
    )
    if thd_attention_available():
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec()
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=shape.padded_vocab_size, max_sequence_length=shape.seq_length,
                     position_embedding_type=shape.position_embedding,
                     share_embeddings_and_output_weights=shape.tie_embeddings)
    model.to(par.device)
    config.finalize_model_grads_func = lambda models, num_tokens=None, **_: finalize_grads(
        models[0], num_tokens, par)
    return model


def finalize_grads(model, num_tokens, par: Parallel) -> None:
    """Sum gradients over data/context-parallel replicas and divide by the global token count.

    The schedule's ``finalize_model_grads_func`` under ``calculate_per_token_loss``: the loss
    functions return sums, so this turns them into the mean over all loss tokens of the step.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if par.dp * par.cp > 1:
        for g in grads:
            dist.all_reduce(g, group=par.dp_cp_group)
    if num_tokens is None:
        return
    total = num_tokens.to(device=par.device, dtype=torch.float32).reshape(())
    if par.dp * par.cp > 1:
        dist.all_reduce(total, group=par.dp_cp_group)
    torch._foreach_div_(grads, total.clamp(min=1.0))


def clip_grad_norm_(model, max_norm: float, par: Parallel) -> torch.Tensor:
    """Clip gradients to global norm ``max_norm`` (tensor-parallel aware); returns the norm.

    Shards of tensor-parallel parameters (Megatron marks them ``tensor_model_parallel``) are
    summed over the tp group; replicated parameters count once.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    sharded = [p.grad for p in params if getattr(p, "tensor_model_parallel", False)]
    replicated = [p.grad for p in params if not getattr(p, "tensor_model_parallel", False)]

    def square_sum(grads):
        if not grads:
            return torch.zeros((), device=par.device)
        return torch.stack(torch._foreach_norm(grads)).float().square().sum()

    local = square_sum(sharded)
    if par.tp > 1:
        dist.all_reduce(local, group=par.tp_group)
    norm = (local + square_sum(replicated)).sqrt()
    if max_norm > 0:
        torch._foreach_mul_(sharded + replicated, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


def make_optimizer(model, args):
    """AdamW (decay on matrices only) and a linear-warmup cosine schedule to 10% of ``--lr``."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
        fused=True)  # on CPU the default per-tensor loop costs seconds per step at 74M params
    warmup = max(1, min(args.warmup_steps, args.steps))

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --------------------------------------------------------------------------- schedule


def run_schedule(model, forward_step, items, *, forward_only: bool, seq_length: int) -> list:
    """One pass of Megatron's ``get_forward_backward_func()`` over ``items`` (one per microbatch).

    Returns the schedule's per-microbatch results (what each loss function reported).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_vocabstats.testing.megatron_cpu import cuda_factories_on_cpu

    items = list(items)
    with cuda_factories_on_cpu():
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(items), model=[model],
            num_microbatches=len(items), seq_length=seq_length, micro_batch_size=1,
            forward_only=forward_only)


# --------------------------------------------------------------------------- checkpoints


def _shard_name(tp_rank: int) -> str:
    return f"model_tp_rank{tp_rank:02d}.pt"


def _read_meta(path: str) -> dict:
    """The sizes a checkpoint directory records; ``ValueError`` naming --load if unreadable."""
    meta_path = os.path.join(path, CHECKPOINT_META)
    if not os.path.isfile(meta_path):
        raise ValueError(f"--load: {path} is not a checkpoint of this example ({CHECKPOINT_META} "
                         "missing)")
    try:
        with open(meta_path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8 or not JSON
        raise ValueError(f"--load: {meta_path} is not a readable checkpoint description "
                         f"({exc})") from None
    if not isinstance(saved, dict):
        raise ValueError(f"--load: {meta_path} must hold a JSON object, got "
                         f"{type(saved).__name__}")
    return saved


def saved_shape(path: str) -> dict:
    """The model flags a checkpoint records (``tp``, ``num_layers``, ...; ``ffn_hidden_size``
    as built), ``{}`` if it records none readable (:func:`check_checkpoint` then says why)."""
    try:
        saved = _read_meta(path)
    except ValueError:
        return {}
    kinds = {"tp": int, "num_layers": int, "hidden_size": int, "num_attention_heads": int,
             "ffn_hidden_size": int, "position_embedding": str, "tie_embeddings": bool}
    # A value of another type is left to the flag's default (check_checkpoint names it).
    return {k: saved[k] for k, kind in kinds.items() if k in saved
            and type(saved[k]) is kind}


def check_checkpoint(path: str, shape: ModelShape) -> None:
    """Raise ``ValueError`` unless ``path`` holds a checkpoint saved with ``shape``."""
    saved = _read_meta(path)
    differ = {k: (v, saved.get(k)) for k, v in asdict(shape).items()
              if k != "seq_length" and saved.get(k) != v}
    if differ:
        listed = ", ".join(f"{k}: run {mine}, checkpoint {theirs}"
                           for k, (mine, theirs) in differ.items())
        raise ValueError(f"--load: {path} was saved with other sizes ({listed})")
    for r in range(shape.tp):
        if not os.path.isfile(os.path.join(path, _shard_name(r))):
            raise ValueError(f"--load: {path} lacks {_shard_name(r)}")


def load_checkpoint(model, path: str, par: Parallel) -> None:
    state = torch.load(os.path.join(path, _shard_name(par.tp_rank)), map_location=par.device,
                       weights_only=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"--load: {path} does not match the model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")


def save_checkpoint(model, path: str, shape: ModelShape, par: Parallel) -> None:
    """Each tp rank's parameters (written by dp/cp rank 0) and ``meta.json``, each file
    atomically. ``meta.json`` (what :func:`check_checkpoint` looks for) is removed first and
    written last, once every shard is in place, so a run interrupted while replacing a
    checkpoint leaves one that is refused, never a mix of two."""
    writer = par.cp_rank == 0 and par.dp_rank == 0
    meta = os.path.join(path, CHECKPOINT_META)
    if writer and par.tp_rank == 0 and os.path.lexists(meta):
        os.remove(meta)
    dist.barrier()
    if writer:
        state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        report.atomic_write(os.path.join(path, _shard_name(par.tp_rank)),
                            lambda f: torch.save(state, f), binary=True)
    dist.barrier()
    if writer and par.tp_rank == 0:
        report.atomic_write(meta, lambda f: json.dump(asdict(shape), f, indent=1))
    dist.barrier()
