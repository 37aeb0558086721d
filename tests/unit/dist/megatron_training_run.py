"""One run of Megatron-LM's own training loop, ``megatron.training.pretrain``, on CPU gloo ranks.

    torchrun --standalone --nproc-per-node 2 megatron_training_run.py --out DIR \\
        [--import-plugin] MEGATRON_FLAGS...

``--import-plugin`` does ``import megatron_vocabstats.patch`` first, as the patched
pretrain_gpt.py does; every other flag goes to Megatron's parser (the plugin's flags among them).
``forward_step``, ``loss_func`` and the mock-data provider follow Megatron-LM's pretrain_gpt.py
(core 0.19: ``parse_and_validate_args`` -> ``gpt_config_from_args`` ->
``pretrain_cfg_container_from_args`` -> ``pretrain``), without pipeline or context parallelism.
CPU shims: ``tests/unit/megatron_cpu_training.py``. Each rank writes ``DIR/rank<r>.json``: per
iteration the per-token losses, the reported lm loss and grad norm, whether the model's
``last_vocab_stats`` was set by that forward; the plugin's settings, patched names and how often
its unfused op and its fused LM head ran. Run by tests/unit/test_megatron_training_dist.py.
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
RECORD = {"token_losses": [], "lm_loss": [], "grad_norm": [], "stats_set": [],
          "unfused_calls": 0, "fused_calls": 0}


def _count_calls(owner, name, key):
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        RECORD[key] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--import-plugin", action="store_true")
    ours, megatron_argv = parser.parse_known_args()
    sys.argv = [sys.argv[0], *megatron_argv]  # Megatron's parser reads sys.argv
    torch.set_num_threads(1)
    # validate_args requires it under tp > 1 before Blackwell (megatron_cpu_training reports that).
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if ours.import_plugin:
        import megatron_vocabstats.patch  # noqa: F401
        from megatron_vocabstats.megatron import model as plugin_model

        assert plugin_model.LAST_STATS_ATTR == STATS_ATTR
        _count_calls(plugin_model, "vocab_parallel_stats", "unfused_calls")
        _count_calls(plugin_model, "fused_language_model_loss", "fused_calls")

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
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_and_validate_args
    from megatron_cpu_training import cpu_training

    keys = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")

    def get_batch(data_iterator):
        args = get_args()
        tp_rank = mpu.get_tensor_model_parallel_rank()
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
            mtp_on_this_rank=False)
        return [batch[k] for k in keys]

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
        inner = model
        while hasattr(inner, "module"):  # DDP -> (Float16Module) -> GPTModel
            inner = inner.module
        inner.__dict__.pop(STATS_ATTR, None)  # so that "set" below means set by this forward
        output_tensor = model(tokens, position_ids, attention_mask, labels=labels,
                              loss_mask=loss_mask)
        RECORD["stats_set"].append(getattr(inner, STATS_ATTR, None) is not None)
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
        RECORD["lm_loss"].append(float(loss_reduced["lm loss"]))
        RECORD["grad_norm"].append(float(grad_norm))
        return result

    training.train_step = recorded_train_step

    with cpu_training():
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
        config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        pretrain(config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder,
                 forward_step)

    if ours.import_plugin:
        from megatron_vocabstats import patch
        from megatron_vocabstats.megatron import settings

        current = settings.current()
        RECORD["settings"] = {"active": current.active,
                              "lm_head_chunk_size": current.lm_head_chunk_size}
        RECORD["patched"] = patch.patched_names()
    RECORD["plugin_imported"] = "megatron_vocabstats.patch" in sys.modules
    with open(os.path.join(ours.out, f"rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(RECORD, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
