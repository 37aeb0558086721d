"""Megatron-LM's own training loop, ``megatron.training.pretrain``, on CPU gloo ranks: several runs
of one layout in one launch.

    torchrun --standalone --nproc-per-node 2 megatron_training_run.py --out DIR \\
        --runs '[{"name": "megatron", "flags": []}, {"name": "fused", "flags": [...]}]' \\
        MEGATRON_FLAGS...

Every run trains the same tiny model from the same seed on Megatron's mock data, with the common
``MEGATRON_FLAGS`` plus its own ``flags``, in this process one after the other: Megatron's global
state is torn down between runs (``training.destroy_global_state``, as its in-process restart
does), so one launch (one interpreter start and Megatron import per rank, the bulk of a run's
time on CPU) serves a whole layout. A run's flags may hold, besides Megatron's and the plugin's:
``--import-plugin`` (``import megatron_vocabstats.patch`` before this run, as the patched
pretrain_gpt.py does; it stays imported for the later runs, so runs without it come first),
``--uneven-loss-mask`` (micro-batch k masks a different number of leading tokens of its first
sequence: the loss masks' counts differ per micro-batch) and ``--hybrid`` (a ``HybridModel``
from ``megatron_cpu_training.HYBRID_CPU_SPEC``, attention layers only).

``forward_step``, ``loss_func`` and the mock-data provider follow Megatron-LM's pretrain_gpt.py
(core 0.19: ``parse_and_validate_args`` -> ``gpt_config_from_args`` (``hybrid_config_from_args``)
-> ``pretrain_cfg_container_from_args`` -> ``pretrain``). CPU shims: ``megatron_cpu_training``.
Each rank writes ``DIR/rank<r>.json``, per run: per micro-batch the per-token losses (last
pipeline stage), per iteration the reported lm loss and grad norm, whether ``last_vocab_stats``
(and ``last_mtp_vocab_stats``) was set by the forward, the loss masks' counts, the MTP losses
and acceptance counts Megatron logged, the layout the model was built with; the plugin's settings, patched names and how often its unfused op, its fused LM
head and its fused MTP loss ran. Run by tests/unit/test_megatron_training_dist.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STATS_ATTR = "last_vocab_stats"  # megatron_vocabstats.megatron.model.LAST_STATS_ATTR
MTP_STATS_ATTR = "last_mtp_vocab_stats"  # megatron_vocabstats.megatron.model.LAST_MTP_STATS_ATTR
COUNTERS = ("unfused_calls", "fused_calls", "fused_mtp_calls")
RECORD: dict = {}


def _new_record() -> dict:
    return {"token_losses": [], "lm_loss": [], "grad_norm": [], "stats_set": [],
            "mtp_stats_set": [], "mtp": [], **{key: 0 for key in COUNTERS}}


def _count_calls(owner, name, key):
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        RECORD[key] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def _import_plugin():
    import megatron_vocabstats.patch  # noqa: F401
    from megatron_vocabstats.megatron import model as plugin_model
    from megatron_vocabstats.megatron import mtp as plugin_mtp

    assert (plugin_model.LAST_STATS_ATTR, plugin_model.LAST_MTP_STATS_ATTR) == (
        STATS_ATTR, MTP_STATS_ATTR)
    _count_calls(plugin_model, "vocab_parallel_stats", "unfused_calls")
    _count_calls(plugin_model, "fused_language_model_loss", "fused_calls")
    _count_calls(plugin_mtp, "fused_mtp_loss", "fused_mtp_calls")


def _record_mtp_metrics():
    """Record Megatron's MTP log of each iteration: the tracker right after its reduction."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    reduce = MTPLossLoggingHelper.reduce_metrics_in_tracker

    def reduce_and_record():
        reduce()
        tracker = MTPLossLoggingHelper.tracker
        RECORD["mtp"].append({key: tracker[key].tolist() for key in
                              ("loss_values", "correct_values", "total_values") if key in tracker})

    MTPLossLoggingHelper.reduce_metrics_in_tracker = staticmethod(reduce_and_record)


def _unwrapped(model):
    while hasattr(model, "module"):  # DDP -> (Float16Module) -> GPTModel / HybridModel
        model = model.module
    return model


def train(run: argparse.Namespace, megatron_argv: list[str]) -> None:
    """One ``pretrain`` of the tiny model with ``megatron_argv``; fills RECORD."""
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.enums import ModelType
    from megatron.core.utils import get_batch_on_this_tp_rank
    from megatron.training import get_args, get_tokenizer, pretrain, training
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        hybrid_config_from_args,
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_and_validate_args
    from megatron_cpu_training import cpu_training

    keys = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    micro_batches = []

    def get_batch(data_iterator):
        args = get_args()
        tp_rank = mpu.get_tensor_model_parallel_rank()
        first, last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
        batch = {}
        if tp_rank == 0:  # tp rank 0 reads, the others receive (pretrain_gpt.py's get_batch)
            batch = {k: v.cuda(non_blocking=True) if torch.is_tensor(v) else v
                     for k, v in next(data_iterator).items()}
        batch = get_batch_on_this_tp_rank(
            batch, has_cu_seqlens=False, is_hybrid_cp=False,
            create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
            broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
            broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=1, tp_rank=tp_rank,
            micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
            mtp_on_this_rank=False,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            is_pipeline_first_stage=first, is_pipeline_last_stage=last)
        if run.uneven_loss_mask and batch.get("loss_mask") is not None:
            k = len(micro_batches)
            batch["loss_mask"] = batch["loss_mask"].clone()
            batch["loss_mask"][0, : 1 + (5 * k) % 13] = 0.0
        micro_batches.append(1)
        return [batch.get(k) for k in keys]

    def loss_func(loss_mask, output_tensor):
        losses = output_tensor.view(-1).float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * loss_mask)
        num_tokens = loss_mask.sum().clone().detach().to(torch.int)
        RECORD["token_losses"].append(losses.detach().tolist())
        return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1),
                                                        num_tokens.view(1)])}

    def forward_step(data_iterator, model, return_schedule_plan=False):
        tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
        inner = _unwrapped(model)
        for attr in (STATS_ATTR, MTP_STATS_ATTR):  # so that "set" means set by this forward
            inner.__dict__.pop(attr, None)
        output_tensor = model(tokens, position_ids, attention_mask, labels=labels,
                              loss_mask=loss_mask)
        config = inner.config
        RECORD["layout"] = {
            "model": type(inner).__name__, "tp": config.tensor_model_parallel_size,
            "pp": config.pipeline_model_parallel_size,
            "sequence_parallel": config.sequence_parallel,
            "tied": inner.share_embeddings_and_output_weights,
            "mtp_num_layers": config.mtp_num_layers or 0,
            "calculate_per_token_loss": config.calculate_per_token_loss}
        if loss_mask is not None:
            RECORD.setdefault("mask_counts", []).append(int(loss_mask.sum()))
        if mpu.is_pipeline_last_stage():
            RECORD["stats_set"].append(getattr(inner, STATS_ATTR, None) is not None)
            depths = getattr(inner, MTP_STATS_ATTR, None)
            RECORD["mtp_stats_set"].append(-1 if depths is None else len(depths))
        return output_tensor, partial(loss_func, loss_mask)

    def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
        args = get_args()
        config = GPTDatasetConfig(
            random_seed=args.seed, sequence_length=args.seq_length, blend=None,
            blend_per_split=None, split=args.split, path_to_cache=args.data_cache_path,
            tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
            reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
            create_attention_mask=args.create_attention_mask_in_dataloader)
        return BlendedMegatronDatasetBuilder(
            MockGPTDataset, train_val_test_num_samples,
            lambda: mpu.get_tensor_model_parallel_rank() == 0, config).build()

    train_valid_test_datasets_provider.is_distributed = True

    train_step = training.train_step

    def recorded_train_step(*args, **kwargs):
        result = train_step(*args, **kwargs)
        loss_reduced, grad_norm = result[0], result[5]
        if "lm loss" in loss_reduced:  # the last pipeline stage
            RECORD["lm_loss"].append(float(loss_reduced["lm loss"]))
        RECORD["grad_norm"].append(float(grad_norm))
        return result

    sys.argv = [sys.argv[0], *megatron_argv]  # Megatron's parser reads sys.argv
    training.train_step = recorded_train_step
    model_config = hybrid_config_from_args if run.hybrid else gpt_config_from_args
    try:
        with cpu_training():
            args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
            config = pretrain_cfg_container_from_args(args, model_config(args))
            pretrain(config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder,
                     forward_step)
    finally:
        training.train_step = train_step
        training.destroy_global_state()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", required=True, type=json.loads)
    ours, common = parser.parse_known_args()
    run_parser = argparse.ArgumentParser()
    for flag in ("--import-plugin", "--uneven-loss-mask", "--hybrid"):
        run_parser.add_argument(flag, action="store_true")
    torch.set_num_threads(1)
    # validate_args requires it under tp > 1 before Blackwell (megatron_cpu_training reports that).
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    results = {}
    recording = False
    for spec in ours.runs:
        run, megatron_flags = run_parser.parse_known_args(spec["flags"])
        if run.import_plugin and "megatron_vocabstats.patch" not in sys.modules:
            _import_plugin()
        if not recording:
            _record_mtp_metrics()
            recording = True
        RECORD.clear()
        RECORD.update(_new_record())
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        MTPLossLoggingHelper.tracker.clear()
        # Where each run's log starts (the test cuts the log at rank 0's markers).
        print(f"@@run {spec['name']} rank {os.environ.get('RANK', '0')}", flush=True)
        train(run, [*common, *megatron_flags])
        if "megatron_vocabstats.patch" in sys.modules:  # the next run is a new run: its own line
            from megatron_vocabstats.megatron import announce

            announce.reset()
        if "megatron_vocabstats.patch" in sys.modules:
            from megatron_vocabstats import patch
            from megatron_vocabstats.megatron import settings

            current = settings.current()
            RECORD["settings"] = {"active": current.active,
                                  "lm_head_chunk_size": current.lm_head_chunk_size}
            RECORD["patched"] = patch.patched_names()
        RECORD["plugin_imported"] = "megatron_vocabstats.patch" in sys.modules
        results[spec["name"]] = dict(RECORD)
    rank = torch.distributed.get_rank()
    with open(os.path.join(ours.out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
